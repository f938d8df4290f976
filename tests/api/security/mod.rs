//! Tenants and transport security: nobody reaches a namespace they were not given.

mod limits;
mod logs;
mod reload;
mod tokens;
mod transport;
