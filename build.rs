//! Compiles the protos with `protox` (pure Rust, so no system `protoc` is needed), generates the
//! tonic client and server, and writes the descriptor set that the reflection service serves.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/idempotency/v1/idempotency.proto",
        "proto/idempotency/v1/admin.proto",
    ];
    println!("cargo:rerun-if-changed=proto");

    let descriptors = protox::compile(protos, ["proto"])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("idempotency_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // prost's codec, except that an undecodable message is INVALID_ARGUMENT, not INTERNAL.
        .codec_path("crate::grpc::codec::ApiCodec")
        .compile_fds(descriptors)?;
    Ok(())
}
