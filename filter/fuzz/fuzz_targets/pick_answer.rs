//! Arbitrary bytes as indexd's Pick answer (and its gRPC status), taken by
//! the filter's state machine after a real request and tokenizer answer:
//! never a panic, the request is resumed exactly once, and an override is
//! set only with a routing decision and only to well-formed addresses.
#![no_main]

use std::rc::Rc;
use std::time::Duration;

use kvroute_filter::host::{Host, HostError, SharedData, SharedError};
use kvroute_filter::metrics::{Counter, Histogram};
use kvroute_filter::{Action, Config, Flow};
use libfuzzer_sys::fuzz_target;

#[derive(Default)]
struct FuzzHost {
    request_headers: Vec<(String, Vec<u8>)>,
    request_body: Vec<u8>,
    http_answer: Vec<u8>,
    grpc_answer: Vec<u8>,
    shared: std::collections::HashMap<String, (Vec<u8>, u32)>,
    resumes: u32,
    tokens: u32,
    now: u64,
}

impl SharedData for FuzzHost {
    fn get_shared(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.shared.get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn set_shared(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedError> {
        let current = self.shared.get(key).map(|(_, c)| *c);
        if cas.is_some() && cas != current {
            return Err(SharedError::CasMismatch);
        }
        let next = current.unwrap_or(0).wrapping_add(1).max(1);
        self.shared.insert(key.to_owned(), (value.to_vec(), next));
        Ok(())
    }
}

fn slice(bytes: &[u8], start: usize, max: usize) -> Option<Vec<u8>> {
    bytes
        .get(start..start.saturating_add(max).min(bytes.len()))
        .map(<[u8]>::to_vec)
}

impl Host for FuzzHost {
    fn request_header_names(&self) -> Vec<String> {
        self.request_headers.iter().map(|(k, _)| k.clone()).collect()
    }
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        self.request_headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    }
    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        self.request_headers.retain(|(k, _)| k != name);
        if let Some(v) = value {
            self.request_headers
                .push((name.to_owned(), v.as_bytes().to_vec()));
        }
    }
    fn request_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        slice(&self.request_body, start, max)
    }
    fn resume_request(&mut self) {
        self.resumes += 1;
    }
    fn response_header(&self, _: &str) -> Option<Vec<u8>> {
        None
    }
    fn set_response_header(&mut self, _: &str, _: &str) {}
    fn response_body(&self, _: usize, _: usize) -> Option<Vec<u8>> {
        None
    }
    fn resume_response(&mut self) {}
    fn property(&self, _: &[&str]) -> Option<Vec<u8>> {
        None
    }
    fn dispatch_http(
        &mut self,
        _: &str,
        _: &[(&str, &str)],
        _: &[u8],
        _: Duration,
    ) -> Result<u32, HostError> {
        self.tokens += 1;
        Ok(self.tokens)
    }
    fn http_call_response_header(&self, name: &str) -> Option<Vec<u8>> {
        (name == ":status").then(|| b"200".to_vec())
    }
    fn http_call_response_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        slice(&self.http_answer, start, max)
    }
    fn dispatch_grpc(
        &mut self,
        _: &str,
        _: &str,
        _: &str,
        _: &[(&str, &[u8])],
        _: &[u8],
        _: Duration,
    ) -> Result<u32, HostError> {
        self.tokens += 1;
        Ok(self.tokens)
    }
    fn grpc_call_response_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        slice(&self.grpc_answer, start, max)
    }
    fn now_us(&self) -> u64 {
        self.now
    }
    fn count(&mut self, _: Counter) {}
    fn record(&mut self, _: Histogram, _: u64) {}
}

static CONFIG: std::sync::OnceLock<Config> = std::sync::OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let [status, answer @ ..] = data else {
        return;
    };
    let cfg = CONFIG.get_or_init(|| {
        Config::parse(br#"{"index_cluster":"i","tokenizer_cluster":"t","block_size":4}"#)
            .expect("a valid configuration")
    });
    let mut host = FuzzHost {
        request_headers: vec![
            (":method".into(), b"POST".to_vec()),
            (":path".into(), b"/v1/chat/completions".to_vec()),
        ],
        request_body: br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
        http_answer: br#"{"tokens":[1,2,3,4,5,6,7,8,9]}"#.to_vec(),
        grpc_answer: answer.to_vec(),
        ..FuzzHost::default()
    };
    let mut flow = Flow::new(Rc::new(cfg.clone()), "fuzz-1".into());
    assert_eq!(flow.on_request_headers(&mut host, false), Action::Pause);
    let size = host.request_body.len();
    assert_eq!(flow.on_request_body(&mut host, size, true), Action::Pause);
    let size = host.http_answer.len();
    flow.on_http_call_response(&mut host, 1, 1, size);
    assert_eq!(host.resumes, 0, "resumed before the Pick answered");
    let size = host.grpc_answer.len();
    // Statuses 0..=16, mostly 0 so the answer is read.
    let code = if status % 4 == 0 { u32::from(*status % 17) } else { 0 };
    flow.on_grpc_call_response(&mut host, 2, code, size);
    assert_eq!(host.resumes, 1, "the request must be resumed exactly once");
    let reason = flow.reason().expect("a decision");
    let override_list = host.request_header("x-gateway-destination-endpoint");
    assert_eq!(override_list.is_some(), reason.routed());
    if let Some(list) = override_list {
        let list = String::from_utf8(list).expect("a header value");
        assert!(list.split(',').count() <= 16);
        assert!(list.bytes().all(|b| b.is_ascii_graphic()));
    }
});
