//! Kubernetes objects → endpoints: a pure function of the watched objects
//! and the `kubernetes:` settings, so that every rule is tested without an
//! API server.
//!
//! A ready address (an EndpointSlice endpoint whose `conditions.ready` is
//! not false, or a pod whose `Ready` condition is `True`, running, not being
//! deleted) becomes one endpoint per data-parallel rank: the address
//! `ip:port` as Envoy knows the host, `tcp://ip:(events_port + rank)`,
//! `tcp://ip:(replay_port + rank)`, `http://ip:port{metrics_path}`. A
//! ready address that cannot be made into endpoints (no model, a bad
//! annotation, a named port that is not there) is left out with its reason.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::config::kubernetes::{
    ADAPTERS_ANNOTATION, KubernetesConfig, MODEL_ANNOTATION, PortRef, RANKS_ANNOTATION,
    parse_adapters, parse_ranks,
};
use crate::config::{EndpointConfig, HttpUrl};
use crate::ids::EndpointId;

/// The endpoints derived from a snapshot of the watched objects.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Derived {
    /// Endpoints, one per ready address and rank.
    pub endpoints: Vec<EndpointConfig>,
    /// Ready addresses left out: `(object, reason)`.
    pub skipped: Vec<(String, String)>,
}

/// One ready address and what is known about it.
struct Target<'a> {
    /// For logs: `pod/NAME` or `endpointslice/NAME[i]`.
    name: String,
    ip: IpAddr,
    /// The pod's annotations, where the pod is known.
    annotations: Option<&'a BTreeMap<String, String>>,
    /// Named ports: the slice's, or the pod's container ports.
    ports: BTreeMap<&'a str, u16>,
}

/// Endpoints from a Service's EndpointSlices. `pods` (namespace-less pod
/// name → pod) supplies annotations; `None` when pods are not watched.
pub fn from_slices<'a>(
    config: &KubernetesConfig,
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    pods: Option<&BTreeMap<String, &'a Pod>>,
) -> Derived {
    let mut out = Derived::default();
    for slice in slices {
        let slice_name = slice.metadata.name.as_deref().unwrap_or("?");
        if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
            continue; // FQDN slices name no pod IP
        }
        let ports: BTreeMap<&str, u16> = slice
            .ports
            .iter()
            .flatten()
            .filter(|p| p.protocol.as_deref().is_none_or(|proto| proto == "TCP"))
            .filter_map(|p| {
                let port = u16::try_from(p.port?).ok()?;
                Some((p.name.as_deref().unwrap_or(""), port))
            })
            .collect();
        for (i, ep) in slice.endpoints.iter().enumerate() {
            // The API: a nil `ready` is to be read as true. Terminating
            // endpoints are not ready.
            if ep.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                continue;
            }
            let pod_name = ep
                .target_ref
                .as_ref()
                .filter(|r| r.kind.as_deref() == Some("Pod"))
                .and_then(|r| r.name.as_deref());
            let name = match pod_name {
                Some(p) => format!("pod/{p}"),
                None => format!("endpointslice/{slice_name}[{i}]"),
            };
            let Some(address) = ep.addresses.first() else {
                continue;
            };
            let Ok(ip) = address.parse::<IpAddr>() else {
                out.skipped
                    .push((name, format!("address {address:?} is not an IP address")));
                continue;
            };
            let annotations = match (pods, pod_name) {
                (Some(pods), Some(p)) => match pods.get(p) {
                    Some(pod) => pod.metadata.annotations.as_ref(),
                    None => {
                        out.skipped.push((
                            name,
                            "its pod is not known (yet, or outside pod_selector)".to_owned(),
                        ));
                        continue;
                    }
                },
                _ => None,
            };
            let target = Target {
                name,
                ip,
                annotations,
                ports: ports.clone(),
            };
            push(config, &target, &mut out);
        }
    }
    out
}

/// Endpoints from pods.
pub fn from_pods<'a>(
    config: &KubernetesConfig,
    pods: impl IntoIterator<Item = &'a Pod>,
) -> Derived {
    let mut out = Derived::default();
    for pod in pods {
        let name = format!("pod/{}", pod.metadata.name.as_deref().unwrap_or("?"));
        if !is_ready(pod) {
            continue;
        }
        let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.as_deref()) else {
            continue;
        };
        let Ok(ip) = ip.parse::<IpAddr>() else {
            out.skipped
                .push((name, format!("podIP {ip:?} is not an IP address")));
            continue;
        };
        let ports: BTreeMap<&str, u16> = pod
            .spec
            .iter()
            .flat_map(|s| &s.containers)
            .flat_map(|c| c.ports.iter().flatten())
            .filter(|p| p.protocol.as_deref().is_none_or(|proto| proto == "TCP"))
            .filter_map(|p| Some((p.name.as_deref()?, u16::try_from(p.container_port).ok()?)))
            .collect();
        let target = Target {
            name,
            ip,
            annotations: pod.metadata.annotations.as_ref(),
            ports,
        };
        push(config, &target, &mut out);
    }
    out
}

/// A pod serving traffic: running, `Ready` true, not being deleted.
fn is_ready(pod: &Pod) -> bool {
    let Some(status) = &pod.status else {
        return false;
    };
    pod.metadata.deletion_timestamp.is_none()
        && status.phase.as_deref() == Some("Running")
        && status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True")
}

fn push(config: &KubernetesConfig, target: &Target<'_>, out: &mut Derived) {
    match endpoints_of(config, target) {
        Ok(eps) => out.endpoints.extend(eps),
        Err(reason) => out.skipped.push((target.name.clone(), reason)),
    }
}

fn endpoints_of(config: &KubernetesConfig, t: &Target<'_>) -> Result<Vec<EndpointConfig>, String> {
    if config.ip_family.is_some_and(|f| !f.admits(t.ip)) {
        return Ok(Vec::new());
    }
    let annotation = |key: &str| t.annotations.and_then(|a| a.get(key)).map(String::as_str);
    let model = match annotation(MODEL_ANNOTATION) {
        Some(m) if !m.trim().is_empty() => m.trim().to_owned(),
        Some(_) => return Err(format!("annotation {MODEL_ANNOTATION} is empty")),
        None => config.model.clone().ok_or_else(|| {
            format!("no model: set kubernetes.model or the pod annotation {MODEL_ANNOTATION}")
        })?,
    };
    let adapters = match annotation(ADAPTERS_ANNOTATION) {
        Some(a) => parse_adapters(a),
        None => config.adapters.clone(),
    };
    let ranks: Vec<Option<u32>> = match annotation(RANKS_ANNOTATION) {
        Some(r) => parse_ranks(r)
            .map_err(|e| format!("annotation {RANKS_ANNOTATION}: {e}"))?
            .into_iter()
            .map(Some)
            .collect(),
        None => match &config.ranks {
            Some(r) => r.iter().copied().map(Some).collect(),
            None => vec![None],
        },
    };
    let port = |what: &str, p: &PortRef| -> Result<u16, String> {
        match p {
            PortRef::Number(n) => Ok(*n),
            PortRef::Name(name) => t
                .ports
                .get(name.as_str())
                .copied()
                .ok_or_else(|| format!("no port named {name:?} (kubernetes.{what})")),
        }
    };
    let http = SocketAddr::new(t.ip, port("port", &config.port)?);
    let events = port("events_port", &config.events_port)?;
    let replay = port("replay_port", &config.replay_port)?;
    let capacity = config
        .capacity
        .as_ref()
        .map(|(p, path)| {
            Ok::<_, String>(HttpUrl {
                authority: SocketAddr::new(t.ip, port("capacity_port", p)?).to_string(),
                path: path.clone(),
            })
        })
        .transpose()?;
    let metrics = HttpUrl {
        authority: http.to_string(),
        path: config.metrics_path.clone(),
    };
    ranks
        .into_iter()
        .map(|rank| {
            let offset = |base: u16| {
                let r = u16::try_from(rank.unwrap_or(0)).ok();
                r.and_then(|r| base.checked_add(r)).ok_or_else(|| {
                    format!("rank {} moves port {base} past 65535", rank.unwrap_or(0))
                })
            };
            Ok(EndpointConfig {
                id: EndpointId {
                    address: http,
                    rank,
                },
                model: model.clone(),
                adapters: adapters.clone(),
                events: Some(format!("tcp://{}", SocketAddr::new(t.ip, offset(events)?))),
                events_bind: false,
                replay: Some(format!("tcp://{}", SocketAddr::new(t.ip, offset(replay)?))),
                metrics_url: Some(metrics.clone()),
                capacity_url: capacity.clone(),
            })
        })
        .collect()
}

#[cfg(test)]
#[path = "derive_tests.rs"]
mod tests;
