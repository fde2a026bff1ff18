use super::*;

#[test]
fn yaml_round_trip_and_defaults() {
    let c = Config::from_yaml(
        "grpc_listen: 127.0.0.1:0\nblock_size: 32\nscrape_interval: 250ms\nendpoints:\n  - address: 10.0.0.1:8000\n    model: m\n    events: tcp://10.0.0.1:5557\n    replay: tcp://10.0.0.1:5558\n    metrics_url: http://10.0.0.1:8000/metrics\n  - address: 10.0.0.1:8000\n    data_parallel_rank: 1\n    model: m\n",
    )
    .unwrap();
    assert_eq!(c.block_size.get(), 32);
    assert_eq!(c.scrape_interval, Duration::from_millis(250));
    assert_eq!(c.endpoints.len(), 2);
    assert_eq!(c.endpoints[1].id.rank, Some(1));
    assert_eq!(
        c.endpoints[0].metrics_url,
        Some(HttpUrl {
            authority: "10.0.0.1:8000".into(),
            path: "/metrics".into()
        })
    );
    assert_eq!(c.speculative_ttl, Duration::from_secs(5));
    let w = Config::from_yaml("weights: {credit_cpu: 0.5}\n")
        .unwrap()
        .weights;
    assert_eq!((w.credit_cpu, w.credit_gpu), (0.5, 1.0));
    assert!(Config::from_yaml("weights: {credit_tpu: 1}\n").is_err());
    let err =
        Config::from_yaml("endpoints:\n  - {address: 1.2.3.4:1, model: m, events_bind: true}\n")
            .unwrap_err();
    assert!(
        err.to_string().contains("endpoints[0].events_bind"),
        "{err}"
    );
    let star = "endpoints:\n  - {address: 1.2.3.4:1, model: m, events: 'tcp://*:5557'}\n";
    let err = Config::from_yaml(star).unwrap_err();
    assert!(err.to_string().contains("endpoints[0].events"), "{err}");
    let bind = "endpoints:\n  - {address: 1.2.3.4:1, model: m, events: 'tcp://*:5557', events_bind: true}\n";
    assert!(Config::from_yaml(bind).is_ok());
    for (bad, field) in [
        ("events: 'ipc:///tmp/kv'", "endpoints[0].events"),
        ("events: 'tcp://host'", "endpoints[0].events"),
        ("replay: 'tcp://*:5558'", "endpoints[0].replay"),
        ("replay: 'inproc://r'", "endpoints[0].replay"),
    ] {
        let yaml = format!("endpoints:\n  - {{address: 1.2.3.4:1, model: m, {bad}}}\n");
        let err = Config::from_yaml(&yaml).unwrap_err().to_string();
        assert!(err.contains(field), "{bad}: {err}");
    }
    let named = "endpoints:\n  - {address: 1.2.3.4:1, model: m, events: 'tcp://vllm-0:5557', replay: 'tcp://vllm-0:5558'}\n";
    assert!(Config::from_yaml(named).is_ok());
}

#[test]
fn errors_name_the_field() {
    let err = Config::from_yaml("endpoints:\n  - address: nope\n    model: m\n").unwrap_err();
    assert!(err.to_string().contains("endpoints[0].address"), "{err}");
    let err = Config::from_yaml("scrape_interval: soon\n").unwrap_err();
    assert!(err.to_string().contains("scrape_interval"), "{err}");
    let err = Config::from_yaml("block_size: 0\n").unwrap_err();
    assert!(err.to_string().contains("block_size"), "{err}");
    let err = Config::from_yaml(
        "endpoints:\n  - address: 1.2.3.4:1\n    model: m\n  - address: 1.2.3.4:1\n    model: m\n",
    )
    .unwrap_err();
    assert!(err.to_string().contains("endpoints[1].address"), "{err}");
    let err = Config::from_yaml("bogus: 1\n").unwrap_err();
    assert!(err.to_string().contains("bogus"), "{err}");
}

#[test]
fn attention_chunk_sizes_are_read_per_model_and_checked() {
    let c = Config::from_yaml("block_size: 64\nattention_chunk_size: {llama4: 8192}\n").unwrap();
    assert_eq!(c.chunk_tokens("llama4"), Some(8192));
    assert_eq!(c.chunk_tokens("other"), None);
    for yaml in [
        "block_size: 64\nattention_chunk_size: {llama4: 100}\n",
        "attention_chunk_size: {llama4: 0}\n",
    ] {
        let err = Config::from_yaml(yaml).unwrap_err();
        assert!(err.to_string().contains("attention_chunk_size"), "{err}");
        assert!(err.to_string().contains("llama4"), "{err}");
    }
}

#[test]
fn transport_limits_are_read_and_checked() {
    let c =
        Config::from_yaml("max_message_bytes: 9000000\nmax_publisher_connections: 2\n").unwrap();
    assert_eq!(c.limits.max_message_bytes, 9_000_000);
    assert_eq!(c.limits.max_publisher_connections, 2);
    assert_eq!(
        Config::new(Vec::new()).limits.max_message_bytes,
        Limits::default().max_message_bytes
    );
    for (yaml, field) in [
        ("max_message_bytes: 1000\n", "max_message_bytes"),
        ("max_frame_bytes: 0\n", "max_frame_bytes"),
        (
            "max_publisher_connections: 0\n",
            "max_publisher_connections",
        ),
    ] {
        let err = Config::from_yaml(yaml).unwrap_err().to_string();
        assert!(err.contains(field), "{yaml}: {err}");
    }
}

#[test]
fn endpoint_flag() {
    let e = parse_endpoint(
        "{address: 127.0.0.1:8000, model: m, events: tcp://127.0.0.1:5557, data_parallel_rank: 1}",
    )
    .unwrap();
    assert_eq!(e.id.rank, Some(1));
    assert_eq!(e.events.as_deref(), Some("tcp://127.0.0.1:5557"));
    assert!(
        parse_endpoint("{address: x, model: m}")
            .unwrap_err()
            .to_string()
            .contains("--endpoint.address")
    );
}

/// A resolver that knows a few names and answers nothing else.
fn fake_dns(host: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
    let ips: &[&str] = match host {
        "vllm-0" => &["fd00::10", "172.20.0.10"],
        "vllm-1" => &["172.20.0.11", "172.20.0.11"],
        "v6-only" => &["fd00::12"],
        "scaled" => &["172.20.0.13", "172.20.0.14"],
        "nothing" => &[],
        _ => return Err(std::io::Error::other("no such host")),
    };
    Ok(ips
        .iter()
        .map(|ip| SocketAddr::new(ip.parse().unwrap(), port))
        .collect())
}

#[test]
fn host_names_in_addresses_resolve_once_to_one_address() {
    let yaml = "endpoints:\n  - {address: vllm-0:8000, model: m, events: 'tcp://vllm-0:5557', metrics_url: 'http://vllm-0:8000/metrics'}\n  - {address: vllm-1:8000, model: m}\n  - {address: v6-only:8000, model: m}\n  - {address: 10.0.0.9:8000, model: m}\n";
    let c = Config::from_yaml_with(yaml, &fake_dns).unwrap();
    let addresses: Vec<String> = c.endpoints.iter().map(|e| e.id.to_string()).collect();
    // IPv4 first (Envoy's V4_PREFERRED), duplicates of one address are one.
    assert_eq!(
        addresses,
        [
            "172.20.0.10:8000",
            "172.20.0.11:8000",
            "[fd00::12]:8000",
            "10.0.0.9:8000"
        ]
    );
    // The other sources keep the name: they resolve at each connect.
    assert_eq!(c.endpoints[0].events.as_deref(), Some("tcp://vllm-0:5557"));
    assert_eq!(
        c.endpoints[0]
            .metrics_url
            .as_ref()
            .map(|u| u.authority.as_str()),
        Some("vllm-0:8000")
    );

    for (address, reason) in [
        (
            "scaled:8000",
            "resolves to 2 addresses (172.20.0.13:8000, 172.20.0.14:8000)",
        ),
        ("nothing:8000", "resolves to no address"),
        ("unknown:8000", "cannot resolve \"unknown\": no such host"),
        ("vllm 0:8000", "is not ip:port or host:port"),
        ("vllm-0", "is not ip:port or host:port"),
        ("vllm-0:http", "is not ip:port or host:port"),
        (":8000", "is not ip:port or host:port"),
        ("[vllm-0]:8000", "is not ip:port or host:port"),
    ] {
        let yaml = format!("endpoints:\n  - {{address: '{address}', model: m}}\n");
        let err = Config::from_yaml_with(&yaml, &fake_dns)
            .unwrap_err()
            .to_string();
        assert!(err.contains("`endpoints[0].address`"), "{address}: {err}");
        assert!(err.contains(reason), "{address}: {err}");
    }
    // Two names for one replica are one endpoint twice.
    let twice = "endpoints:\n  - {address: vllm-1:8000, model: m}\n  - {address: 172.20.0.11:8000, model: m}\n";
    let err = Config::from_yaml_with(twice, &fake_dns).unwrap_err();
    assert!(err.to_string().contains("duplicate endpoint"), "{err}");
}

#[test]
fn parsing_alone_never_resolves() {
    let yaml = "endpoints:\n  - {address: localhost:8000, model: m}\n";
    let err = Config::from_yaml(yaml).unwrap_err().to_string();
    assert!(err.contains("`endpoints[0].address`"), "{err}");
    assert!(err.contains("not resolved here"), "{err}");
    let err = parse_endpoint("{address: localhost:8000, model: m}")
        .unwrap_err()
        .to_string();
    assert!(err.contains("--endpoint.address"), "{err}");
    let err = parse_discovery("endpoints:\n  - {address: localhost:8000, model: m}\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("not resolved here"), "{err}");
}

#[test]
fn the_system_resolver_reads_the_hosts_file() {
    // localhost is in /etc/hosts: no query leaves the machine.
    let e = parse_endpoint_with("{address: localhost:8000, model: m}", &SystemResolve).unwrap();
    assert!(e.id.address.ip().is_loopback(), "{}", e.id);
    assert_eq!(e.id.address.port(), 8000);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("indexd.yaml");
    std::fs::write(
        &path,
        "endpoints:\n  - {address: localhost:8000, model: m}\n",
    )
    .unwrap();
    let c = Config::from_file_with(&path, &SystemResolve).unwrap();
    assert!(c.endpoints[0].id.address.ip().is_loopback());
    assert!(Config::from_file(&path).is_err());
}

#[test]
fn durations() {
    assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
    assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
    assert_eq!(parse_duration("7"), Some(Duration::from_secs(7)));
    assert_eq!(parse_duration("-1s"), None);
    assert_eq!(parse_duration("x"), None);
}

#[test]
fn snapshot_settings_are_read_and_checked() {
    let c = Config::from_yaml(
        "snapshot_path: /var/lib/kvroute/index.snap\nsnapshot_interval: 5s\nmax_snapshot_bytes: 1048576\nmax_snapshot_age: 2m\nmax_snapshot_write_time: 500ms\n",
    )
    .unwrap();
    let s = &c.snapshot;
    assert_eq!(
        s.path.as_deref(),
        Some(std::path::Path::new("/var/lib/kvroute/index.snap"))
    );
    assert_eq!(
        (s.interval, s.max_bytes, s.max_age, s.max_write_time),
        (
            Duration::from_secs(5),
            1 << 20,
            Duration::from_secs(120),
            Duration::from_millis(500)
        )
    );
    let d = Config::new(Vec::new()).snapshot;
    assert_eq!((d.path, d.interval), (None, Duration::from_secs(30)));
    for (yaml, field) in [
        ("snapshot_interval: 0s\n", "snapshot_interval"),
        ("max_snapshot_write_time: 0\n", "max_snapshot_write_time"),
        ("max_snapshot_bytes: 10\n", "max_snapshot_bytes"),
        ("max_snapshot_age: soon\n", "max_snapshot_age"),
    ] {
        let err = Config::from_yaml(yaml).unwrap_err().to_string();
        assert!(err.contains(field), "{yaml}: {err}");
    }
}

#[test]
fn listeners_beyond_loopback_need_a_token_or_an_explicit_waiver() {
    let c = Config::from_yaml("grpc_listen: unix:///run/kvroute/indexd.sock\n").unwrap();
    assert_eq!(
        c.grpc_listen.unix_path(),
        Some(std::path::Path::new("/run/kvroute/indexd.sock"))
    );
    let d = Config::new(Vec::new()).access;
    assert_eq!((d.observe_rate.get(), d.observe_burst.get()), (2000, 4000));
    assert!(d.auth_token_file.is_none() && !d.allow_unauthenticated);
    for (yaml, field) in [
        ("grpc_listen: 0.0.0.0:50061\n", "grpc_listen"),
        ("grpc_listen: 10.0.0.5:50061\n", "grpc_listen"),
        ("http_listen: 0.0.0.0:9471\n", "http_listen"),
        ("grpc_listen: unix:///run/\n", "grpc_listen"),
        ("grpc_listen: localhost:1\n", "grpc_listen"),
        ("observe_rate: 0\n", "observe_rate"),
        ("observe_burst: 0\n", "observe_burst"),
        ("auth_token_file: ''\n", "auth_token_file"),
    ] {
        let err = Config::from_yaml(yaml).unwrap_err().to_string();
        assert!(err.contains(field), "{yaml}: {err}");
    }
    let err = Config::from_yaml("grpc_listen: 0.0.0.0:50061\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("auth_token_file") && err.contains("allow_unauthenticated"),
        "{err}"
    );
    for ok in [
        "grpc_listen: 0.0.0.0:50061\nhttp_listen: 0.0.0.0:9471\nauth_token_file: /etc/kvroute/token\n",
        "grpc_listen: 0.0.0.0:50061\nhttp_listen: 0.0.0.0:9471\nallow_unauthenticated: true\n",
        "grpc_listen: '[::1]:50061'\nhttp_listen: 127.0.0.1:9471\n",
    ] {
        Config::from_yaml(ok).unwrap();
    }
    let c = Config::from_yaml("observe_rate: 50\nobserve_burst: 100\n").unwrap();
    assert_eq!(
        (c.access.observe_rate.get(), c.access.observe_burst.get()),
        (50, 100)
    );
}

#[test]
fn ingest_nice_is_read_and_bounded() {
    assert_eq!(Config::new(Vec::new()).ingest_nice, 0);
    assert_eq!(
        Config::from_yaml("ingest_nice: 7\n").unwrap().ingest_nice,
        7
    );
    let err = Config::from_yaml("ingest_nice: 20\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("ingest_nice"), "{err}");
    assert!(Config::from_yaml("ingest_nice: -1\n").is_err());
}

#[test]
fn the_kubernetes_section_parses_with_defaults_and_names_bad_fields() {
    use super::kubernetes::{IpFamily, KubeSource, PortRef};
    let c = Config::from_yaml(
        "kubernetes:\n  service: vllm-llama\n  namespace: inference\n  model: llama\n  data_parallel_ranks: 0-1,4\n  port: http\n  events_port: \"5560\"\n  ip_family: IPv6\n",
    )
    .unwrap();
    let k = c.kubernetes.unwrap();
    assert_eq!(
        k.source,
        KubeSource::Service {
            name: "vllm-llama".into(),
            pods: None
        }
    );
    assert_eq!(k.namespace.as_deref(), Some("inference"));
    assert_eq!(k.ranks, Some(vec![0, 1, 4]));
    assert_eq!(k.port, PortRef::Name("http".into()));
    assert_eq!(k.events_port, PortRef::Number(5560));
    assert_eq!(k.replay_port, PortRef::Number(5558));
    assert_eq!(k.metrics_path, "/metrics");
    assert_eq!(k.ip_family, Some(IpFamily::IPv6));
    let pods = Config::from_yaml(
        "kubernetes: {pod_selector: 'app=vllm,tier in (gpu)', data_parallel_ranks: [1, 0, 1]}\n",
    )
    .unwrap()
    .kubernetes
    .unwrap();
    assert_eq!(
        pods.source,
        KubeSource::Pods {
            selector: "app=vllm,tier in (gpu)".into()
        }
    );
    assert_eq!(pods.ranks, Some(vec![0, 1]));
    assert!(Config::from_yaml("{}").unwrap().kubernetes.is_none());

    for (yaml, field) in [
        ("kubernetes: {model: m}", "kubernetes"),
        ("kubernetes: {service: Vllm}", "kubernetes.service"),
        (
            "kubernetes: {service: v, namespace: 'a b'}",
            "kubernetes.namespace",
        ),
        ("kubernetes: {pod_selector: ' '}", "kubernetes.pod_selector"),
        ("kubernetes: {service: v, port: 0}", "kubernetes.port"),
        ("kubernetes: {service: v, port: 70000}", "kubernetes.port"),
        (
            "kubernetes: {service: v, replay_port: Replay}",
            "kubernetes.replay_port",
        ),
        (
            "kubernetes: {service: v, events_port: a-very-long-port-name}",
            "kubernetes.events_port",
        ),
        (
            "kubernetes: {service: v, data_parallel_ranks: '3-1'}",
            "kubernetes.data_parallel_ranks",
        ),
        (
            "kubernetes: {service: v, data_parallel_ranks: '0-999'}",
            "kubernetes.data_parallel_ranks",
        ),
        (
            "kubernetes: {service: v, data_parallel_ranks: []}",
            "kubernetes.data_parallel_ranks",
        ),
        (
            "kubernetes: {service: v, metrics_path: metrics}",
            "kubernetes.metrics_path",
        ),
        (
            "kubernetes: {service: v, capacity_path: /c}",
            "kubernetes.capacity_path",
        ),
        (
            "kubernetes: {service: v, api_server: 'ftp://x'}",
            "kubernetes.api_server",
        ),
        ("kubernetes: {service: v, model: ''}", "kubernetes.model"),
        (
            "kubernetes: {service: v, adapters: ['']}",
            "kubernetes.adapters",
        ),
        (
            "kubernetes: {service: v}\ndiscovery_file: /e.yaml",
            "kubernetes",
        ),
    ] {
        let err = Config::from_yaml(yaml).unwrap_err().to_string();
        assert!(err.contains(&format!("`{field}`")), "{yaml}: {err}");
    }
    let err = Config::from_yaml("kubernetes: {service: v, ip_family: v4}")
        .unwrap_err()
        .to_string();
    assert!(err.contains("ip_family"), "{err}");
    let err = Config::from_yaml("kubernetes: {service: v, selector: x}")
        .unwrap_err()
        .to_string();
    assert!(err.contains("selector"), "{err}");
}

#[test]
fn ranks_parse_as_lists_and_ranges() {
    use super::kubernetes::parse_ranks;
    assert_eq!(parse_ranks("3"), Ok(vec![3]));
    assert_eq!(parse_ranks("0-3"), Ok(vec![0, 1, 2, 3]));
    assert_eq!(parse_ranks(" 4, 0-1 ,1"), Ok(vec![0, 1, 4]));
    for bad in ["", "a", "1-", "-1", "2-1", "0-4294967295", "0-200,300-400"] {
        assert!(parse_ranks(bad).is_err(), "{bad}");
    }
}

#[test]
fn ingest_cpus_take_a_number_or_a_cpuset_list() {
    use crate::cpus::{CpuList, CpuSpec};
    assert_eq!(Config::new(Vec::new()).ingest_cpus, None);
    let read = |yaml: &str| Config::from_yaml(yaml).unwrap().ingest_cpus.unwrap();
    let list = |cpus: Vec<usize>| CpuSpec::List(CpuList::new(cpus).unwrap());
    assert_eq!(read("ingest_cpus: 1\n"), list(vec![1]));
    assert_eq!(read("ingest_cpus: '2-3,6'\n"), list(vec![2, 3, 6]));
    assert_eq!(read("ingest_cpus: last\n"), CpuSpec::Last(1));
    assert_eq!(read("ingest_cpus: 'last:2'\n"), CpuSpec::Last(2));
    for bad in [
        "ingest_cpus: '3-1'\n",
        "ingest_cpus: x\n",
        "ingest_cpus: ''\n",
        "ingest_cpus: 5000\n",
        "ingest_cpus: 'last:0'\n",
    ] {
        let err = Config::from_yaml(bad).unwrap_err().to_string();
        assert!(err.contains("ingest_cpus"), "{bad}: {err}");
    }
}

#[test]
fn an_endpoint_on_indexds_own_http_listener_is_refused() {
    for (yaml, endpoint, listen) in [
        (
            "http_listen: 127.0.0.1:9471\nendpoints:\n  - {address: 10.0.0.1:8000, model: m}\n  - {address: 127.0.0.1:9471, model: m}\n",
            "127.0.0.1:9471",
            "127.0.0.1:9471",
        ),
        // The default listener (127.0.0.1:9471), reached through 0.0.0.0.
        (
            "endpoints:\n  - {address: 0.0.0.0:9471, model: m, data_parallel_rank: 1}\n",
            "0.0.0.0:9471#1",
            "127.0.0.1:9471",
        ),
        // A wildcard listener takes loopback and the unspecified address.
        (
            "http_listen: 0.0.0.0:9471\nallow_unauthenticated: true\nendpoints:\n  - {address: 127.0.0.1:9471, model: m}\n",
            "127.0.0.1:9471",
            "0.0.0.0:9471",
        ),
        (
            "http_listen: '[::]:9471'\nallow_unauthenticated: true\nendpoints:\n  - {address: '[::1]:9471', model: m}\n",
            "[::1]:9471",
            "[::]:9471",
        ),
    ] {
        let err = Config::from_yaml(yaml).unwrap_err().to_string();
        assert!(
            err.contains("endpoints[") && err.contains(endpoint) && err.contains(listen),
            "{yaml}: {err}"
        );
        assert!(err.contains("own HTTP listener"), "{err}");
    }
    // The same port on another host, another port on loopback: fine.
    for ok in [
        "endpoints:\n  - {address: 10.0.0.1:9471, model: m}\n",
        "endpoints:\n  - {address: 127.0.0.1:9472, model: m}\n",
        "http_listen: 0.0.0.0:9471\nallow_unauthenticated: true\nendpoints:\n  - {address: '203.0.113.7:9471', model: m}\n",
    ] {
        Config::from_yaml(ok).unwrap();
    }
    // Built in code, checked by validate.
    let mut c = Config::new(vec![EndpointConfig::new(
        "127.0.0.1:9471".parse().unwrap(),
        "m",
    )]);
    let err = c.validate().unwrap_err().to_string();
    assert!(err.contains("endpoints[0].address"), "{err}");
    c.http_listen = "127.0.0.1:0".parse().unwrap();
    c.validate().unwrap();
}
