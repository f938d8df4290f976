//! The test kit: what the coordinator's integration tests and its bench share, written once.
//!
//! - [`process`]: the coordinator binary as a child process, ready when its health says so.
//! - [`database`]: a fresh database per test on either store, and direct looks at its rows.
//! - [`proxy`]: a TCP proxy between the service and PostgreSQL that can be cut or black-holed.
//! - [`load`]: concurrent callers looping until told to stop, with latencies in a histogram.
//!
//! Helpers in `database` and `proxy` panic on failure, as test helpers do; `process` and `load`
//! answer errors, since the bench uses them too.

#![forbid(unsafe_code)]

pub mod database;
pub mod health;
pub mod load;
pub mod process;
pub mod proxy;

pub use database::{Backend, TestDatabase};
pub use process::{Binary, ServerProcess};
