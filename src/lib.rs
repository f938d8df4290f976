//! The idempotency coordinator: claims idempotency keys, stores and replays the results of
//! operations, and deduplicates consumed events, for services in any language, over gRPC, on one
//! shared PostgreSQL store or an embedded SQLite file. See ARCHITECTURE.md for the map and the
//! invariants, and docs/contract.md for the behaviour callers rely on.

#![forbid(unsafe_code)]

pub mod auth;
pub mod cli;
pub mod config;
pub mod domain;
pub mod grpc;
pub mod health;
pub mod metrics;
pub mod readiness;
pub mod reaper;
pub mod service;
pub mod shutdown;
pub mod startup;
pub mod store;
pub mod supervise;
pub mod telemetry;

/// Code generated from `proto/` by `build.rs`.
pub mod proto {
    pub mod idempotency {
        pub mod v1 {
            #![allow(clippy::all, clippy::pedantic)]
            tonic::include_proto!("idempotency.v1");
        }
    }

    /// The descriptors of `idempotency.v1` and its imports, served by reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/idempotency_descriptor.bin"));
}

pub use startup::Application;
