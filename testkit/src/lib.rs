//! The test kit: what the coordinator's integration tests and its bench share, written once.
//!
//! - [`process`]: the coordinator binary as a child process, ready when its health says so.
//! - [`database`]: a fresh database per test on either store, and direct looks at its rows.
//! - [`proxy`]: a TCP proxy between the service and PostgreSQL that can be cut or black-holed.
//! - [`fault_proxy`]: the clients' gRPC fault proxy binary as a child process, and its controls.
//! - [`load`]: concurrent callers looping until told to stop, with latencies in a histogram.
//!
//! Helpers in `database` and `proxy` panic on failure, as test helpers do; `process`, `fault_proxy` and `load`
//! answer errors, since the bench uses them too.

#![forbid(unsafe_code)]

pub mod database;
pub mod fault_proxy;
pub mod health;
pub mod load;
pub mod process;
pub mod proxy;

pub use database::{Backend, TestDatabase};
pub use fault_proxy::FaultProxy;
pub use process::{Binary, ServerProcess};
