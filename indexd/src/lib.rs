//! indexd: the node-local KV-cache index daemon (DaemonSet) behind the kvroute
//! filter. It subscribes to every replica's vLLM KV events, keeps the block
//! index and answers `kvroute.v1.Index/Pick` from memory.
//!
//! The daemon is built under its own issue; this crate holds no logic yet.
