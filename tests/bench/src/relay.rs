//! A KV-event relay: fans one vLLM replica's event stream out to several
//! subscribers.
//!
//! vLLM's publisher binds only for a wildcard endpoint (`tcp://*:port`, every
//! interface); for a loopback one it connects out, to one subscriber. The bench
//! needs several on every replica (the oracle's indexd, and one indexd per
//! gateway), so each replica publishes to a relay: a SUB socket bound on
//! `127.0.0.1` that vLLM connects to, and a PUB socket bound on `127.0.0.1`
//! that every indexd connects to. Messages pass frame for frame (topic, seq,
//! payload), so a subscriber sees vLLM's own sequence numbers and replays
//! from vLLM's replay socket as it would from vLLM itself.

use std::time::Duration;

use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;
use zeromq::{Endpoint, PubSocket, Socket, SocketRecv, SocketSend, SubSocket};

use crate::BenchError;

/// A running relay; stops with the runtime or on drop.
#[derive(Debug)]
pub struct Relay {
    /// `tcp://127.0.0.1:port` that vLLM's publisher connects to.
    pub inbound: String,
    /// `tcp://127.0.0.1:port` of the PUB socket subscribers connect to.
    pub outbound: String,
    stop: CancellationToken,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn relay_error(what: &str, e: impl std::fmt::Display) -> BenchError {
    BenchError::Harness(kvroute_e2e::HarnessError::Unexpected {
        context: format!("KV-event relay: {what}"),
        message: e.to_string(),
    })
}

fn tcp_url(endpoint: &Endpoint) -> Result<String, BenchError> {
    match endpoint {
        Endpoint::Tcp(host, port) => Ok(format!("tcp://{host}:{port}")),
        other => Err(relay_error("bound endpoint", format!("not TCP: {other}"))),
    }
}

impl Relay {
    /// Binds both sockets on loopback (ports chosen by the system) and starts
    /// forwarding on `runtime`.
    pub fn start(runtime: &Runtime) -> Result<Self, BenchError> {
        let stop = CancellationToken::new();
        let (sub, publisher, inbound, outbound) = runtime.block_on(async {
            let mut sub = SubSocket::new();
            let inbound = sub
                .bind("tcp://127.0.0.1:0")
                .await
                .map_err(|e| relay_error("bind SUB", e))?;
            sub.subscribe("")
                .await
                .map_err(|e| relay_error("subscribe", e))?;
            let mut publisher = PubSocket::new();
            let outbound = publisher
                .bind("tcp://127.0.0.1:0")
                .await
                .map_err(|e| relay_error("bind PUB", e))?;
            Ok::<_, BenchError>((sub, publisher, tcp_url(&inbound)?, tcp_url(&outbound)?))
        })?;
        runtime.spawn(forward(sub, publisher, stop.clone()));
        Ok(Self {
            inbound,
            outbound,
            stop,
        })
    }
}

/// Forwards every message until `stop` fires. A receive error (vLLM's
/// publisher went away) is waited out: it reconnects by itself.
async fn forward(mut sub: SubSocket, mut publisher: PubSocket, stop: CancellationToken) {
    loop {
        let message = tokio::select! {
            () = stop.cancelled() => return,
            m = sub.recv() => m,
        };
        match message {
            // PUB drops for slow or absent subscribers, as vLLM's own does.
            Ok(m) => {
                let _ = publisher.send(m).await;
            }
            Err(_) => tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(Duration::from_millis(10)) => {}
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zeromq::ZmqMessage;

    #[test]
    fn frames_pass_through_to_every_subscriber() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let relay = Relay::start(&runtime).unwrap();
        runtime.block_on(async {
            let mut a = SubSocket::new();
            let mut b = SubSocket::new();
            for s in [&mut a, &mut b] {
                s.connect(&relay.outbound).await.unwrap();
                s.subscribe("").await.unwrap();
            }
            let mut publisher = PubSocket::new();
            publisher.connect(&relay.inbound).await.unwrap();
            let frames = || {
                let mut m = ZmqMessage::from("kv@r0@tiny");
                m.push_back(vec![0u8, 0, 0, 0, 0, 0, 0, 7].into());
                m.push_back(vec![0x93u8].into());
                m
            };
            // Subscriptions travel asynchronously: publish until both see one.
            let mut got = Vec::new();
            for s in [&mut a, &mut b] {
                let mut received = None;
                for _ in 0..100 {
                    publisher.send(frames()).await.unwrap();
                    if let Ok(Ok(m)) =
                        tokio::time::timeout(Duration::from_millis(100), s.recv()).await
                    {
                        received = Some(m);
                        break;
                    }
                }
                got.push(received.expect("a relayed message within 10 s"));
            }
            for m in got {
                assert_eq!(m.len(), 3);
                assert_eq!(m.get(1).unwrap().as_ref(), &[0, 0, 0, 0, 0, 0, 0, 7]);
            }
        });
    }
}
