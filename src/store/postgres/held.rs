//! Which of a failed shared statement's rows another transaction holds now, in one statement:
//! so that only the calls of those rows wait for them (in the held-key lane), and the batch's
//! other calls run again at once instead of behind them.

use super::PgStore;
use super::error::classify;
use super::sql::HELD_ROWS;
use crate::store::{Row, StoreError};

impl PgStore {
    /// For each of `rows`, whether another transaction holds a lock on it now that a write of
    /// this service would wait for. A row not yet committed by another transaction (an insert
    /// in flight) is not seen, and reads as free.
    pub(super) async fn held_rows_now(&self, rows: &[Row<'_>]) -> Result<Vec<bool>, StoreError> {
        let (mut namespaces, mut keys, mut consumers, mut ids) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for row in rows {
            match row {
                Row::Key { namespace, key } => {
                    namespaces.push(*namespace);
                    keys.push(*key);
                }
                Row::Event { consumer, id } => {
                    consumers.push(*consumer);
                    ids.push(*id);
                }
            }
        }
        let held: Vec<(bool, String, String)> = self
            .fetch_all(
                sqlx::query_as(HELD_ROWS)
                    .bind(&namespaces)
                    .bind(&keys)
                    .bind(&consumers)
                    .bind(&ids),
            )
            .await
            .map_err(classify)?;
        Ok(rows
            .iter()
            .map(|row| {
                held.iter().any(|(is_key, first, second)| match row {
                    Row::Key { namespace, key } => *is_key && first == namespace && second == key,
                    Row::Event { consumer, id } => !*is_key && first == consumer && second == id,
                })
            })
            .collect())
    }
}
