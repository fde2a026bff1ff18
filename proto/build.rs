//! Compiles `kvroute/v1/index.proto` into `OUT_DIR`. `protoc` comes from the
//! vendored binary unless `PROTOC` names one, so a fresh machine needs no
//! system protobuf compiler. Service stubs are generated only with the `grpc`
//! feature; without it the output is plain prost messages (wasm-safe).

use std::path::Path;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = Path::new("kvroute/v1/index.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    println!("cargo:rerun-if-env-changed=PROTOC");

    let mut config = tonic_prost_build::Config::new();
    if std::env::var_os("PROTOC").is_none() {
        config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    }
    let grpc = std::env::var_os("CARGO_FEATURE_GRPC").is_some();
    tonic_prost_build::configure()
        // A Pick's request body is read as a slice of the received message,
        // not copied out of it: bodies run to megabytes.
        .bytes(".kvroute.v1.PickRequest.body")
        .build_client(grpc)
        .build_server(grpc)
        .compile_with_config(config, &[proto], &[Path::new(".")])?;
    Ok(())
}
