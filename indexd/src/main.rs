//! The `indexd` binary: flags and/or a YAML file → [`indexd::Config`] → serve
//! until SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;
use tokio_util::sync::CancellationToken;

/// mimalloc: the local tokenizer allocates and frees many short strings and
/// maps per request, where glibc's malloc spends a third of a continuation's
/// time (tokenizer/BENCHMARKS.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Node-local KV-cache index daemon for the kvroute filter.
#[derive(Debug, Parser)]
#[command(name = "indexd", version, about)]
struct Args {
    /// YAML config file (see indexd/README.md for the format; Kubernetes
    /// discovery is its `kubernetes:` section).
    #[arg(short, long, env = "INDEXD_CONFIG")]
    config: Option<PathBuf>,
    /// gRPC listen address, ip:port or unix:///path/to/socket (overrides the
    /// file).
    #[arg(long)]
    grpc_listen: Option<indexd::ListenAddr>,
    /// HTTP listen address for /metrics, /healthz, /readyz (overrides the file).
    #[arg(long)]
    http_listen: Option<SocketAddr>,
    /// A file holding the shared token every call must carry as
    /// `authorization: Bearer <token>` (overrides the file).
    #[arg(long)]
    auth_token_file: Option<PathBuf>,
    /// Serve on non-loopback TCP addresses without a token.
    #[arg(long)]
    allow_unauthenticated: bool,
    /// Tokens per block (vLLM --block-size; overrides the file).
    #[arg(long)]
    block_size: Option<u32>,
    /// Discovery file with an `endpoints:` list (overrides the file).
    #[arg(long)]
    discovery_file: Option<PathBuf>,
    /// An endpoint as a YAML flow mapping (repeatable), added to the file's:
    /// '{address: 10.0.0.7:8000, model: m, events: tcp://10.0.0.7:5557, replay: tcp://10.0.0.7:5558, metrics_url: http://10.0.0.7:8000/metrics}'
    #[arg(long = "endpoint", value_name = "YAML")]
    endpoints: Vec<String>,
    /// Kubernetes discovery: watch this Service's EndpointSlices (and its
    /// pods' kvroute.io/* annotations); overrides the file's `kubernetes:`
    /// source. Ports, ranks and the rest: the file's `kubernetes:` section.
    #[arg(long, value_name = "NAME")]
    kubernetes_service: Option<String>,
    /// Kubernetes discovery: watch pods matching this label selector (with
    /// --kubernetes-service: only these pods' annotations are read).
    #[arg(long, value_name = "SELECTOR")]
    kubernetes_pod_selector: Option<String>,
    /// The namespace to watch (default: indexd's own, from its service
    /// account; or the kubeconfig's).
    #[arg(long, value_name = "NS")]
    kubernetes_namespace: Option<String>,
    /// The model of pods without a kvroute.io/model annotation.
    #[arg(long, value_name = "MODEL")]
    kubernetes_model: Option<String>,
    /// Talk to this API server URL without credentials (e.g. a `kubectl
    /// proxy`); default: the pod's service account, else $KUBECONFIG.
    #[arg(long, value_name = "URL")]
    kubernetes_api_server: Option<String>,
    /// Seed for tie-breaking (reproducible test runs; leave unset in a fleet
    /// with several indexd, or they all break ties the same way).
    #[arg(long)]
    seed: Option<u64>,
    /// A local tokenizer (repeatable): the model name requests carry, and a
    /// directory with its tokenizer.json, tokenizer_config.json and chat
    /// template (added to the file's `tokenize.tokenizers`).
    #[arg(long = "tokenizer", value_name = "NAME=DIR")]
    tokenizers: Vec<String>,
    /// Run the ingest runtime on these CPUs (a cpuset list such as 1 or 2-3,
    /// or last / last:N of the process's own CPUs), one worker thread each,
    /// and every other thread on the rest (Linux; overrides the file's
    /// `ingest_cpus`).
    #[arg(long, value_name = "LIST")]
    ingest_cpus: Option<indexd::cpus::CpuSpec>,
    /// Once listening, print {"grpc":"ip:port","http":"ip:port"} on stdout
    /// (grpc is "unix:///path" on a socket).
    #[arg(long)]
    print_addresses: bool,
}

fn config(args: &Args) -> anyhow::Result<indexd::Config> {
    let mut c = match &args.config {
        // Host names in endpoint addresses are resolved once, here.
        Some(path) => indexd::Config::from_file_with(path, &indexd::config::SystemResolve)?,
        None => indexd::Config::new(Vec::new()),
    };
    if let Some(a) = &args.grpc_listen {
        c.grpc_listen = a.clone();
    }
    if let Some(p) = &args.auth_token_file {
        c.access.auth_token_file = Some(p.clone());
    }
    if args.allow_unauthenticated {
        c.access.allow_unauthenticated = true;
    }
    if let Some(a) = args.http_listen {
        c.http_listen = a;
    }
    if let Some(b) = args.block_size {
        c.block_size = kvroute_proto::BlockSize::new(b).context("--block-size must be positive")?;
    }
    if let Some(p) = &args.discovery_file {
        c.discovery_file = Some(p.clone());
    }
    if let Some(cpus) = &args.ingest_cpus {
        c.ingest_cpus = Some(cpus.clone());
    }
    kubernetes_flags(args, &mut c)?;
    for text in &args.endpoints {
        c.endpoints.push(indexd::config::parse_endpoint_with(
            text,
            &indexd::config::SystemResolve,
        )?);
    }
    if args.seed.is_some() {
        c.seed = args.seed;
    }
    for text in &args.tokenizers {
        c.tokenize
            .tokenizers
            .push(indexd::config::tokenize::parse_flag(text)?);
    }
    c.validate()?;
    Ok(c)
}

/// The `--kubernetes-*` flags over the file's `kubernetes:` section.
fn kubernetes_flags(args: &Args, c: &mut indexd::Config) -> anyhow::Result<()> {
    use indexd::KubernetesConfig;
    use indexd::config::kubernetes::KubeSource;
    let source = match (&args.kubernetes_service, &args.kubernetes_pod_selector) {
        (Some(name), pods) => Some(KubeSource::Service {
            name: name.clone(),
            pods: pods.clone(),
        }),
        (None, Some(selector)) => Some(KubeSource::Pods {
            selector: selector.clone(),
        }),
        (None, None) => None,
    };
    if let Some(source) = source {
        let k = c
            .kubernetes
            .get_or_insert_with(|| KubernetesConfig::service(String::new()));
        k.source = source;
    }
    let rest = [
        &args.kubernetes_namespace,
        &args.kubernetes_model,
        &args.kubernetes_api_server,
    ];
    let Some(k) = c.kubernetes.as_mut() else {
        anyhow::ensure!(
            rest.iter().all(|v| v.is_none()),
            "--kubernetes-namespace, --kubernetes-model and --kubernetes-api-server need \
             --kubernetes-service or --kubernetes-pod-selector (or the file's kubernetes: section)"
        );
        return Ok(());
    };
    if let Some(ns) = &args.kubernetes_namespace {
        k.namespace = Some(ns.clone());
    }
    if let Some(m) = &args.kubernetes_model {
        k.model = Some(m.clone());
    }
    if let Some(url) = &args.kubernetes_api_server {
        k.api_server = Some(url.clone());
    }
    Ok(())
}

async fn run(config: indexd::Config, print_addresses: bool) -> anyhow::Result<()> {
    let bound = indexd::Server::bind(config).await?;
    tracing::info!(grpc = %bound.grpc_addr(), http = %bound.http_addr(), "indexd listening");
    if print_addresses {
        println!(
            "{}",
            serde_json::json!({"grpc": bound.grpc_addr().to_string(), "http": bound.http_addr().to_string()})
        );
    }
    let shutdown = CancellationToken::new();
    let signal = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutting down");
        signal.cancel();
    });
    bound.serve(shutdown).await?;
    Ok(())
}

/// The configuration, the request path placed (`ingest_cpus`: this thread,
/// and so the runtime built next, on the other CPUs), the request runtime.
fn start(args: &Args) -> anyhow::Result<(indexd::Config, tokio::runtime::Runtime)> {
    let mut config = config(args)?;
    if let Some(ingest) = &config.ingest_cpus {
        let placement = indexd::cpus::pin_request_side(ingest).map_err(anyhow::Error::msg)?;
        tracing::info!(ingest = %placement.ingest, request = %placement.request, "CPU placement");
        // Resolved here, against the whole process's CPUs.
        config.ingest_cpus = Some(indexd::cpus::CpuSpec::List(placement.ingest));
    }
    // Its worker count follows the CPUs this thread may use.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the request runtime")?;
    Ok((config, rt))
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

fn main() -> ExitCode {
    let pages = indexd::without_huge_pages();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = pages {
        tracing::debug!(error = %e, "transparent huge pages left as they were");
    }
    let args = Args::parse();
    let result =
        start(&args).and_then(|(config, rt)| rt.block_on(run(config, args.print_addresses)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("indexd: {e:#}");
            ExitCode::FAILURE
        }
    }
}
