//! Complete: the stored response and how long it is kept, what a repeat or a stale token is
//! told, and what concurrent or waiting writes and a shared batch end up with.

mod batch;
mod fencing;
mod races;
mod response;
mod retention;
