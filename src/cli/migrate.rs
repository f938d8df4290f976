//! `idempotency-coordinator migrate`: applies the store's migrations (and, with `--grant-to`,
//! grants the serving role its rights), then exits; a failure names its cause.

use anyhow::Context;

use crate::config::MigrateArgs;
use crate::store::{AnyStore, Store};

/// Migrates the store `args` name.
pub async fn run(args: &MigrateArgs) -> anyhow::Result<()> {
    let store = AnyStore::open_lazy_for_tool(&args.store_settings()?)?;
    store
        .migrate_granting(args.grant_to.as_deref())
        .await
        .context("migrating")?;
    tracing::info!("schema migrations applied");
    store.close().await;
    Ok(())
}
