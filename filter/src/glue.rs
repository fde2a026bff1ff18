//! proxy-wasm glue: the root and HTTP contexts, and [`ProxyHost`], the
//! [`Host`] implementation over the host ABI.
//!
//! Every host call goes through [`crate::abi`], which returns each status as
//! a value: the SDK's trait helpers and `hostcalls` panic on statuses they do
//! not expect, and a panic traps the VM for the worker's traffic. The two
//! dispatch calls are the exception (see `abi`). Logging and the panic hook
//! are the filter's own for the same reason. Header values are read as bytes.

use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{self, ContextType};

use crate::abi::{self, Buffer, Map, MetricKind, Status, Stream};

use crate::config::Config;
use crate::decision::{Action, Flow, request_id};
use crate::host::{Host, HostError, SharedData, SharedError};
use crate::metrics::{Counter, Gauge, Histogram};

proxy_wasm::main! {{
    logging::init();
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root::default()) });
}}

/// A `log` backend and a panic hook over [`abi::log`], which cannot panic
/// (the SDK's `unwrap` the log call's status).
mod logging {
    use crate::abi;

    /// proxy-wasm's numbering: trace 0 … error 4, critical 5.
    const CRITICAL: u32 = 5;

    #[derive(Debug)]
    struct HostLogger;

    static LOGGER: HostLogger = HostLogger;

    impl log::Log for HostLogger {
        fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
            metadata.level() <= log::max_level()
        }

        fn log(&self, record: &log::Record<'_>) {
            if !self.enabled(record.metadata()) {
                return;
            }
            let level = match record.level() {
                log::Level::Trace => 0,
                log::Level::Debug => 1,
                log::Level::Info => 2,
                log::Level::Warn => 3,
                log::Level::Error => 4,
            };
            abi::log(level, &record.args().to_string());
        }

        fn flush(&self) {}
    }

    /// Installs the logger and the panic hook (once per VM), at info level.
    pub(super) fn init() {
        if log::set_logger(&LOGGER).is_ok() {
            std::panic::set_hook(Box::new(|info| abi::log(CRITICAL, &info.to_string())));
        }
        log::set_max_level(log::LevelFilter::Info);
    }

    /// Follows Envoy's log level for the wasm component.
    pub(super) fn follow_host() {
        let filter = match abi::log_level() {
            Ok(0) => log::LevelFilter::Trace,
            Ok(1) => log::LevelFilter::Debug,
            Ok(2) => log::LevelFilter::Info,
            Ok(3) => log::LevelFilter::Warn,
            Ok(4) => log::LevelFilter::Error,
            Ok(_) => log::LevelFilter::Off,
            Err(_) => return,
        };
        log::set_max_level(filter);
    }
}

/// Metric ids defined by the root context.
#[derive(Debug, Default)]
struct Metrics {
    counters: HashMap<Counter, u32>,
    histograms: HashMap<Histogram, u32>,
    gauges: HashMap<Gauge, u32>,
}

impl Metrics {
    fn define() -> Self {
        let mut m = Self::default();
        for c in Counter::all() {
            match abi::define_metric(MetricKind::Counter, &c.name()) {
                Ok(id) => {
                    m.counters.insert(c, id);
                }
                Err(s) => log::warn!("metric {} not defined: {s:?}", c.name()),
            }
        }
        for g in Gauge::ALL {
            match abi::define_metric(MetricKind::Gauge, g.name()) {
                Ok(id) => {
                    m.gauges.insert(g, id);
                }
                Err(s) => log::warn!("metric {} not defined: {s:?}", g.name()),
            }
        }
        for h in Histogram::ALL {
            match abi::define_metric(MetricKind::Histogram, h.name()) {
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
    /// Random per VM: the prefix of the filter's request ids.
    nonce: Option<u64>,
}

/// A random per-VM value (the std hasher's keys come from WASI's
/// `random_get`), mixed with the clock in case the host gives no entropy.
fn nonce() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(abi::now_ns().unwrap_or(0))
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        // Follow Envoy's log level for the wasm component (debug logs are
        // dropped inside the VM unless Envoy wants them).
        logging::follow_host();
        let bytes = match abi::buffer(Buffer::PluginConfiguration, 0, usize::MAX) {
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
                if self.nonce.is_none() {
                    self.nonce = Some(nonce());
                }
                true
            }
            Err(e) => {
                log::error!("invalid configuration: {e}");
                false
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Returning None would panic in the SDK: without a configuration the
        // context passes everything through.
        let flow = self
            .config
            .clone()
            .map(|cfg| Flow::new(cfg, request_id(self.nonce.unwrap_or(0), context_id)));
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
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(flow) = &mut self.flow {
            flow.on_http_call_response(&mut self.host, token_id, num_headers, body_size);
        }
    }

    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
        if let Some(flow) = &mut self.flow {
            flow.on_grpc_call_response(&mut self.host, token_id, status_code, response_size);
        }
    }
}

impl HttpContext for Http {
    fn on_log(&mut self) {
        // The VM's linear memory (it only grows): its high-water mark.
        let bytes = std::arch::wasm32::memory_size(0).saturating_mul(65_536);
        self.host.gauge(Gauge::VmMemory, bytes as u64);
    }

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

fn host_error(s: impl std::fmt::Debug) -> HostError {
    HostError(format!("{s:?}"))
}

fn logged<T: Default>(what: &str, r: Result<T, Status>) -> T {
    r.unwrap_or_else(|s| {
        log::warn!("{what} failed: {s:?}");
        T::default()
    })
}

/// Like [`logged`], for reads whose failure is expected at times (the
/// headers of a callout that failed): debug level.
fn quiet<T: Default>(what: &str, r: Result<T, Status>) -> T {
    r.unwrap_or_else(|s| {
        log::debug!("{what} failed: {s:?}");
        T::default()
    })
}

impl ProxyHost {
    fn gauge(&mut self, gauge: Gauge, value: u64) {
        if let Some(id) = self.metrics.gauges.get(&gauge) {
            logged("set gauge", abi::record_metric(*id, value));
        }
    }
}

impl SharedData for ProxyHost {
    fn get_shared(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        logged("get shared data", abi::shared(key))
    }

    fn set_shared(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedError> {
        abi::set_shared(key, value, cas).map_err(|s| match s {
            Status::CAS_MISMATCH => SharedError::CasMismatch,
            _ => SharedError::Failed,
        })
    }
}

impl Host for ProxyHost {
    fn request_header_names(&self) -> Vec<String> {
        logged(
            "get request headers",
            abi::header_pairs(Map::RequestHeaders),
        )
        .into_iter()
        .map(|(k, _)| k)
        .collect()
    }

    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        logged("get request header", abi::header(Map::RequestHeaders, name))
    }

    fn set_request_header(&mut self, name: &str, value: Option<&str>) {
        logged(
            "set request header",
            abi::set_header(Map::RequestHeaders, name, value),
        );
    }

    fn request_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        logged(
            "get request body",
            abi::buffer(Buffer::RequestBody, start, max),
        )
    }

    fn resume_request(&mut self) {
        logged("resume request", abi::resume(Stream::Request));
    }

    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        logged(
            "get response header",
            abi::header(Map::ResponseHeaders, name),
        )
    }

    fn set_response_header(&mut self, name: &str, value: &str) {
        logged(
            "set response header",
            abi::set_header(Map::ResponseHeaders, name, Some(value)),
        );
    }

    fn response_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        logged(
            "get response body",
            abi::buffer(Buffer::ResponseBody, start, max),
        )
    }

    fn resume_response(&mut self) {
        logged("resume response", abi::resume(Stream::Response));
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        logged("get property", abi::property(path))
    }

    fn dispatch_http(
        &mut self,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
    ) -> Result<u32, HostError> {
        // The SDK's call: its dispatcher must know the token (see `abi`).
        hostcalls::dispatch_http_call(cluster, headers.to_vec(), Some(body), Vec::new(), timeout)
            .map_err(host_error)
    }

    fn http_call_response_header(&self, name: &str) -> Option<Vec<u8>> {
        // A failed callout (reset, timeout) has no headers: BadArgument.
        quiet(
            "get callout header",
            abi::header(Map::CallResponseHeaders, name),
        )
    }

    fn http_call_response_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        quiet(
            "get callout body",
            abi::buffer(Buffer::CallResponseBody, start, max),
        )
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
        // The SDK's call: its dispatcher must know the token (see `abi`).
        hostcalls::dispatch_grpc_call(
            cluster,
            service,
            method,
            metadata.to_vec(),
            Some(message),
            timeout,
        )
        .map_err(host_error)
    }

    fn grpc_call_response_body(&self, start: usize, max: usize) -> Option<Vec<u8>> {
        quiet(
            "get grpc body",
            abi::buffer(Buffer::GrpcReceive, start, max),
        )
    }

    fn now_us(&self) -> u64 {
        abi::now_ns().map(|ns| ns / 1000).unwrap_or(0)
    }

    fn count(&mut self, counter: Counter) {
        if let Some(id) = self.metrics.counters.get(&counter) {
            logged("increment metric", abi::increment_metric(*id, 1));
        }
    }

    fn record(&mut self, histogram: Histogram, value: u64) {
        if let Some(id) = self.metrics.histograms.get(&histogram) {
            logged("record metric", abi::record_metric(*id, value));
        }
    }
}
