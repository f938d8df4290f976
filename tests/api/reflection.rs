//! Server reflection, both versions: grpcurl 1.8 speaks only v1alpha, newer tools only v1.

use crate::support::*;

/// Asks one reflection version for the service list and for the files declaring the symbols
/// a client needs to call the API and decode its errors.
macro_rules! reflection_answers {
    ($version:ident, $app:expr) => {{
        use tonic_reflection::pb::$version::{
            ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
            server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
        };
        let channel = tonic::transport::Channel::from_shared($app.endpoint())
            .expect("endpoint")
            .connect()
            .await
            .expect("connect");
        let mut client = ServerReflectionClient::new(channel);
        let mut requests = vec![MessageRequest::ListServices(String::new())];
        for symbol in SYMBOLS {
            requests.push(MessageRequest::FileContainingSymbol(symbol.to_string()));
        }
        let stream =
            tokio_stream::iter(requests.into_iter().map(|request| ServerReflectionRequest {
                host: String::new(),
                message_request: Some(request),
            }));
        let mut responses = client
            .server_reflection_info(stream)
            .await
            .expect("reflection stream")
            .into_inner();
        let mut services = Vec::new();
        let mut files_per_symbol = Vec::new();
        while let Some(response) = responses.message().await.expect("reflection response") {
            match response.message_response.expect("an answer") {
                MessageResponse::ListServicesResponse(list) => {
                    services.extend(list.service.into_iter().map(|s| s.name));
                }
                MessageResponse::FileDescriptorResponse(files) => {
                    files_per_symbol.push(files.file_descriptor_proto.len());
                }
                other => panic!("unexpected reflection answer {other:?}"),
            }
        }
        (services, files_per_symbol)
    }};
}

const SYMBOLS: [&str; 8] = [
    "idempotency.v1.IdempotencyService",
    "idempotency.v1.AdminService",
    "idempotency.v1.ListKeysResponse",
    "idempotency.v1.TryStartResponse",
    "google.rpc.ErrorInfo",
    "google.rpc.BadRequest",
    "google.rpc.RetryInfo",
    "grpc.health.v1.Health",
];

fn assert_complete(services: &[String], files_per_symbol: &[usize]) {
    for service in [
        "idempotency.v1.IdempotencyService",
        "idempotency.v1.AdminService",
        "grpc.health.v1.Health",
    ] {
        assert!(
            services.iter().any(|s| s == service),
            "{service} not listed: {services:?}"
        );
    }
    assert_eq!(
        files_per_symbol.len(),
        SYMBOLS.len(),
        "every symbol resolves"
    );
    assert!(files_per_symbol.iter().all(|&n| n > 0));
}

async fn reflection_v1_lists_the_services_and_resolves_error_detail_types(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let (services, files) = reflection_answers!(v1, app);
    assert_complete(&services, &files);
}

async fn reflection_v1alpha_lists_the_services_and_resolves_error_detail_types(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let (services, files) = reflection_answers!(v1alpha, app);
    assert_complete(&services, &files);
}

for_each_backend!(
    reflection_v1_lists_the_services_and_resolves_error_detail_types,
    reflection_v1alpha_lists_the_services_and_resolves_error_detail_types,
);
