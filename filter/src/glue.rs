//! proxy-wasm glue: the root and HTTP contexts, and [`ProxyHost`], the
//! [`Host`] implementation over the SDK's raw host calls.
//!
//! Only `proxy_wasm::hostcalls` are used, never the trait helpers: those
//! `unwrap` every host status and a panic would take down the worker's
//! traffic. Header values are read as bytes (the SDK's string getters
//! `unwrap` UTF-8).

use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{self, BufferType, ContextType, LogLevel, MapType, MetricType, Status};

use crate::config::Config;
use crate::decision::{Action, Flow};
use crate::host::{Host, HostError, SharedData, SharedError};
use crate::metrics::{Counter, Histogram};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// Metric ids defined by the root context.
#[derive(Debug, Default)]
struct Metrics {
    counters: HashMap<Counter, u32>,
    histograms: HashMap<Histogram, u32>,
}

impl Metrics {
    fn define() -> Self {
        let mut m = Self::default();
        for c in Counter::all() {
            match hostcalls::define_metric(MetricType::Counter, &c.name()) {
                Ok(id) => {
                    m.counters.insert(c, id);
                }
                Err(s) => log::warn!("metric {} not defined: {s:?}", c.name()),
            }
        }
        for h in Histogram::ALL {
            match hostcalls::define_metric(MetricType::Histogram, h.name()) {
                Ok(id) => {
                    m.histograms.insert(h, id);
                }
                Err(s) => log::warn!("metric {} not defined: {s:?}", h.name()),
            }
        }
        m
    }
}

/// The per-VM root context: validates the configuration once.
#[derive(Debug, Default)]
struct Root {
    config: Option<Rc<Config>>,
    metrics: Option<Rc<Metrics>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        // Follow Envoy's log level for the wasm component (debug logs are
        // dropped inside the VM unless Envoy wants them).
        if let Ok(level) = hostcalls::get_log_level() {
            proxy_wasm::set_log_level(level);
        }
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(b) => b.unwrap_or_default(),
            Err(s) => {
                log::error!("cannot read the plugin configuration: {s:?}");
                return false;
            }
        };
        match Config::parse(&bytes) {
            Ok(cfg) => {
                log::info!(
                    "configured (mode {:?}, block_size {}, index cluster {:?}, tokenizer cluster {:?}, {} routes)",
                    cfg.mode,
                    cfg.block_size.get(),
                    cfg.index_cluster,
                    cfg.tokenizer_cluster,
                    cfg.routes.len()
                );
                self.config = Some(Rc::new(cfg));
                if self.metrics.is_none() {
                    self.metrics = Some(Rc::new(Metrics::define()));
                }
                true
            }
            Err(e) => {
                log::error!("invalid configuration: {e}");
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Returning None would panic in the SDK: without a configuration the
        // context passes everything through.
        let flow = self.config.clone().map(Flow::new);
        let metrics = self.metrics.clone().unwrap_or_default();
        Some(Box::new(Http {
            flow,
            host: ProxyHost { metrics },
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One HTTP stream.
#[derive(Debug)]
struct Http {
    flow: Option<Flow>,
    host: ProxyHost,
}

fn action(a: Action) -> types::Action {
    match a {
        Action::Continue => types::Action::Continue,
        Action::Pause => types::Action::Pause,
    }
}

impl Context for Http {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        _num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(flow) = &mut self.flow {
            flow.on_http_call_response(&mut self.host, token_id, body_size);
        }
    }

    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
        if let Some(flow) = &mut self.flow {
            flow.on_grpc_call_response(&mut self.host, token_id, status_code, response_size);
        }
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(
        &mut self,
        _num_headers: usize,
        end_of_stream: bool,
    ) -> types::Action {
        match &mut self.flow {
            Some(flow) => action(flow.on_request_headers(&mut self.host, end_of_stream)),
            None => types::Action::Continue,
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> types::Action {
        match &mut self.flow {
            Some(flow) => action(flow.on_request_body(&mut self.host, body_size, end_of_stream)),
            None => types::Action::Continue,
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> types::Action {
        match &mut self.flow {
            Some(flow) => action(flow.on_request_trailers(&mut self.host)),
            None => types::Action::Continue,
        }
    }

    fn on_http_response_headers(
        &mut self,
        _num_headers: usize,
        end_of_stream: bool,
    ) -> types::Action {
        match &mut self.flow {
            Some(flow) => action(flow.on_response_headers(&mut self.host, end_of_stream)),
            None => types::Action::Continue,
        }
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> types::Action {
        match &mut self.flow {
            Some(flow) => action(flow.on_response_body(&mut self.host, body_size, end_of_stream)),
            None => types::Action::Continue,
        }
    }
}

/// [`Host`] over proxy-wasm host calls.
#[derive(Debug)]
struct ProxyHost {
    metrics: Rc<Metrics>,
}

fn host_error(s: Status) -> HostError {
    HostError(format!("{s:?}"))
}

fn logged<T: Default>(what: &str, r: Result<T, Status>) -> T {
    r.unwrap_or_else(|s| {
        log::warn!("{what} failed: {s:?}");
        T::default()
    })
}

impl SharedData for ProxyHost {
    fn get_shared(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        logged("get_shared_data", hostcalls::get_shared_data(key))
    }

    fn set_shared(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedError> {
        hostcalls::set_shared_data(key, Some(value), cas).map_err(|s| match s {
            Status::CasMismatch => SharedError::CasMismatch,
            _ => SharedError::Failed,
        })
    }
}

impl Host for ProxyHost {
    fn request_header_names(&self) -> Vec<String> {
        logged(
            "get request headers",
            hostcalls::get_map_bytes(MapType::HttpRequestHeaders),
        )
        .into_iter()
        .map(|(k, _)| k)
        .collect()
    }

    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        logged(
            "get request header",
            hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name),
        )
    }

    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        logged(
            "set request header",
            hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value),
        );
    }

    fn request_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        logged(
            "get request body",
            hostcalls::get_buffer(BufferType::HttpRequestBody, start, max),
        )
    }

    fn resume_request(&mut self) {
        logged("resume request", hostcalls::resume_http_request());
    }

    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        logged(
            "get response header",
            hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name),
        )
    }

    fn set_response_header(&mut self, name: &str, value: &str) {
        logged(
            "set response header",
            hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value)),
        );
    }

    fn response_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        logged(
            "get response body",
            hostcalls::get_buffer(BufferType::HttpResponseBody, start, max),
        )
    }

    fn resume_response(&mut self) {
        logged("resume response", hostcalls::resume_http_response());
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        logged("get property", hostcalls::get_property(path.to_vec()))
    }

    fn dispatch_http(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, HostError> {
        hostcalls::dispatch_http_call(cluster, headers.to_vec(), Some(body), Vec::new(), timeout)
            .map_err(host_error)
    }

    fn http_call_response_header(&self, name: &str) -> Option<Vec<u8>> {
        logged(
            "get callout header",
            hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, name),
        )
    }

    fn http_call_response_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        logged(
            "get callout body",
            hostcalls::get_buffer(BufferType::HttpCallResponseBody, start, max),
        )
    }

    fn dispatch_grpc(
        &mut self,
        cluster: &str,
        service: &str,
        method: &str,
        message: &[u8],
        timeout: Duration,
    ) -> Result<u32, HostError> {
        hostcalls::dispatch_grpc_call(cluster, service, method, Vec::new(), Some(message), timeout)
            .map_err(host_error)
    }

    fn grpc_call_response_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        logged(
            "get grpc body",
            hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, start, max),
        )
    }

    fn now_us(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .and_then(|d| u64::try_from(d.as_micros()).ok())
            .unwrap_or(0)
    }

    fn count(&mut self, counter: Counter) {
        if let Some(id) = self.metrics.counters.get(&counter) {
            logged("increment metric", hostcalls::increment_metric(*id, 1));
        }
    }

    fn record(&mut self, histogram: Histogram, value: u64) {
        if let Some(id) = self.metrics.histograms.get(&histogram) {
            logged("record metric", hostcalls::record_metric(*id, value));
        }
    }
}
