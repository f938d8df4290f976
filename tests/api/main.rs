//! Integration tests: the real server on port 0, a fresh PostgreSQL database per test, called
//! through the generated client (and, where it matters, as a real process and through grpcurl).

mod support;

mod admin;
mod cli_docs;
mod clock_skew;
mod clusters;
mod coalescing;
mod complete;
mod contract_rules;
mod embedded;
mod extend_lease;
mod failover;
mod faults;
mod gateway;
mod grpcurl;
mod health;
mod held_keys;
mod hostile;
mod hostile_clients;
mod hostile_environment;
mod lookup;
mod mark_processed;
mod metrics;
mod model;
mod pgbouncer;
mod reaching_postgres;
mod reflection;
mod release;
mod replay_cache;
mod retention;
mod rust_client;
mod security;
mod shutdown;
mod store_suite;
mod traces;
mod try_start;
mod validation;
mod wait;
