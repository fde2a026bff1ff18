//! The host interface: everything the filter asks of Envoy, as a trait.
//!
//! The proxy-wasm implementation lives in `glue`; tests use `fake::FakeHost`.
//! Implementations must not panic: every host status maps to a value.

use std::time::Duration;

use crate::metrics::{Counter, Histogram};

/// A host call that did not happen (unknown cluster, bad argument, …): the
/// host's status, by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostError(pub String);

impl HostError {
    /// Whether Envoy refused the call at once although its cluster exists:
    /// its async client failed the call inline (the cluster's circuit
    /// breaker overflowing — measured on Envoy 1.40 — or no host to send it
    /// to), which the ABI reports as `InternalFailure`. An unknown cluster
    /// or a bad argument are other statuses.
    pub fn refused_at_once(&self) -> bool {
        self.0 == "InternalFailure"
    }
}

/// A shared-data write lost a compare-and-swap race or failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedError {
    /// Someone wrote the key since it was read.
    CasMismatch,
    /// Any other failure.
    Failed,
}

/// Key-value data shared by all workers of one VM, with compare-and-swap.
pub trait SharedData {
    /// The value and its CAS token (`None` if the key was never written).
    fn get_shared(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes `value` if the key's CAS token still equals `cas` (`None`:
    /// unconditionally).
    fn set_shared(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedError>;
}

/// The calls of one HTTP stream's filter into its host.
pub trait Host: SharedData {
    /// The names of all request headers.
    fn request_header_names(&self) -> Vec<String>;
    /// One request header's raw value.
    fn request_header(&self, name: &str) -> Option<Vec<u8>>;
    /// Sets (`Some`) or removes (`None`) a request header. Only legal in the
    /// request headers callback or while the request is paused.
    fn set_request_header(&mut self, name: &str, value: Option<&str>);
    /// The buffered request body.
    fn request_body(&self, start: usize, max: usize) -> Option<Vec<u8>>;
    /// Resumes a paused request.
    fn resume_request(&mut self);
    /// One response header's raw value.
    fn response_header(&self, name: &str) -> Option<Vec<u8>>;
    /// Sets a response header (response headers callback only).
    fn set_response_header(&mut self, name: &str, value: &str);
    /// The current response body chunk (or buffered body).
    fn response_body(&self, start: usize, max: usize) -> Option<Vec<u8>>;
    /// Resumes a paused response.
    fn resume_response(&mut self);
    /// A stream property such as `upstream.address`.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
    /// Starts an HTTP callout; its answer arrives as `on_http_call_response`.
    fn dispatch_http(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, HostError>;
    /// A header of the HTTP callout's answer.
    fn http_call_response_header(&self, name: &str) -> Option<Vec<u8>>;
    /// The body of the HTTP callout's answer.
    fn http_call_response_body(&self, start: usize, max: usize) -> Option<Vec<u8>>;
    /// Starts a unary gRPC call with `metadata` (initial metadata, e.g.
    /// `authorization`); its answer arrives as `on_grpc_call_response`.
    fn dispatch_grpc(
        &mut self,
        cluster: &str,
        service: &str,
        method: &str,
        metadata: &[(&str, &[u8])],
        message: &[u8],
        timeout: Duration,
    ) -> Result<u32, HostError>;
    /// The message of the gRPC call's answer.
    fn grpc_call_response_body(&self, start: usize, max: usize) -> Option<Vec<u8>>;
    /// Wall-clock microseconds.
    fn now_us(&self) -> u64;
    /// Adds one to a counter.
    fn count(&mut self, counter: Counter);
    /// Records a histogram sample.
    fn record(&mut self, histogram: Histogram, value: u64);
}
