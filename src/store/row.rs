//! A row a statement locks, named by its table and primary key: what the held-key registry
//! remembers, and what the store is asked about when a shared statement met a held row.

/// A row of the keys' or the events' table, by its primary key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Row<'a> {
    Key { namespace: &'a str, key: &'a str },
    Event { consumer: &'a str, id: &'a str },
}

impl<'a> Row<'a> {
    /// The namespace of a key's row, the consumer of an event's: what places it on a cluster.
    pub fn scope(&self) -> &'a str {
        match self {
            Self::Key { namespace, .. } => namespace,
            Self::Event { consumer, .. } => consumer,
        }
    }
}
