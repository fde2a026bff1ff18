//! A scripted in-memory host for native tests.
//!
//! It enforces the rule Envoy enforces by panicking in the SDK:
//! request headers may change only inside a request callback or while the
//! request is paused.

use std::collections::HashMap;
use std::time::Duration;

use crate::host::{Host, HostError, SharedData, SharedError};
use crate::metrics::{Counter, Histogram};

/// One HTTP callout the filter dispatched.
#[derive(Clone, Debug)]
pub struct HttpCall {
    pub token: u32,
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub timeout: Duration,
}

/// One gRPC call the filter dispatched.
#[derive(Clone, Debug)]
pub struct GrpcCall {
    pub token: u32,
    pub cluster: String,
    pub service: String,
    pub method: String,
    pub metadata: Vec<(String, Vec<u8>)>,
    pub message: Vec<u8>,
    pub timeout: Duration,
}

#[derive(Debug, Default)]
pub struct FakeHost {
    pub request_headers: Vec<(String, Vec<u8>)>,
    pub request_body: Vec<u8>,
    pub response_headers: Vec<(String, Vec<u8>)>,
    pub response_chunk: Vec<u8>,
    pub properties: HashMap<String, Vec<u8>>,
    pub http_calls: Vec<HttpCall>,
    pub grpc_calls: Vec<GrpcCall>,
    pub fail_http_dispatch: bool,
    pub fail_grpc_dispatch: bool,
    /// Dispatching a gRPC call fails as Envoy's overflowing cluster makes it
    /// fail (`InternalFailure`).
    pub overflow_grpc_dispatch: bool,
    pub http_answer_headers: Vec<(String, Vec<u8>)>,
    pub http_answer_body: Vec<u8>,
    pub grpc_answer_body: Vec<u8>,
    pub now_us: u64,
    pub counters: HashMap<Counter, u64>,
    pub histograms: Vec<(Histogram, u64)>,
    pub shared: HashMap<String, (Vec<u8>, u32)>,
    /// Forced CAS mismatches still to inject.
    pub shared_conflicts: u32,
    pub request_resumes: u32,
    pub response_resumes: u32,
    /// Set by the test driver while a request callback runs.
    pub in_request_callback: bool,
    /// Set by the test driver when a request callback returned Pause.
    pub request_paused: bool,
    pub next_token: u32,
}

fn get<'a>(list: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a Vec<u8>> {
    list.iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v)
}

fn slice(bytes: &[u8], start: usize, max: usize) -> Option<Vec<u8>> {
    let end = start.saturating_add(max).min(bytes.len());
    bytes.get(start..end).map(<[u8]>::to_vec)
}

impl FakeHost {
    pub fn count_of(&self, counter: Counter) -> u64 {
        self.counters.get(&counter).copied().unwrap_or(0)
    }

    pub fn header(&self, name: &str) -> Option<String> {
        get(&self.request_headers, name).map(|v| String::from_utf8_lossy(v).into_owned())
    }

    pub fn response_header_str(&self, name: &str) -> Option<String> {
        get(&self.response_headers, name).map(|v| String::from_utf8_lossy(v).into_owned())
    }

    fn token(&mut self) -> u32 {
        self.next_token = self.next_token.wrapping_add(1);
        self.next_token
    }
}

impl SharedData for FakeHost {
    fn get_shared(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.shared.get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn set_shared(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedError> {
        if self.shared_conflicts > 0 {
            self.shared_conflicts -= 1;
            // Someone else wrote meanwhile: bump the CAS token.
            if let Some((_, c)) = self.shared.get_mut(key) {
                *c += 1;
            }
            return Err(SharedError::CasMismatch);
        }
        let current = self.shared.get(key).map(|(_, c)| *c);
        if cas.is_some() && cas != current {
            return Err(SharedError::CasMismatch);
        }
        let next = current.unwrap_or(0) + 1;
        self.shared.insert(key.to_owned(), (value.to_vec(), next));
        Ok(())
    }
}

impl Host for FakeHost {
    fn request_header_names(&self) -> Vec<String> {
        self.request_headers
            .iter()
            .map(|(k, _)| k.clone())
            .collect()
    }

    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        get(&self.request_headers, name).cloned()
    }

    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        assert!(
            self.in_request_callback || self.request_paused,
            "request header {name} changed while the request is not paused (the SDK panics)"
        );
        self.request_headers
            .retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        if let Some(v) = value {
            self.request_headers
                .push((name.to_owned(), v.as_bytes().to_vec()));
        }
    }

    fn request_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        slice(&self.request_body, start, max)
    }

    fn resume_request(&mut self) {
        assert!(
            self.request_paused,
            "resume of a request that is not paused"
        );
        self.request_paused = false;
        self.request_resumes += 1;
    }

    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        get(&self.response_headers, name).cloned()
    }

    fn set_response_header(&mut self, name: &str, value: &str) {
        self.response_headers
            .retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        self.response_headers
            .push((name.to_owned(), value.as_bytes().to_vec()));
    }

    fn response_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        slice(&self.response_chunk, start, max)
    }

    fn resume_response(&mut self) {
        self.response_resumes += 1;
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.properties.get(&path.join(".")).cloned()
    }

    fn dispatch_http(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, HostError> {
        if self.fail_http_dispatch {
            return Err(HostError("unknown cluster".to_owned()));
        }
        let token = self.token();
        self.http_calls.push(HttpCall {
            token,
            cluster: cluster.to_owned(),
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            body: body.to_vec(),
            timeout,
        });
        Ok(token)
    }

    fn http_call_response_header(&self, name: &str) -> Option<Vec<u8>> {
        get(&self.http_answer_headers, name).cloned()
    }

    fn http_call_response_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        slice(&self.http_answer_body, start, max)
    }

    fn dispatch_grpc(
        &mut self,
        cluster: &str,
        service: &str,
        method: &str,
        metadata: &[(&str, &[u8])],
        message: &[u8],
        timeout: Duration,
    ) -> Result<u32, HostError> {
        if self.fail_grpc_dispatch {
            return Err(HostError("unknown cluster".to_owned()));
        }
        if self.overflow_grpc_dispatch {
            return Err(HostError("InternalFailure".to_owned()));
        }
        let token = self.token();
        self.grpc_calls.push(GrpcCall {
            token,
            cluster: cluster.to_owned(),
            service: service.to_owned(),
            method: method.to_owned(),
            metadata: metadata
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.to_vec()))
                .collect(),
            message: message.to_vec(),
            timeout,
        });
        Ok(token)
    }

    fn grpc_call_response_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        slice(&self.grpc_answer_body, start, max)
    }

    fn now_us(&self) -> u64 {
        self.now_us
    }

    fn count(&mut self, counter: Counter) {
        *self.counters.entry(counter).or_insert(0) += 1;
    }

    fn record(&mut self, histogram: Histogram, value: u64) {
        self.histograms.push((histogram, value));
    }
}
