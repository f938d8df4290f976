//! Generates the client half of the coordinator's API from the repository's proto, with
//! `protox` (pure Rust, no system `protoc`), so that users need not depend on the server crate.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=../proto");
    let descriptors = protox::compile(["idempotency/v1/idempotency.proto"], ["../../proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(descriptors)?;
    Ok(())
}
