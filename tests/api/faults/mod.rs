//! Proof under faults: replicas racing, a crash, a database outage, shutdown under load, and
//! callers that give up, one scenario per file. Every scenario counts exactly what was
//! acknowledged and checks it against the store afterwards: nothing lost, nothing duplicated.
//! Each prints its figures (`cargo nextest run faults --no-capture`), which docs/reliability.md
//! records.

mod crash;
mod deadline;
mod outage;
mod replicas;
mod sigterm;
