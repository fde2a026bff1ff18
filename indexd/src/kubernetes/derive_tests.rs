use super::*;
use crate::config::kubernetes::{IpFamily, KubernetesConfig};

const SLICE: &str = include_str!("../../tests/fixtures/kubernetes/endpointslice-vllm-llama.json");
const POD: &str = include_str!("../../tests/fixtures/kubernetes/pod-vllm-llama.json");

fn slice() -> EndpointSlice {
    serde_json::from_str(SLICE).unwrap()
}

fn pod() -> Pod {
    serde_json::from_str(POD).unwrap()
}

fn named_ports(mut c: KubernetesConfig) -> KubernetesConfig {
    c.port = PortRef::Name("http".into());
    c.events_port = PortRef::Name("kv-events".into());
    c.replay_port = PortRef::Name("kv-replay".into());
    c
}

fn endpoint(ip: &str, rank: Option<u32>, events: u16, replay: u16, model: &str) -> EndpointConfig {
    let address: SocketAddr = format!("{ip}:8000").parse().unwrap();
    let mut e = EndpointConfig::new(address, model);
    e.id.rank = rank;
    e.events = Some(format!("tcp://{ip}:{events}"));
    e.replay = Some(format!("tcp://{ip}:{replay}"));
    e.metrics_url = HttpUrl::parse(&format!("http://{ip}:8000/metrics"));
    e
}

#[test]
fn ready_slice_endpoints_become_endpoints_and_the_rest_do_not() {
    let mut c = named_ports(KubernetesConfig::service("vllm-llama"));
    c.model = Some("llama".into());
    let s = slice();
    let d = from_slices(&c, [&s], None);
    // Ready, and `conditions: {}` (a nil ready reads as true); the
    // terminating and the unready endpoints are left out silently.
    assert_eq!(
        d.endpoints,
        [
            endpoint("10.244.1.17", None, 5557, 5558, "llama"),
            endpoint("10.244.3.22", None, 5557, 5558, "llama"),
        ]
    );
    assert!(d.skipped.is_empty(), "{:?}", d.skipped);
    // Numbers instead of names give the same ports.
    let mut numbers = KubernetesConfig::service("vllm-llama");
    numbers.model = Some("llama".into());
    assert_eq!(from_slices(&numbers, [&s], None), d);
}

#[test]
fn pod_annotations_name_the_model_adapters_and_ranks() {
    let c = named_ports(KubernetesConfig::service("vllm-llama"));
    let (s, p) = (slice(), pod());
    let pods = BTreeMap::from([(p.metadata.name.clone().unwrap(), &p)]);
    let d = from_slices(&c, [&s], Some(&pods));
    let mut rank0 = endpoint("10.244.1.17", Some(0), 5557, 5558, "llama");
    rank0.adapters = vec!["sql-lora".into(), "chat-lora".into()];
    let mut rank1 = endpoint("10.244.1.17", Some(1), 5558, 5559, "llama");
    rank1.adapters = rank0.adapters.clone();
    assert_eq!(d.endpoints, [rank0.clone(), rank1.clone()]);
    // The second ready endpoint's pod is not among the watched pods.
    assert_eq!(d.skipped.len(), 1);
    assert_eq!(d.skipped[0].0, "pod/vllm-llama-6c9f7d8b5-p5r2t");
    assert!(d.skipped[0].1.contains("not known"), "{:?}", d.skipped);

    // The same pod watched directly: the same endpoints.
    let by_pods = from_pods(&named_ports(KubernetesConfig::pods("app=vllm")), [&p]);
    assert_eq!(by_pods.endpoints, [rank0, rank1]);
    assert!(by_pods.skipped.is_empty());
}

#[test]
fn config_defaults_apply_where_annotations_are_missing() {
    let mut p = pod();
    p.metadata.annotations = None;
    let mut c = KubernetesConfig::pods("app=vllm");
    assert_eq!(from_pods(&c, [&p]).endpoints, []);
    let skipped = from_pods(&c, [&p]).skipped;
    assert!(skipped[0].1.contains("no model"), "{skipped:?}");
    c.model = Some("m".into());
    c.adapters = vec!["a".into()];
    c.ranks = Some(vec![2]);
    let d = from_pods(&c, [&p]);
    let mut want = endpoint("10.244.1.17", Some(2), 5559, 5560, "m");
    want.adapters = vec!["a".into()];
    assert_eq!(d.endpoints, [want]);
}

#[test]
fn pods_that_do_not_serve_are_left_out() {
    let c = KubernetesConfig::pods("app=vllm");
    let unready = {
        let mut p = pod();
        for cond in p.status.as_mut().unwrap().conditions.as_mut().unwrap() {
            if cond.type_ == "Ready" {
                cond.status = "False".into();
            }
        }
        p
    };
    let deleting = {
        let mut p = pod();
        p.metadata.deletion_timestamp = serde_json::from_str("\"2026-05-28T11:00:00Z\"").unwrap();
        p
    };
    let pending = {
        let mut p = pod();
        p.status.as_mut().unwrap().phase = Some("Pending".into());
        p
    };
    let no_ip = {
        let mut p = pod();
        p.status.as_mut().unwrap().pod_ip = None;
        p
    };
    for p in [unready, deleting, pending, no_ip] {
        assert_eq!(from_pods(&c, [&p]), Derived::default());
    }
}

#[test]
fn bad_annotations_and_missing_ports_skip_the_address_with_a_reason() {
    type Change = Box<dyn Fn(&mut Pod, &mut KubernetesConfig)>;
    let cases: [(&str, Change); 5] = [
        (
            RANKS_ANNOTATION,
            Box::new(|p, _| {
                annotate(p, RANKS_ANNOTATION, "two");
            }),
        ),
        (
            RANKS_ANNOTATION,
            Box::new(|p, _| annotate(p, RANKS_ANNOTATION, "0-100000")),
        ),
        (
            MODEL_ANNOTATION,
            Box::new(|p, _| annotate(p, MODEL_ANNOTATION, " ")),
        ),
        (
            "kubernetes.replay_port",
            Box::new(|_, c| c.replay_port = PortRef::Name("replay".into())),
        ),
        (
            "65535",
            Box::new(|_, c| c.events_port = PortRef::Number(65535)),
        ),
    ];
    for (expect, change) in cases {
        let mut p = pod();
        let mut c = named_ports(KubernetesConfig::pods("app=vllm"));
        change(&mut p, &mut c);
        let d = from_pods(&c, [&p]);
        assert_eq!(d.endpoints, [], "{expect}");
        assert_eq!(d.skipped.len(), 1, "{expect}");
        assert!(d.skipped[0].1.contains(expect), "{expect}: {:?}", d.skipped);
    }
}

fn annotate(p: &mut Pod, key: &str, value: &str) {
    p.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(key.into(), value.into());
}

#[test]
fn address_families_and_fqdn_slices() {
    let mut c = KubernetesConfig::service("vllm-llama");
    c.model = Some("m".into());
    let mut v6 = slice();
    v6.address_type = "IPv6".into();
    v6.endpoints.truncate(1);
    v6.endpoints[0].addresses = vec!["fd00:10:244::11".into()];
    let d = from_slices(&c, [&v6], None);
    assert_eq!(d.endpoints.len(), 1);
    let e = &d.endpoints[0];
    assert_eq!(e.id.address.to_string(), "[fd00:10:244::11]:8000");
    assert_eq!(e.events.as_deref(), Some("tcp://[fd00:10:244::11]:5557"));
    assert_eq!(
        e.metrics_url.as_ref().map(ToString::to_string).as_deref(),
        Some("http://[fd00:10:244::11]:8000/metrics")
    );
    crate::config::validate_endpoints(&d.endpoints, "k").unwrap();
    c.ip_family = Some(IpFamily::IPv4);
    assert_eq!(from_slices(&c, [&v6], None), Derived::default());
    let mut fqdn = slice();
    fqdn.address_type = "FQDN".into();
    fqdn.endpoints.truncate(1);
    fqdn.endpoints[0].addresses = vec!["vllm-0.example".into()];
    assert_eq!(from_slices(&c, [&fqdn], None), Derived::default());
}

#[test]
fn capacity_urls_follow_the_pod_ip() {
    let mut c = KubernetesConfig::pods("app=vllm");
    c.capacity = Some((PortRef::Number(9000), "/capacity".into()));
    let d = from_pods(&c, [&pod()]);
    assert_eq!(
        d.endpoints[0].capacity_url,
        HttpUrl::parse("http://10.244.1.17:9000/capacity")
    );
}
