//! What the filter relies on in Envoy 1.40, checked on the real
//! thing: the `override_host` policy honours an ordered host list, skips hosts
//! the cluster does not have, and falls back to least-request without one.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use kvroute_e2e::envoy::{cluster_route, http_listener, inference_cluster};
use kvroute_e2e::{Envoy, EnvoyConfig, http};

const HEADER: &str = "x-gateway-destination-endpoint";
const TIMEOUT: Duration = Duration::from_secs(10);

/// An upstream that answers every request with its own address.
fn upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut writer = stream;
                loop {
                    // Read one request's headers (bodies are empty here).
                    let mut line = String::new();
                    let mut len = 0usize;
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            len = v.trim().parse().unwrap_or(0);
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0; len];
                    std::io::Read::read_exact(&mut reader, &mut body).unwrap();
                    let me = addr.to_string();
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{me}",
                        me.len()
                    );
                    if writer.write_all(reply.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

fn start(replicas: &[SocketAddr]) -> Envoy {
    let config = EnvoyConfig::new(
        vec![http_listener(
            "ingress",
            vec![],
            vec![cluster_route("vllm", Duration::from_secs(5))],
        )],
        vec![inference_cluster("vllm", replicas, HEADER)],
    );
    Envoy::start(&config).unwrap()
}

#[test]
fn override_list_is_honoured_in_order_and_unknown_hosts_are_skipped() {
    let replicas: Vec<SocketAddr> = (0..3).map(|_| upstream()).collect();
    let envoy = start(&replicas);
    let url = format!("{}/v1/completions", envoy.listener_url("ingress").unwrap());

    for target in &replicas {
        for _ in 0..5 {
            let list = format!("{target},{}", replicas[0]);
            let r = http::post(&url, &[(HEADER, &list)], b"{}", TIMEOUT).unwrap();
            assert_eq!(r.status, 200);
            assert_eq!(r.body, target.to_string());
        }
    }

    // A host outside the cluster is skipped; the next in the list serves.
    let list = format!("127.0.0.1:1,{}", replicas[2]);
    let r = http::post(&url, &[(HEADER, &list)], b"{}", TIMEOUT).unwrap();
    assert_eq!(r.body, replicas[2].to_string());
}

#[test]
fn without_the_header_least_request_spreads_requests() {
    let replicas: Vec<SocketAddr> = (0..2).map(|_| upstream()).collect();
    let envoy = start(&replicas);
    let url = format!("{}/v1/completions", envoy.listener_url("ingress").unwrap());

    let served: BTreeSet<String> = (0..40)
        .map(|_| http::post(&url, &[], b"{}", TIMEOUT).unwrap().body)
        .collect();
    let expected: BTreeSet<String> = replicas.iter().map(ToString::to_string).collect();
    assert_eq!(served, expected, "least-request should reach both replicas");
}
