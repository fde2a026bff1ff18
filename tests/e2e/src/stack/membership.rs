//! Replicas that join and leave a running stack
//! ([`super::StackOptions::membership_files`]).
//!
//! indexd follows a discovery file (`discovery_file`, polled every
//! [`DISCOVERY_INTERVAL`]) and Envoy's replica clusters are EDS clusters
//! fed from one file each (`path_config_source`, reloaded when a file is
//! moved into their directory). Every change rewrites the files whole:
//! written beside, then renamed over, as Kubernetes swaps a ConfigMap
//! volume, so neither reader ever sees half a file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::parts::{REPLICA_CLUSTERS, mock_config, mock_endpoints};
use super::{Stack, setup, vllm_endpoint, vllm_plan, wait_until};
use crate::envoy::eds_file;
use crate::vllm::RealVllm;
use crate::{HarnessError, http};

/// How often indexd polls its discovery file here (its default is 2 s).
pub(super) const DISCOVERY_INTERVAL: Duration = Duration::from_millis(100);
/// How long the gateways may take to see a change of the files.
const PROPAGATION_TIMEOUT: Duration = Duration::from_secs(10);

/// The discovery file and the EDS files, in the stack's directory.
#[derive(Debug)]
pub(super) struct Files {
    dir: PathBuf,
    /// The EDS files' `version_info`.
    version: u64,
}

impl Files {
    /// Files under `dir` (the EDS files in `dir/eds`, the directory Envoy
    /// watches).
    pub(super) fn new(dir: &Path) -> Result<Self, HarnessError> {
        let files = Self {
            dir: dir.to_path_buf(),
            version: 0,
        };
        std::fs::create_dir_all(files.eds_dir())
            .map_err(|e| HarnessError::io("create the EDS directory", e))?;
        Ok(files)
    }

    /// indexd's discovery file.
    pub(super) fn discovery_path(&self) -> PathBuf {
        self.dir.join("endpoints.yaml")
    }

    /// The directory Envoy watches for its EDS files.
    pub(super) fn eds_dir(&self) -> PathBuf {
        self.dir.join("eds")
    }

    /// The EDS file of Envoy's cluster `cluster`.
    pub(super) fn eds_path(&self, cluster: &str) -> PathBuf {
        self.eds_dir().join(format!("{cluster}.json"))
    }

    /// Writes `text` to `path` whole: beside it in the stack's directory
    /// (outside Envoy's watched one), then renamed over it.
    fn replace(&self, path: &Path, text: &str) -> Result<(), HarnessError> {
        let name = path
            .file_name()
            .map_or_else(|| "file".into(), |n| n.to_string_lossy().into_owned());
        let tmp = self.dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).map_err(|e| HarnessError::io("write a membership file", e))?;
        std::fs::rename(&tmp, path).map_err(|e| HarnessError::io("rename a membership file", e))
    }

    /// indexd's discovery file listing `endpoints` (JSON, which is YAML).
    pub(super) fn write_discovery(
        &self,
        endpoints: &[indexd::EndpointConfig],
    ) -> Result<(), HarnessError> {
        let list: Vec<Value> = endpoints.iter().map(discovery_entry).collect();
        let text = json!({ "endpoints": list }).to_string();
        self.replace(&self.discovery_path(), &text)
    }

    /// Envoy's EDS files: every replica cluster with `hosts`.
    pub(super) fn write_eds(&mut self, hosts: &[SocketAddr]) -> Result<(), HarnessError> {
        self.version += 1;
        for cluster in REPLICA_CLUSTERS {
            let text = eds_file(cluster, hosts, self.version).to_string();
            self.replace(&self.eds_path(cluster), &text)?;
        }
        Ok(())
    }
}

/// One endpoint as the discovery file lists it (indexd's `endpoints:` entry).
fn discovery_entry(e: &indexd::EndpointConfig) -> Value {
    let mut entry = json!({
        "address": e.id.address.to_string(),
        "model": e.model,
        "adapters": e.adapters,
        "events_bind": e.events_bind,
    });
    let optional = [
        ("data_parallel_rank", e.id.rank.map(|r| json!(r))),
        ("events", e.events.as_ref().map(|v| json!(v))),
        ("replay", e.replay.as_ref().map(|v| json!(v))),
        (
            "metrics_url",
            e.metrics_url.as_ref().map(|u| json!(u.to_string())),
        ),
        (
            "capacity_url",
            e.capacity_url.as_ref().map(|u| json!(u.to_string())),
        ),
    ];
    for (key, value) in optional {
        if let Some(v) = value {
            entry[key] = v;
        }
    }
    entry
}

/// Requests a replica (mock or vLLM) is running or holding waiting, by its own
/// `/metrics` (every rank summed).
fn in_flight(address: SocketAddr) -> Result<f64, HarnessError> {
    let url = format!("http://{address}/metrics");
    let body = http::get(&url, &[], Duration::from_secs(5))?.body;
    Ok(body
        .lines()
        .filter(|l| {
            l.starts_with("vllm:num_requests_running{")
                || l.starts_with("vllm:num_requests_waiting{")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

impl Stack {
    fn membership_files(&mut self) -> Result<&mut Files, HarnessError> {
        self.membership.as_mut().ok_or_else(|| {
            setup(
                "stack membership",
                "the replicas are fixed: start the stack with membership_files",
            )
        })
    }

    /// Waits until every gateway's Envoy has (`present`) or no longer has
    /// `address` in its inference cluster.
    fn wait_envoys(&self, address: SocketAddr, present: bool) -> Result<(), HarnessError> {
        let name = address.to_string();
        let [inference, _] = REPLICA_CLUSTERS;
        let what = if present {
            "every Envoy has the new host"
        } else {
            "every Envoy dropped the host"
        };
        wait_until(what, PROPAGATION_TIMEOUT, || {
            self.gateway_envoys().iter().all(|envoy| {
                envoy
                    .cluster_hosts(inference)
                    .is_ok_and(|hosts| hosts.contains(&name) == present)
            })
        })
    }

    /// Starts one more mock replica and announces it: Envoy's EDS files
    /// first, and once every gateway's Envoy routes to it (so that an
    /// override naming it takes effect), indexd's discovery file. Returns
    /// its address (`ip:port`, as `x-mock-vllm-replica` names it). indexd is
    /// not waited for: it registers, subscribes to and scrapes the replica
    /// on its own time, which is part of what a joining replica tests
    /// ([`Stack::wait_index_ready`] waits for it).
    pub fn add_replica(&mut self) -> Result<SocketAddr, HarnessError> {
        self.membership_files()?;
        let replica = self
            .runtime
            .block_on(mock_vllm::MockVllm::start(mock_config(&self.options)))
            .map_err(|e| setup("mock vLLM replica", e))?;
        let endpoints = mock_endpoints(&self.options, &replica);
        self.replicas.push(replica);
        self.announce(endpoints)
    }

    /// Starts one more real vLLM replica and waits until it serves, without
    /// announcing it: the fleet does not know it until [`Stack::announce`]
    /// (a replica's start-up, a minute of CPU here, is not part of a join).
    /// Returns its endpoints for that call. It stops with the stack, or when
    /// [`Stack::remove_replica`] has drained it.
    pub fn start_spare_vllm(&mut self) -> Result<Vec<indexd::EndpointConfig>, HarnessError> {
        self.membership_files()?;
        let plan = vllm_plan(&self.options, self.real.len())?;
        let mut server = RealVllm::spawn(&plan)?;
        server.wait_ready()?;
        self.real.push(server);
        Ok(vec![vllm_endpoint(&self.options, &plan)])
    }

    /// Announces a replica's `endpoints` (its ranks) to the running fleet:
    /// Envoy's EDS files first, and once every gateway's Envoy routes to it
    /// (so that an override naming it takes effect), indexd's discovery
    /// file. Returns its address.
    pub fn announce(
        &mut self,
        endpoints: Vec<indexd::EndpointConfig>,
    ) -> Result<SocketAddr, HarnessError> {
        let address = endpoints
            .first()
            .map(|e| e.id.address)
            .ok_or_else(|| setup("announce", "no endpoint to announce"))?;
        self.endpoints.extend(endpoints);
        let hosts = self.host_addresses();
        self.membership_files()?.write_eds(&hosts)?;
        self.wait_envoys(address, true)?;
        let endpoints = self.endpoints.clone();
        self.membership_files()?.write_discovery(&endpoints)?;
        Ok(address)
    }

    /// Drains replica `address` (a mock or a real vLLM) out of the fleet, in the order of a
    /// graceful drain: out of indexd's discovery file first, and once every
    /// indexd has dropped it (no Pick names it any more), out of Envoy's
    /// EDS files; once every Envoy has dropped it too (no request can reach
    /// it), waits up to `drain_timeout` until it has nothing running or
    /// waiting (what it was sent is answered) and stops it. The other order
    /// would have Envoy skip a host indexd still ranks first and send its
    /// requests to the next one named, a choice indexd never made. Returns
    /// when the gateways had dropped it.
    pub fn remove_replica(
        &mut self,
        address: SocketAddr,
        drain_timeout: Duration,
    ) -> Result<Instant, HarnessError> {
        self.membership_files()?;
        let mock = self.replicas.iter().position(|r| r.http_addr() == address);
        let real = self.real.iter().position(|r| r.http == address);
        if mock.is_none() && real.is_none() {
            return Err(setup(
                "remove_replica",
                format!("{address} is none of the stack's replicas"),
            ));
        }
        let ids: Vec<indexd::EndpointId> = self
            .endpoints
            .iter()
            .filter(|e| e.id.address == address)
            .map(|e| e.id.clone())
            .collect();
        self.endpoints.retain(|e| e.id.address != address);
        let endpoints = self.endpoints.clone();
        let hosts = self.host_addresses();
        self.membership_files()?.write_discovery(&endpoints)?;
        let indexds = self.indexd_handles();
        wait_until(
            "every indexd dropped the replica",
            PROPAGATION_TIMEOUT,
            || {
                indexds
                    .iter()
                    .all(|h| ids.iter().all(|id| h.replica(id).is_none()))
            },
        )?;
        self.membership_files()?.write_eds(&hosts)?;
        self.wait_envoys(address, false)?;
        let left = Instant::now();
        // Idle in two reads in a row: a request Envoy forwarded just before
        // it dropped the host may not show in the first.
        let mut idle_reads = 0;
        wait_until("the leaving replica drained", drain_timeout, || {
            idle_reads = match in_flight(address) {
                Ok(n) if n <= 0.0 => idle_reads + 1,
                _ => 0,
            };
            if idle_reads < 2 {
                std::thread::sleep(Duration::from_millis(50));
            }
            idle_reads >= 2
        })?;
        if let Some(at) = mock {
            let replica = self.replicas.remove(at);
            self.runtime.block_on(replica.shutdown());
        }
        if let Some(at) = real {
            // Dropped: its process group is stopped.
            drop(self.real.remove(at));
        }
        Ok(left)
    }

    /// The replicas' distinct addresses, as Envoy's clusters list them.
    fn host_addresses(&self) -> Vec<SocketAddr> {
        let mut hosts: Vec<SocketAddr> = self.endpoints.iter().map(|e| e.id.address).collect();
        hosts.dedup();
        hosts
    }
}
