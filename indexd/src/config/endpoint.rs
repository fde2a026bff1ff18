//! Endpoints: a replica's identity and sources, their YAML shape (the
//! config's `endpoints:`, the discovery file's, the `--endpoint` flag's) and
//! their checks.

use std::net::SocketAddr;

use serde::Deserialize;

use crate::error::ConfigError;
use crate::zmtp::Endpoint;

/// A replica (one data-parallel rank of one vLLM server).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId {
    /// The host as Envoy knows it.
    pub address: SocketAddr,
    /// The data-parallel rank inside the server, if any.
    pub rank: Option<u32>,
}

impl std::fmt::Display for EndpointId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.rank {
            Some(rank) => write!(f, "{}#{rank}", self.address),
            None => write!(f, "{}", self.address),
        }
    }
}

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
    pub(crate) fn into_endpoint(self, field: &str) -> Result<EndpointConfig, ConfigError> {
        let address: SocketAddr = self.address.parse().map_err(|_| {
            ConfigError::field(
                format!("{field}.address"),
                format!("{:?} is not ip:port", self.address),
            )
        })?;
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
/// (the binary's `--endpoint` flag).
pub fn parse_endpoint(text: &str) -> Result<EndpointConfig, ConfigError> {
    let raw: RawEndpoint =
        serde_yaml::from_str(text).map_err(|e| ConfigError::Parse(format!("--endpoint: {e}")))?;
    raw.into_endpoint("--endpoint")
}

/// Parses a discovery file's text.
pub fn parse_discovery(text: &str) -> Result<Vec<EndpointConfig>, ConfigError> {
    let raw: RawDiscovery =
        serde_yaml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
    let endpoints = raw
        .endpoints
        .into_iter()
        .enumerate()
        .map(|(i, e)| e.into_endpoint(&format!("endpoints[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    validate_endpoints(&endpoints, "endpoints")?;
    Ok(endpoints)
}
