//! Every bound of the contract's table, on both sides of the edge: the value just inside is
//! accepted, the value just outside is INVALID_ARGUMENT with one violation naming the field, and
//! a refused request writes nothing.

mod claims;
mod events;
mod wire;
mod writes;

const DAY: u64 = 24 * 3600;

fn dur(seconds: i64, nanos: i32) -> Option<prost_types::Duration> {
    Some(prost_types::Duration { seconds, nanos })
}
