//! kvroute's Proxy-Wasm filter for Envoy and Istio.
//!
//! This build is the loadable shell: a root context that accepts its
//! configuration and HTTP contexts that let every request through unchanged.
//! Request parsing, tokenization, block keys and the `indexd` callout arrive
//! with the filter's own work; until then Envoy's own load balancing decides.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

/// The per-VM root context.
#[derive(Debug)]
struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        log::info!(
            "kvroute filter loaded (block-key scheme {})",
            String::from_utf8_lossy(kvroute_proto::SCHEME_VERSION)
        );
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Passthrough))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// An HTTP context that leaves the request to Envoy's own load balancing.
#[derive(Debug)]
struct Passthrough;

impl Context for Passthrough {}

impl HttpContext for Passthrough {}
