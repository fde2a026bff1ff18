//! Integration tests: replicas on port 0, driven over HTTP, ZMQ PUB and ROUTER replay.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod dp;
mod faults;
mod http;
mod hybrid;
mod messages;
mod real_captures;
mod support;
mod wire;
