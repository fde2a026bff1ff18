//! Endpoints: a replica's identity and sources, their YAML shape (the
//! config's `endpoints:`, the discovery file's, the `--endpoint` flag's) and
//! their checks.
//!
//! An endpoint's `address` is `ip:port`, or `host:port` where a [`Resolve`]
//! is given: the name is resolved once, when the endpoint is loaded, to the
//! one address Envoy knows the replica by (a `STRICT_DNS` cluster resolving
//! the same name, as in docker compose). Parsing alone never resolves.

use std::net::{SocketAddr, ToSocketAddrs};

use serde::Deserialize;

use crate::error::ConfigError;
pub use crate::ids::EndpointId;
use crate::zmtp::Endpoint;

/// A plain-HTTP URL split for the tiny scrape client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpUrl {
    /// `host:port` to connect to.
    pub authority: String,
    /// Path and query, starting with `/`.
    pub path: String,
}

impl HttpUrl {
    /// Parses `http://host[:port][/path]`.
    pub fn parse(url: &str) -> Option<Self> {
        let rest = url.strip_prefix("http://")?;
        let (authority, path) = match rest.find('/') {
            Some(i) => rest.split_at(i),
            None => (rest, "/"),
        };
        if authority.is_empty() {
            return None;
        }
        let authority = if authority.contains(':') && !authority.ends_with(']') {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        Some(Self {
            authority,
            path: path.to_owned(),
        })
    }
}

impl std::fmt::Display for HttpUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "http://{}{}", self.authority, self.path)
    }
}

/// One replica's sources.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointConfig {
    /// Identity: address as Envoy knows it, plus rank.
    pub id: EndpointId,
    /// The served model name (the request's `model`).
    pub model: String,
    /// LoRA adapters served besides the base model.
    pub adapters: Vec<String>,
    /// The ZMQ KV-event endpoint (`tcp://host:port`). None: no events (the
    /// replica is ranked by load and approximate keys only).
    pub events: Option<String>,
    /// True: indexd binds `events` and the replica connects to it.
    pub events_bind: bool,
    /// The ZMQ replay (ROUTER) endpoint.
    pub replay: Option<String>,
    /// vLLM's Prometheus endpoint. None: always healthy, no load signal.
    pub metrics_url: Option<HttpUrl>,
    /// Optional capacity signal (`{"occupancy", "cache_available"}`).
    pub capacity_url: Option<HttpUrl>,
}

impl EndpointConfig {
    /// An endpoint with only an address and a model.
    pub fn new(address: SocketAddr, model: impl Into<String>) -> Self {
        Self {
            id: EndpointId {
                address,
                rank: None,
            },
            model: model.into(),
            adapters: Vec::new(),
            events: None,
            events_bind: false,
            replay: None,
            metrics_url: None,
            capacity_url: None,
        }
    }

    /// True when this replica serves `model` (base or adapter).
    pub fn serves(&self, model: &str) -> bool {
        self.model == model || self.adapters.iter().any(|a| a == model)
    }
}

/// Checks endpoint identities are unique and every endpoint is usable.
pub fn validate_endpoints(endpoints: &[EndpointConfig], field: &str) -> Result<(), ConfigError> {
    let mut seen = std::collections::HashSet::new();
    for (i, ep) in endpoints.iter().enumerate() {
        if !seen.insert(&ep.id) {
            return Err(ConfigError::field(
                format!("{field}[{i}].address"),
                format!("duplicate endpoint {}", ep.id),
            ));
        }
        if ep.model.is_empty() {
            return Err(ConfigError::field(
                format!("{field}[{i}].model"),
                "must not be empty",
            ));
        }
        if ep.events_bind && ep.events.is_none() {
            return Err(ConfigError::field(
                format!("{field}[{i}].events_bind"),
                "needs `events` (the address to bind)",
            ));
        }
        for (name, value, binds) in [
            ("events", &ep.events, ep.events_bind),
            ("replay", &ep.replay, false),
        ] {
            let Some(v) = value else { continue };
            let parsed = Endpoint::parse(v)
                .map_err(|e| ConfigError::field(format!("{field}[{i}].{name}"), e.to_string()))?;
            if parsed.is_wildcard() && !binds {
                let hint = if name == "events" {
                    ", or set events_bind: true"
                } else {
                    ""
                };
                return Err(ConfigError::field(
                    format!("{field}[{i}].{name}"),
                    format!("{v:?} is a bind address: name the replica's host{hint}"),
                ));
            }
        }
    }
    Ok(())
}

/// Turns the host name of an endpoint's `address` into addresses.
pub trait Resolve {
    /// The addresses `host` resolves to, each with `port`.
    fn lookup(&self, host: &str, port: u16) -> std::io::Result<Vec<SocketAddr>>;
}

/// Resolves nothing: `address` must be `ip:port` (parsing alone, the
/// discovery file).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoResolve;

impl Resolve for NoResolve {
    fn lookup(&self, _host: &str, _port: u16) -> std::io::Result<Vec<SocketAddr>> {
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "host names are not resolved here: give ip:port",
        ))
    }
}

/// The system's resolver (`/etc/hosts`, DNS), as indexd's binary uses for
/// its config file and `--endpoint` flags.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemResolve;

impl Resolve for SystemResolve {
    fn lookup(&self, host: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
        Ok((host, port).to_socket_addrs()?.collect())
    }
}

impl<F> Resolve for F
where
    F: Fn(&str, u16) -> std::io::Result<Vec<SocketAddr>>,
{
    fn lookup(&self, host: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
        self(host, port)
    }
}

/// `ip:port` as is; `host:port` through `resolve`, to its one IPv4 address
/// (else its one IPv6 address). A name with several addresses of that family
/// is refused: an endpoint is one replica.
fn endpoint_address(text: &str, resolve: &dyn Resolve) -> Result<SocketAddr, String> {
    if let Ok(address) = text.parse::<SocketAddr>() {
        return Ok(address);
    }
    let not_an_address = || format!("{text:?} is not ip:port or host:port");
    let (host, port) = text.rsplit_once(':').ok_or_else(not_an_address)?;
    let port: u16 = port.parse().map_err(|_| not_an_address())?;
    let is_name = !host.is_empty()
        && host.len() <= 253
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'));
    if !is_name {
        return Err(not_an_address());
    }
    let found = resolve
        .lookup(host, port)
        .map_err(|e| format!("cannot resolve {host:?}: {e}"))?;
    let of_family = |v4: bool| {
        let mut addrs: Vec<SocketAddr> = found
            .iter()
            .filter(|a| a.is_ipv4() == v4)
            .map(|a| SocketAddr::new(a.ip(), port))
            .collect();
        addrs.sort();
        addrs.dedup();
        addrs
    };
    let mut addrs = of_family(true);
    if addrs.is_empty() {
        addrs = of_family(false);
    }
    match addrs.as_slice() {
        [one] => Ok(*one),
        [] => Err(format!("{host:?} resolves to no address")),
        many => Err(format!(
            "{host:?} resolves to {} addresses ({}): name one replica per endpoint",
            many.len(),
            many.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// The YAML shape of an endpoint (also the discovery file's).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[derive(Debug)]
pub(crate) struct RawEndpoint {
    address: String,
    #[serde(default)]
    data_parallel_rank: Option<u32>,
    model: String,
    #[serde(default)]
    adapters: Vec<String>,
    #[serde(default)]
    events: Option<String>,
    #[serde(default)]
    events_bind: bool,
    #[serde(default)]
    replay: Option<String>,
    #[serde(default)]
    metrics_url: Option<String>,
    #[serde(default)]
    capacity_url: Option<String>,
}

impl RawEndpoint {
    pub(crate) fn into_endpoint(
        self,
        field: &str,
        resolve: &dyn Resolve,
    ) -> Result<EndpointConfig, ConfigError> {
        let address = endpoint_address(&self.address, resolve)
            .map_err(|reason| ConfigError::field(format!("{field}.address"), reason))?;
        let url = |name: &str, v: Option<String>| -> Result<Option<HttpUrl>, ConfigError> {
            v.map(|u| {
                HttpUrl::parse(&u).ok_or_else(|| {
                    ConfigError::field(
                        format!("{field}.{name}"),
                        format!("{u:?} is not an http:// URL"),
                    )
                })
            })
            .transpose()
        };
        Ok(EndpointConfig {
            id: EndpointId {
                address,
                rank: self.data_parallel_rank,
            },
            model: self.model,
            adapters: self.adapters,
            events: self.events,
            events_bind: self.events_bind,
            replay: self.replay,
            metrics_url: url("metrics_url", self.metrics_url)?,
            capacity_url: url("capacity_url", self.capacity_url)?,
        })
    }
}

/// The discovery file: `endpoints:` and nothing else.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDiscovery {
    #[serde(default)]
    endpoints: Vec<RawEndpoint>,
}

/// Parses one endpoint written as a YAML flow mapping, e.g.
/// `{address: 127.0.0.1:8000, model: m, events: tcp://127.0.0.1:5557}`
/// (the binary's `--endpoint` flag), with `address` as `ip:port`.
pub fn parse_endpoint(text: &str) -> Result<EndpointConfig, ConfigError> {
    parse_endpoint_with(text, &NoResolve)
}

/// [`parse_endpoint`], with a host name in `address` resolved by `resolve`.
pub fn parse_endpoint_with(
    text: &str,
    resolve: &dyn Resolve,
) -> Result<EndpointConfig, ConfigError> {
    let raw: RawEndpoint =
        serde_yaml::from_str(text).map_err(|e| ConfigError::Parse(format!("--endpoint: {e}")))?;
    raw.into_endpoint("--endpoint", resolve)
}

/// Parses a discovery file's text (addresses as `ip:port`: the file is
/// re-read while indexd runs, and names are resolved only at start).
pub fn parse_discovery(text: &str) -> Result<Vec<EndpointConfig>, ConfigError> {
    let raw: RawDiscovery =
        serde_yaml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
    let endpoints = raw
        .endpoints
        .into_iter()
        .enumerate()
        .map(|(i, e)| e.into_endpoint(&format!("endpoints[{i}]"), &NoResolve))
        .collect::<Result<Vec<_>, _>>()?;
    validate_endpoints(&endpoints, "endpoints")?;
    Ok(endpoints)
}
