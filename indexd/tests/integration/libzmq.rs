//! Interop with libzmq itself (through pyzmq, which real vLLM publishes
//! with): a PUB with heartbeats (indexd connects), a ROUTER serving replays
//! as vLLM does, and a PUB that connects to indexd's bound SUB.
//!
//! Needs a Python with pyzmq: `$KVROUTE_VLLM_VENV` or
//! `~/.cache/kvroute/vllm-venv` (the real-vLLM tier's venv, which
//! `tests/vllm/install.sh` builds). So it is ignored by `cargo test` and run
//! by `make test-vllm`, after that venv is built:
//!
//! ```sh
//! cargo test -p indexd --test integration -- --ignored libzmq
//! ```
//!
//! Without such a Python it fails, saying why.

use std::path::PathBuf;
use std::process::Stdio;

use std::net::SocketAddr;
use std::time::Duration;

use indexd::config::EndpointConfig;
use kvroute_proto::keys::{BlockSize, block_keys};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::harness::{
    Daemon, POLL, TIMEOUT, batch, eventually, raw, replica, stored_batch, tokens,
};

/// The Python side: binds PUB and ROUTER on 127.0.0.1, prints their ports,
/// then obeys one command per stdin line (answering `ok`):
/// `pub SEQ HEX` (buffer and publish), `buf SEQ HEX` (buffer only),
/// `connect PORT` (a second PUB connecting out), `out SEQ HEX` (publish on it).
const PUBLISHER: &str = r#"
import json, struct, sys, zmq
ctx = zmq.Context()
def heartbeating_pub():
    s = ctx.socket(zmq.PUB)
    s.setsockopt(zmq.HEARTBEAT_IVL, 100)
    s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 600)
    s.setsockopt(zmq.LINGER, 0)
    return s
pub = heartbeating_pub()
pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
router = ctx.socket(zmq.ROUTER)
router.setsockopt(zmq.LINGER, 0)
router_port = router.bind_to_random_port("tcp://127.0.0.1")
out = None
topic = b"kv@py@m"
buffer = []
print(json.dumps({"pub": pub_port, "router": router_port, "zmq": zmq.zmq_version()}), flush=True)
poller = zmq.Poller()
poller.register(router, zmq.POLLIN)
poller.register(sys.stdin, zmq.POLLIN)
while True:
    for sock, _ in poller.poll():
        if sock is router:
            ident, empty, start = router.recv_multipart()
            (start,) = struct.unpack(">Q", start)
            for seq, payload in buffer:
                if seq >= start:
                    router.send_multipart([ident, b"", topic, struct.pack(">Q", seq), payload])
            router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
            continue
        line = sys.stdin.readline()
        if not line:
            sys.exit(0)
        cmd, *args = line.split()
        if cmd == "connect":
            out = heartbeating_pub()
            out.connect("tcp://127.0.0.1:" + args[0])
        else:
            seq = int(args[0])
            payload = bytes.fromhex(args[1]) if len(args) > 1 else b""
            if cmd in ("pub", "buf"):
                buffer.append((seq, payload))
            if cmd == "pub":
                pub.send_multipart([topic, struct.pack(">Q", seq), payload])
            if cmd == "out":
                out.send_multipart([topic, struct.pack(">Q", seq), payload])
        print("ok", flush=True)
"#;

fn python_with_zmq() -> Result<PathBuf, String> {
    let venv = std::env::var_os("KVROUTE_VLLM_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvroute/vllm-venv"))
        })
        .ok_or("neither KVROUTE_VLLM_VENV nor HOME is set")?;
    let python = venv.join("bin/python");
    let ok = std::process::Command::new(&python)
        .args(["-c", "import zmq"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        Ok(python)
    } else {
        Err(format!("{} cannot import zmq", python.display()))
    }
}

struct PyPublisher {
    _child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    pub_port: u16,
    router_port: u16,
}

impl PyPublisher {
    async fn start(python: &PathBuf) -> Self {
        let mut child = tokio::process::Command::new(python)
            .args(["-c", PUBLISHER])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(TIMEOUT, stdout.next_line())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let ports: serde_json::Value = serde_json::from_str(&line).unwrap();
        eprintln!("libzmq {}", ports["zmq"]);
        Self {
            _child: child,
            stdin,
            stdout,
            pub_port: ports["pub"].as_u64().unwrap() as u16,
            router_port: ports["router"].as_u64().unwrap() as u16,
        }
    }

    async fn cmd(&mut self, cmd: &str, seq: u64, payload: &[u8]) {
        let hex: String = payload.iter().map(|b| format!("{b:02x}")).collect();
        let line = format!("{cmd} {seq} {hex}\n");
        self.stdin.write_all(line.as_bytes()).await.unwrap();
        let answer = tokio::time::timeout(TIMEOUT, self.stdout.next_line())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(answer.as_deref(), Some("ok"), "after {cmd}");
    }

    /// Publishes empty batches from `seq` on `cmd`'s socket until one is
    /// applied; returns the next seq.
    async fn sync(&mut self, d: &Daemon, cmd: &str, mut seq: u64) -> u64 {
        let deadline = tokio::time::Instant::now() + TIMEOUT;
        loop {
            let before = d.counter("indexd_batches_total");
            self.cmd(cmd, seq, &batch(vec![])).await;
            seq += 1;
            let wait_until = tokio::time::Instant::now() + Duration::from_millis(300);
            while tokio::time::Instant::now() < wait_until {
                if d.counter("indexd_batches_total") > before {
                    return seq;
                }
                tokio::time::sleep(POLL).await;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{cmd} never applied"
            );
        }
    }
}

async fn matched(d: &mut Daemon, t: &[u32]) -> (String, u32) {
    let keys = raw(&block_keys(t, BlockSize::new(16).unwrap(), None));
    let c = d.pick(&keys, 16).await.candidates.remove(0);
    (c.address, c.matched_blocks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs pyzmq: make test-vllm runs it"]
async fn libzmq_publishers_replays_and_heartbeats() {
    let python = python_with_zmq().unwrap_or_else(|why| {
        panic!(
            "{why}: build the real-vLLM venv (bash tests/vllm/install.sh) or set KVROUTE_VLLM_VENV"
        )
    });
    let mut py = PyPublisher::start(&python).await;
    let mut connecting = EndpointConfig::new(SocketAddr::from(([127, 0, 0, 1], 18100)), "m");
    connecting.events = Some(format!("tcp://127.0.0.1:{}", py.pub_port));
    connecting.replay = Some(format!("tcp://127.0.0.1:{}", py.router_port));
    let bound_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut bound = EndpointConfig::new(SocketAddr::from(([127, 0, 0, 1], 18101)), "m");
    bound.events = Some(format!("tcp://127.0.0.1:{bound_port}"));
    bound.events_bind = true;
    let mut d = Daemon::start(vec![connecting, bound], 16).await;

    // indexd connects to libzmq's PUB; the start-up replay comes from
    // libzmq's ROUTER.
    eventually("the start-up replay", || async {
        d.handle.replica(&replica(18100)).unwrap().fresh
    })
    .await;
    assert_eq!(d.counter("indexd_replays_total{result=\"complete\"}"), 1.0);
    let mut seq = py.sync(&d, "pub", 0).await;
    let stored = tokens(32, 21);
    py.cmd("pub", seq, &stored_batch(&[1, 2], None, &stored, 16, None))
        .await;
    seq += 1;
    eventually("the store", || async {
        d.handle.replica(&replica(18100)).unwrap().entries == 2
    })
    .await;
    assert_eq!(
        matched(&mut d, &stored).await,
        ("127.0.0.1:18100".into(), 2)
    );

    // A batch lost live is recovered by a replay from libzmq's ROUTER.
    let lost = tokens(16, 22);
    py.cmd("buf", seq, &stored_batch(&[3], None, &lost, 16, None))
        .await;
    py.cmd("pub", seq + 1, &batch(vec![])).await;
    eventually("the replayed batch", || async {
        d.handle.replica(&replica(18100)).unwrap().entries == 3
    })
    .await;
    assert_eq!(d.counter("indexd_seq_gaps_total"), 1.0);
    assert_eq!(matched(&mut d, &lost).await, ("127.0.0.1:18100".into(), 1));

    // A libzmq PUB connecting to indexd's bound SUB.
    py.cmd("connect", u64::from(bound_port), &[]).await;
    let out_seq = py.sync(&d, "out", 0).await;
    let pushed = tokens(16, 23);
    py.cmd("out", out_seq, &stored_batch(&[4], None, &pushed, 16, None))
        .await;
    eventually("the bound replica's store", || async {
        d.handle.replica(&replica(18101)).unwrap().entries == 1
    })
    .await;
    assert_eq!(
        matched(&mut d, &pushed).await,
        ("127.0.0.1:18101".into(), 1)
    );

    // libzmq pings every 100 ms and drops a peer silent for 600 ms: only
    // PONGs keep these connections up. Watch them for a while.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(d.counter("indexd_purges_total{reason=\"resync\"}"), 0.0);
    assert_eq!(d.counter("indexd_zmtp_violations_total"), 0.0);
    let late = tokens(16, 24);
    py.cmd("pub", seq + 2, &stored_batch(&[5], None, &late, 16, None))
        .await;
    let late_out = tokens(16, 25);
    py.cmd(
        "out",
        out_seq + 1,
        &stored_batch(&[6], None, &late_out, 16, None),
    )
    .await;
    eventually("both streams after the heartbeats", || async {
        d.handle.replica(&replica(18100)).unwrap().entries == 4
            && d.handle.replica(&replica(18101)).unwrap().entries == 2
    })
    .await;
    assert_eq!(d.counter("indexd_seq_gaps_total"), 1.0);
    d.stop().await;
}
