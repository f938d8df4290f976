//! The binary's commands other than `serve` (which is `startup`) and `gateway` (the gateway
//! crate's): each a client of the service or of the store through their public API, above
//! them in the dependency order (nothing below `cli` uses it).
//!
//! - `admin`: the operator's CLI, a client of the admin API (`idempotency.v1.AdminService`).
//! - `healthcheck`: one `grpc.health.v1` Check, the answer in the exit status.
//! - `token`: `token new`, a caller's token and its line for the tokens file.
//! - `migrate`: the store's migrations, and `--grant-to`.
//! - `completions`, `man`: the binary's completion scripts and man pages (`docs`).

pub mod admin;
pub mod docs;
pub mod healthcheck;
pub mod migrate;
pub mod token;
pub mod transport;
