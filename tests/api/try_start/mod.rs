//! TryStart, the claim: what each answer means, how a retry re-enters its own claim, how an
//! expired lease is taken over, and what concurrent and waiting claims end up with.

mod fencing;
mod held;
mod outcomes;
mod races;
mod reentry;
mod takeover;
