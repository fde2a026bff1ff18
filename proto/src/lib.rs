//! The contract between the kvroute filter and `indexd`.
//!
//! - [`v1`]: the gRPC API (`kvroute/v1/index.proto`): prost messages that build
//!   for wasm32 without tokio or tonic, and with the `grpc` feature the tonic
//!   client and server stubs for native code.
//! - [`keys`]: the block-key scheme. The filter derives keys from tokenizer
//!   output; indexd derives the same keys from vLLM's `BlockStored` events.
//!   Golden vectors in `testdata/` pin it on both native and wasm targets.

pub mod keys;

pub use keys::{BlockKey, BlockSize, Chain, KeyChain, KeyError, SCHEME_VERSION, block_keys};

/// The generated messages (and, with the `grpc` feature, the service stubs)
/// of package `kvroute.v1`.
#[allow(missing_debug_implementations, clippy::all, clippy::pedantic)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/kvroute.v1.rs"));
}

/// The fully qualified gRPC method paths, for callers that speak gRPC without
/// the tonic stubs (the wasm filter's `dispatch_grpc_call`).
pub mod grpc_path {
    /// The service name as it appears in the `:path` of every call.
    pub const SERVICE: &str = "kvroute.v1.Index";
    /// The `Pick` method name.
    pub const PICK: &str = "Pick";
    /// The `Observe` method name.
    pub const OBSERVE: &str = "Observe";
}
