//! Whether a server serves, asked through `grpc.health.v1` (never read off its logs).

use std::time::Duration;

use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// A health client on a new connection (tonic-health's generated client has no `connect`).
pub async fn health_client(endpoint: String) -> anyhow::Result<HealthClient<Channel>> {
    let channel = Channel::from_shared(endpoint)?.connect().await?;
    Ok(HealthClient::new(channel))
}

/// Whether the server behind `health` answers SERVING right now (any error counts as no).
pub async fn is_serving(health: &HealthClient<Channel>) -> bool {
    let mut health = health.clone();
    let request = tonic_health::pb::HealthCheckRequest {
        service: String::new(),
    };
    matches!(
        health.check(request).await,
        Ok(response) if response.get_ref().status() == ServingStatus::Serving
    )
}

/// Waits until the server at `endpoint` answers SERVING, asking every 20 ms, for at most
/// `limit`.
pub async fn wait_until_serving(endpoint: &str, limit: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Ok(health) = health_client(endpoint.to_owned()).await
            && is_serving(&health).await
        {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!("{endpoint} did not answer SERVING within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
