//! Kubernetes discovery's settings: which objects to watch, and how each
//! ready pod becomes one endpoint per data-parallel rank.
//!
//! ```yaml
//! kubernetes:
//!   service: vllm-llama             # the Service whose EndpointSlices list the replicas …
//!   # pod_selector: app.kubernetes.io/name=vllm   # … or pods by label selector (one of the two)
//!   namespace: inference            # default: the client's (in a pod: its own namespace)
//!   api_server: https://10.96.0.1   # default: in-cluster, else $KUBECONFIG / ~/.kube/config
//!   model: llama                    # a pod's kvroute.io/model annotation overrides it
//!   adapters: [my-lora]             # kvroute.io/adapters: "a,b"
//!   data_parallel_ranks: 0-1        # kvroute.io/data-parallel-ranks: "0-1" or "0,1"
//!   port: 8000                      # the HTTP port Envoy knows the host by: a number or a port name
//!   events_port: 5557               # vLLM's KV-event PUB (each rank adds its rank)
//!   replay_port: 5558               # vLLM's replay ROUTER (each rank adds its rank)
//!   metrics_path: /metrics          # scraped on `port`
//!   capacity_port: 9000             # optional capacity signal, with capacity_path
//!   capacity_path: /capacity
//!   ip_family: IPv4                 # optional: one family of a dual-stack Service
//! ```
//!
//! Annotations are read where a pod is at hand: with `pod_selector` always,
//! with `service` from the pod each endpoint's `targetRef` names (indexd then
//! watches the namespace's pods too, narrowed by `pod_selector` if given).

use std::net::IpAddr;

use serde::Deserialize;

use crate::error::ConfigError;

/// Annotation naming the served model.
pub const MODEL_ANNOTATION: &str = "kvroute.io/model";
/// Annotation listing LoRA adapters, comma-separated.
pub const ADAPTERS_ANNOTATION: &str = "kvroute.io/adapters";
/// Annotation listing the data-parallel ranks a pod serves (`0-3`, `0,2`).
pub const RANKS_ANNOTATION: &str = "kvroute.io/data-parallel-ranks";

/// Most data-parallel ranks one pod may declare.
pub const MAX_RANKS: usize = 256;

/// What to watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KubeSource {
    /// The EndpointSlices of this Service (label
    /// `kubernetes.io/service-name`); `pods` narrows the pods read for
    /// annotations.
    Service {
        /// The Service's name.
        name: String,
        /// A label selector for the pods whose annotations are read.
        pods: Option<String>,
    },
    /// Pods matching this label selector.
    Pods {
        /// The label selector, as `kubectl get -l` takes it.
        selector: String,
    },
}

/// A port: a number, or the name of a port on the EndpointSlice (with
/// `service`) or of a container port of the pod (with `pod_selector`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortRef {
    /// A port number.
    Number(u16),
    /// A port name.
    Name(String),
}

impl std::fmt::Display for PortRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Number(n) => write!(f, "{n}"),
            Self::Name(n) => write!(f, "{n:?}"),
        }
    }
}

/// One address family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum IpFamily {
    /// IPv4 only.
    IPv4,
    /// IPv6 only.
    IPv6,
}

impl IpFamily {
    /// True when `ip` is of this family.
    pub fn admits(self, ip: IpAddr) -> bool {
        matches!(
            (self, ip),
            (Self::IPv4, IpAddr::V4(_)) | (Self::IPv6, IpAddr::V6(_))
        )
    }
}

/// Kubernetes discovery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesConfig {
    /// What to watch.
    pub source: KubeSource,
    /// The namespace; None: the client's default (in a pod, its own).
    pub namespace: Option<String>,
    /// The API server's URL; None: in-cluster, else the kubeconfig.
    pub api_server: Option<String>,
    /// The model of pods without the model annotation.
    pub model: Option<String>,
    /// Adapters of pods without the adapters annotation.
    pub adapters: Vec<String>,
    /// Data-parallel ranks of pods without the ranks annotation (None: the
    /// server is one replica without a rank).
    pub ranks: Option<Vec<u32>>,
    /// The HTTP port (the endpoint's address, /metrics, tokenizer calls).
    pub port: PortRef,
    /// The KV-event publisher's port (rank 0's).
    pub events_port: PortRef,
    /// The replay socket's port (rank 0's).
    pub replay_port: PortRef,
    /// The path scraped on `port`.
    pub metrics_path: String,
    /// The capacity signal's port and path, if any.
    pub capacity: Option<(PortRef, String)>,
    /// Only addresses of this family.
    pub ip_family: Option<IpFamily>,
}

impl KubernetesConfig {
    /// Watches `service`'s EndpointSlices, with the defaults otherwise.
    pub fn service(name: impl Into<String>) -> Self {
        Self::with_source(KubeSource::Service {
            name: name.into(),
            pods: None,
        })
    }

    /// Watches pods matching `selector`, with the defaults otherwise.
    pub fn pods(selector: impl Into<String>) -> Self {
        Self::with_source(KubeSource::Pods {
            selector: selector.into(),
        })
    }

    fn with_source(source: KubeSource) -> Self {
        Self {
            source,
            namespace: None,
            api_server: None,
            model: None,
            adapters: Vec::new(),
            ranks: None,
            port: PortRef::Number(8000),
            events_port: PortRef::Number(5557),
            replay_port: PortRef::Number(5558),
            metrics_path: "/metrics".to_owned(),
            capacity: None,
            ip_family: None,
        }
    }

    /// Checks what the types cannot express; errors name `kubernetes.*`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let f = |name: &str| format!("kubernetes.{name}");
        match &self.source {
            KubeSource::Service { name, pods } => {
                check_dns_label(&f("service"), name)?;
                if let Some(s) = pods {
                    check_selector(&f("pod_selector"), s)?;
                }
            }
            KubeSource::Pods { selector } => check_selector(&f("pod_selector"), selector)?,
        }
        if let Some(ns) = &self.namespace {
            check_dns_label(&f("namespace"), ns)?;
        }
        if let Some(url) = &self.api_server {
            let ok = url
                .strip_prefix("https://")
                .or_else(|| url.strip_prefix("http://"))
                .is_some_and(|rest| !rest.is_empty())
                && url.parse::<http::Uri>().is_ok();
            if !ok {
                return Err(ConfigError::field(
                    f("api_server"),
                    format!("{url:?} is not an http:// or https:// URL"),
                ));
            }
        }
        if self.model.as_deref() == Some("") {
            return Err(ConfigError::field(f("model"), "must not be empty"));
        }
        check_adapters(&f("adapters"), &self.adapters)?;
        if let Some(ranks) = &self.ranks
            && (ranks.is_empty() || ranks.len() > MAX_RANKS)
        {
            return Err(ConfigError::field(
                f("data_parallel_ranks"),
                format!("must list 1 to {MAX_RANKS} ranks"),
            ));
        }
        for (name, port) in [
            ("port", &self.port),
            ("events_port", &self.events_port),
            ("replay_port", &self.replay_port),
        ] {
            check_port(&f(name), port)?;
        }
        check_path(&f("metrics_path"), &self.metrics_path)?;
        if let Some((port, path)) = &self.capacity {
            check_port(&f("capacity_port"), port)?;
            check_path(&f("capacity_path"), path)?;
        }
        Ok(())
    }
}

/// Parses data-parallel ranks: `3`, `0-3` (inclusive), `0,2,5`, or a mix
/// (`0-1,4`); sorted, without repeats, at most [`MAX_RANKS`].
pub fn parse_ranks(text: &str) -> Result<Vec<u32>, String> {
    let mut ranks = std::collections::BTreeSet::new();
    for part in text.split(',').map(str::trim) {
        let bad = || format!("{part:?} is not a rank or a range of ranks (e.g. 0-3, or 0,2)");
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let lo: u32 = lo.parse().map_err(|_| bad())?;
        let hi: u32 = hi.parse().map_err(|_| bad())?;
        if hi < lo {
            return Err(bad());
        }
        if (hi - lo) as usize >= MAX_RANKS {
            return Err(format!("{part:?} spans more than {MAX_RANKS} ranks"));
        }
        ranks.extend(lo..=hi);
        if ranks.len() > MAX_RANKS {
            return Err(format!("more than {MAX_RANKS} ranks"));
        }
    }
    Ok(ranks.into_iter().collect())
}

/// Splits a comma-separated adapter list (blank items dropped).
pub fn parse_adapters(text: &str) -> Vec<String> {
    text.split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(str::to_owned)
        .collect()
}

fn check_adapters(field: &str, adapters: &[String]) -> Result<(), ConfigError> {
    if adapters.iter().any(String::is_empty) {
        return Err(ConfigError::field(field, "adapter names must not be empty"));
    }
    Ok(())
}

/// An RFC 1123 label (namespaces, Service names): 1–63 lowercase letters,
/// digits and `-`, starting and ending with a letter or digit.
fn check_dns_label(field: &str, v: &str) -> Result<(), ConfigError> {
    let ok = !v.is_empty()
        && v.len() <= 63
        && v.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !v.starts_with('-')
        && !v.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(ConfigError::field(
            field,
            format!("{v:?} is not a Kubernetes name (lowercase letters, digits, '-'; at most 63)"),
        ))
    }
}

/// A label selector's outline; the API server checks the rest (its refusal
/// is logged and retried).
fn check_selector(field: &str, v: &str) -> Result<(), ConfigError> {
    if v.trim().is_empty() {
        return Err(ConfigError::field(field, "must not be empty"));
    }
    if v.chars().any(|c| c.is_control()) {
        return Err(ConfigError::field(
            field,
            "must not hold control characters",
        ));
    }
    Ok(())
}

/// A port number 1–65535, or an IANA service name as Kubernetes names
/// ports: 1–15 lowercase letters, digits and `-`, at least one letter.
fn check_port(field: &str, port: &PortRef) -> Result<(), ConfigError> {
    match port {
        PortRef::Number(0) => Err(ConfigError::field(field, "must be 1 to 65535")),
        PortRef::Number(_) => Ok(()),
        PortRef::Name(n) => {
            let ok = !n.is_empty()
                && n.len() <= 15
                && n.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && n.bytes().any(|b| b.is_ascii_lowercase())
                && !n.starts_with('-')
                && !n.ends_with('-');
            if ok {
                Ok(())
            } else {
                Err(ConfigError::field(
                    field,
                    format!(
                        "{n:?} is neither a port number nor a port name (lowercase letters, digits, '-'; at most 15)"
                    ),
                ))
            }
        }
    }
}

fn check_path(field: &str, path: &str) -> Result<(), ConfigError> {
    if path.starts_with('/') && !path.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Ok(())
    } else {
        Err(ConfigError::field(
            field,
            format!("{path:?} is not a URL path (starting with /)"),
        ))
    }
}

/// A port in YAML: a number or a name.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum RawPort {
    Number(u64),
    Name(String),
}

impl RawPort {
    fn into_port(self, field: &str) -> Result<PortRef, ConfigError> {
        match self {
            Self::Number(n) => u16::try_from(n)
                .ok()
                .filter(|n| *n > 0)
                .map(PortRef::Number)
                .ok_or_else(|| {
                    ConfigError::field(field, format!("{n} is not a port (1 to 65535)"))
                }),
            Self::Name(s) => Ok(match s.parse::<u16>() {
                Ok(n) => PortRef::Number(n),
                Err(_) => PortRef::Name(s),
            }),
        }
    }
}

/// Ranks in YAML: `3`, `[0, 1]` or `"0-3"`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum RawRanks {
    One(u32),
    List(Vec<u32>),
    Text(String),
}

/// The `kubernetes:` section as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawKubernetes {
    service: Option<String>,
    pod_selector: Option<String>,
    namespace: Option<String>,
    api_server: Option<String>,
    model: Option<String>,
    #[serde(default)]
    adapters: Vec<String>,
    data_parallel_ranks: Option<RawRanks>,
    port: Option<RawPort>,
    events_port: Option<RawPort>,
    replay_port: Option<RawPort>,
    metrics_path: Option<String>,
    capacity_port: Option<RawPort>,
    capacity_path: Option<String>,
    ip_family: Option<IpFamily>,
}

impl RawKubernetes {
    pub(crate) fn into_config(self) -> Result<KubernetesConfig, ConfigError> {
        let source = match (self.service, self.pod_selector) {
            (Some(name), pods) => KubeSource::Service { name, pods },
            (None, Some(selector)) => KubeSource::Pods { selector },
            (None, None) => {
                return Err(ConfigError::field(
                    "kubernetes",
                    "name a `service` (its EndpointSlices are watched) or a `pod_selector`",
                ));
            }
        };
        let mut c = KubernetesConfig::with_source(source);
        c.namespace = self.namespace;
        c.api_server = self.api_server;
        c.model = self.model;
        c.adapters = self.adapters;
        c.ranks = match self.data_parallel_ranks {
            None => None,
            Some(RawRanks::One(r)) => Some(vec![r]),
            Some(RawRanks::List(mut l)) => {
                l.sort_unstable();
                l.dedup();
                Some(l)
            }
            Some(RawRanks::Text(t)) => Some(
                parse_ranks(&t)
                    .map_err(|e| ConfigError::field("kubernetes.data_parallel_ranks", e))?,
            ),
        };
        let port = |name: &str, raw: Option<RawPort>, default: PortRef| {
            raw.map_or(Ok(default), |p| p.into_port(&format!("kubernetes.{name}")))
        };
        c.port = port("port", self.port, c.port)?;
        c.events_port = port("events_port", self.events_port, c.events_port)?;
        c.replay_port = port("replay_port", self.replay_port, c.replay_port)?;
        if let Some(p) = self.metrics_path {
            c.metrics_path = p;
        }
        c.capacity = match (self.capacity_port, self.capacity_path) {
            (Some(p), path) => Some((
                p.into_port("kubernetes.capacity_port")?,
                path.unwrap_or_else(|| "/capacity".to_owned()),
            )),
            (None, Some(_)) => {
                return Err(ConfigError::field(
                    "kubernetes.capacity_path",
                    "needs capacity_port",
                ));
            }
            (None, None) => None,
        };
        c.ip_family = self.ip_family;
        c.validate()?;
        Ok(c)
    }
}
