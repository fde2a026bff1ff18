//! The contract between the kvroute filter and `indexd`.
//!
//! - [`v1`]: the gRPC API (`kvroute/v1/index.proto`): prost messages that build
//!   for wasm32 without tokio or tonic, and with the `grpc` feature the tonic
//!   client and server stubs for native code.
//! - [`keys`]: the block-key scheme. The filter derives keys from tokenizer
//!   output; indexd derives the same keys from vLLM's `BlockStored` events.
//!   Golden vectors in `testdata/` pin it on both native and wasm targets.
//! - [`turns`]: what marks a body as a conversation's later turn
//!   (`PickRequest.continuation`).

pub mod keys;
pub mod turns;

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

/// The request fields the filter and indexd forward to a replica's
/// `POST /tokenize` when it tokenizes a body for them: those of vLLM 0.32's
/// tokenize requests that change the ids it answers. The rest of a body
/// (sampling parameters, `stream`, …) is left out: `/tokenize` would ignore
/// it, and some of it is large.
pub mod tokenize_fields {
    /// A chat body's. `documents` is not one of `/tokenize`'s (vLLM ignores
    /// it there, as the chat completion's render endpoint does not), but
    /// forwarding it costs nothing and keeps one list for both endpoints'
    /// readers; `mm_processor_kwargs` and `media_io_kwargs` change how many
    /// tokens a multimodal part becomes.
    pub const CHAT: &[&str] = &[
        "messages",
        "tools",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "documents",
        "mm_processor_kwargs",
        "media_io_kwargs",
    ];
    /// A completions body's.
    pub const COMPLETION: &[&str] = &["prompt", "add_special_tokens"];
}
