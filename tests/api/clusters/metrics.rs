//! Each cluster's own parts in `/metrics`: every series of a cluster's pool, reaper, stuck keys
//! and durability carries the cluster's name, and reads that cluster.

use std::collections::HashMap;
use std::time::Duration;

use super::*;
use crate::metrics::{samples, scrape};

/// The series of `name` that carry `cluster="{cluster}"` and `label`, if any.
fn reading(samples: &HashMap<String, f64>, name: &str, cluster: &str, label: &str) -> Option<f64> {
    let of_cluster = format!("cluster=\"{cluster}\"");
    samples.iter().find_map(|(series, value)| {
        let labels = series.strip_prefix(name)?.strip_prefix('{')?;
        (labels.contains(&of_cluster) && labels.contains(label)).then_some(*value)
    })
}

/// With three clusters, each cluster's series of its own parts carry its name, none of them
/// goes without one, and each reads its own cluster: a key stuck on b is counted on b only.
#[tokio::test]
async fn each_clusters_own_series_carry_its_name() {
    let clusters = three_clusters().await;
    // A sweep every 100 ms (the tests' default is an hour), so that the reaper's gauges are
    // read within the test.
    let app = serve_on(
        &clusters,
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--reaper-interval",
            "100ms",
        ],
    )
    .await;
    // A claim on b (orders-*) whose lease runs out: stuck on b, on no other cluster.
    let client = app.client().await;
    claim(
        &mut client.clone(),
        try_start_in("orders-eu", &unique_key("stuck")).with_lease(millis(100)),
    )
    .await;
    let stuck_on = |samples: &HashMap<String, f64>, cluster: &str| {
        reading(samples, "idempotency_stuck_keys", cluster, "")
    };
    let read = eventually_some(
        Duration::from_secs(20),
        "the key stuck on b counted by b's reaper",
        || async {
            let read = samples(&scrape(&app).await);
            (stuck_on(&read, "b") == Some(1.0)).then_some(read)
        },
    )
    .await;
    assert_eq!(stuck_on(&read, "a"), Some(0.0), "stuck keys on a");
    assert_eq!(stuck_on(&read, "c"), Some(0.0), "stuck keys on c");

    // Lone servers: commits wait for no standby, and none is attached, on each.
    let per_cluster: [(&str, &str, Option<f64>); 6] = [
        ("idempotency_cluster_ready", "", Some(1.0)),
        ("idempotency_store_commits_wait_for_standby", "", Some(0.0)),
        (
            "idempotency_store_synchronous_standbys",
            "state=\"attached\"",
            Some(0.0),
        ),
        ("idempotency_pool_connections", "state=\"idle\"", None),
        ("idempotency_reaper_lag_seconds", "table=\"keys\"", None),
        ("idempotency_oldest_stuck_key_seconds", "", None),
    ];
    for cluster in ["a", "b", "c"] {
        for (name, label, expected) in per_cluster {
            let value = reading(&read, name, cluster, label)
                .unwrap_or_else(|| panic!("{name}{{{label}}} of cluster {cluster}: {read:#?}"));
            if let Some(expected) = expected {
                assert_eq!(value, expected, "{name}{{{label}}} of cluster {cluster}");
            }
        }
    }
    let unnamed: Vec<&String> = read
        .keys()
        .filter(|series| {
            per_cluster
                .iter()
                .any(|(name, _, _)| series.starts_with(&format!("{name}{{")) || series == name)
                && !series.contains("cluster=\"")
        })
        .collect();
    assert!(
        unnamed.is_empty(),
        "series of a cluster without its name: {unnamed:?}"
    );
}
