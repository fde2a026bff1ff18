//! The daemon as a whole: [`Server::bind`] validates the configuration and
//! binds the listeners, [`Bound::serve`] runs every task until shutdown, and
//! a [`Handle`] looks at the running state (tests, embedding).

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;

use crate::auth::Token;
use crate::config::{Config, EndpointConfig};
use crate::cpus::{CpuList, CpuSpec};
use crate::error::StartError;
use crate::ids::EndpointId;
use crate::listen::{self, GrpcListener, ListenAddr};
use crate::server::IndexService;
use crate::state::Shared;
use crate::tokenize::{self, Tokenizers};
use crate::{discovery, http, kubernetes, snapshot};

/// The gRPC server's HTTP/2 stream window: the body bytes a Pick may send
/// before indexd acknowledges them.
const GRPC_STREAM_WINDOW: u32 = 1 << 20;
/// The connection's window: several Picks' bodies in flight on one
/// connection (Envoy multiplexes a worker's Picks on one).
const GRPC_CONNECTION_WINDOW: u32 = 4 << 20;

/// Entry point for starting indexd.
#[derive(Debug)]
pub struct Server;

impl Server {
    /// Validates `config`, reads the token file and binds both listeners;
    /// nothing runs yet.
    pub async fn bind(config: Config) -> Result<Bound, StartError> {
        config.validate()?;
        let token = config
            .access
            .auth_token_file
            .as_deref()
            .map(Token::load)
            .transpose()?;
        let (grpc, grpc_addr) = listen::bind_grpc(&config.grpc_listen).await?;
        let http_err = |source| StartError::Bind {
            what: "http",
            addr: config.http_listen.to_string(),
            source,
        };
        let http = TcpListener::bind(config.http_listen)
            .await
            .map_err(http_err)?;
        let http_addr = http.local_addr().map_err(http_err)?;
        // Again with the port bound (`http_listen` may have said 0).
        crate::config::refuse_own_listener(&config.endpoints, http_addr, "endpoints")?;
        if token.is_none() && !grpc_addr.is_node_local() {
            tracing::warn!(grpc = %grpc_addr, "gRPC serves beyond loopback without a token (allow_unauthenticated)");
        }
        let tokenizers = Tokenizers::load(config.tokenize.clone())?;
        // The client is set up (credentials read) now, so that a missing
        // service account stops the start; the watch starts with `serve`.
        let kubernetes = match &config.kubernetes {
            Some(k) => Some(kubernetes::Connection::new(k).await?),
            None => None,
        };
        let stop = CancellationToken::new();
        let shared = Arc::new(
            Shared::new(config, stop.clone())
                .with_tokenizers(tokenizers)
                .with_token(token),
        );
        let _ = shared.http_addr.set(http_addr);
        let ingest = IngestRuntime::start(
            shared.config.ingest_nice,
            shared.config.ingest_cpus.as_ref(),
        )?;
        if let Some(rt) = &ingest.0 {
            let _ = shared.ingest.set(rt.handle().clone());
        }
        // A snapshot's replicas are restored as they are registered.
        snapshot::load(shared.as_ref());
        // Static endpoints are known (and visible through the handle) from
        // here on; their tasks start with `serve`.
        for endpoint in shared.config.endpoints.clone() {
            shared.add_replica(endpoint);
        }
        if shared.config.discovery_file.is_none() && shared.config.kubernetes.is_none() {
            // No other endpoint will come from the snapshot's era.
            shared.snapshots.forget_unrestored();
        }
        Ok(Bound {
            grpc,
            http,
            grpc_addr,
            http_addr,
            shared,
            stop,
            kubernetes,
            _ingest: ingest,
        })
    }
}

/// The subscriptions' own runtime. Without `ingest_cpus`: one worker thread
/// less than the CPUs (at least one), so that decoding a flood of events
/// leaves a CPU to the request path, and only that many writers take the
/// index lock at once. With it: one worker per CPU listed, each pinned to
/// those CPUs as it starts (the binary keeps its other threads off them,
/// [`crate::cpus`]). Its threads run `nice` steps nicer than the process
/// (Linux) when configured (`ingest_nice`). Shut down (without blocking)
/// when dropped.
#[derive(Debug)]
struct IngestRuntime(Option<tokio::runtime::Runtime>);

impl IngestRuntime {
    fn start(nice: u8, cpus: Option<&CpuSpec>) -> Result<Self, StartError> {
        let cpus: Option<CpuList> = match cpus {
            None => None,
            Some(spec) => Some(
                crate::cpus::allowed()
                    .map_err(|e| e.to_string())
                    .and_then(|allowed| spec.resolve(&allowed))
                    .map_err(|reason| StartError::Placement { reason })?,
            ),
        };
        let workers = match &cpus {
            Some(list) => list.len(),
            None => std::thread::available_parallelism()
                .map_or(1, std::num::NonZero::get)
                .saturating_sub(1),
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers.max(1))
            .thread_name("indexd-ingest")
            .on_thread_start(move || {
                if let Some(list) = &cpus
                    && let Err(e) = crate::cpus::pin_current_thread(list)
                {
                    tracing::warn!(error = %e, cpus = %list, "could not pin an ingest thread (ingest_cpus)");
                }
                be_nicer(nice);
            })
            .enable_all()
            .build()
            .map_err(|source| StartError::Runtime { source })?;
        Ok(Self(Some(rt)))
    }
}

/// Turns transparent huge pages off for this process, unless
/// `MIMALLOC_ALLOW_THP` is set (then mimalloc's own option decides). mimalloc
/// asks the kernel for huge pages on its arenas (`madvise`), and the index is
/// read and written at random across them: at 1 M entries RSS grew by 95 B
/// per entry with them and 73.5 B without, at the same ingest and Pick speed
/// (indexd/BENCHMARKS.md). Call it first thing in `main`, before the index
/// allocates; an error (not Linux, or a kernel without the setting) is
/// returned for the caller to log, and the process runs on as it was.
pub fn without_huge_pages() -> std::io::Result<()> {
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_some() {
        return Ok(());
    }
    #[cfg(target_os = "linux")]
    {
        rustix::thread::disable_transparent_huge_pages(true).map_err(std::io::Error::from)
    }
    #[cfg(not(target_os = "linux"))]
    {
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "transparent huge pages are a Linux setting",
        ))
    }
}

/// Makes the calling thread `by` steps nicer (Linux keeps a nice value per
/// thread). Raising one's own nice value needs no privilege; a failure is
/// logged and the thread runs on as it was.
#[cfg(target_os = "linux")]
fn be_nicer(by: u8) {
    use rustix::process::{getpriority_process, setpriority_process};
    if by == 0 {
        return;
    }
    let tid = rustix::thread::gettid();
    let result = getpriority_process(Some(tid))
        .and_then(|now| setpriority_process(Some(tid), now.saturating_add(i32::from(by)).min(19)));
    if let Err(e) = result {
        tracing::warn!(error = %e, "could not lower the ingest thread's priority (ingest_nice)");
    }
}

#[cfg(not(target_os = "linux"))]
fn be_nicer(_by: u8) {}

impl Drop for IngestRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Listeners bound, ready to serve.
#[derive(Debug)]
pub struct Bound {
    grpc: GrpcListener,
    http: TcpListener,
    grpc_addr: ListenAddr,
    http_addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
    kubernetes: Option<kubernetes::Connection>,
    _ingest: IngestRuntime,
}

impl Bound {
    /// The gRPC address actually bound (a TCP port 0 resolved); its
    /// [`ListenAddr::grpc_uri`] is what a tonic client connects to.
    pub fn grpc_addr(&self) -> ListenAddr {
        self.grpc_addr.clone()
    }

    /// The HTTP address actually bound.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// A handle on the state, for tests and embedding.
    pub fn handle(&self) -> Handle {
        Handle {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Starts the endpoint tasks and serves gRPC and HTTP until `shutdown`
    /// fires; then stops every task and returns.
    pub async fn serve(self, shutdown: CancellationToken) -> Result<(), StartError> {
        let Self {
            grpc,
            http,
            shared,
            stop,
            kubernetes,
            ..
        } = self;
        for replica in crate::sync::read(&shared.registry).all() {
            discovery::spawn_tasks(&shared, replica);
        }
        shared.tasks.spawn(snapshot::run(Arc::clone(&shared)));
        if let Some(path) = shared.config.discovery_file.clone() {
            shared
                .tasks
                .spawn(discovery::watch(Arc::clone(&shared), path));
        }
        if let (Some(connection), Some(config)) = (kubernetes, shared.config.kubernetes.clone()) {
            shared
                .tasks
                .spawn(kubernetes::watch(Arc::clone(&shared), connection, config));
        }
        let models: Vec<String> = shared.tokenizers.locals().map(|(m, _)| m.clone()).collect();
        for model in models {
            shared.tasks.spawn(tokenize::probe::run(
                Arc::clone(&shared.tokenizers),
                Arc::clone(&shared) as Arc<dyn tokenize::Replicas>,
                shared.shutdown.clone(),
                model,
            ));
        }
        // Either server stopping (shutdown, or an error) stops the other.
        let local = shutdown.child_token();
        let grpc_stop = local.clone();
        let grpc_service = IndexService::new(Arc::clone(&shared)).into_server();
        let grpc_done = local.clone();
        let grpc_fut = async move {
            // Flow-control windows sized for Picks that carry bodies: with
            // HTTP/2's 64 KiB default a megabyte body takes sixteen window
            // updates, each a wake-up of the sender, and on a node of few
            // CPUs those wake-ups delay every other Pick.
            let router = tonic::transport::Server::builder()
                .initial_stream_window_size(Some(GRPC_STREAM_WINDOW))
                .initial_connection_window_size(Some(GRPC_CONNECTION_WINDOW))
                .add_service(grpc_service);
            let stopped = async move { grpc_stop.cancelled().await };
            let r = match grpc {
                GrpcListener::Tcp(l) => {
                    let incoming =
                        tonic::transport::server::TcpIncoming::from(l).with_nodelay(Some(true));
                    router.serve_with_incoming_shutdown(incoming, stopped).await
                }
                GrpcListener::Unix(l, socket_file) => {
                    let r = router
                        .serve_with_incoming_shutdown(UnixListenerStream::new(l), stopped)
                        .await;
                    // No new connection can arrive: the socket file goes.
                    drop(socket_file);
                    r
                }
            };
            grpc_done.cancel();
            r
        };
        let http_stop = local.clone();
        let http_done = local.clone();
        let http_router = http::router(Arc::clone(&shared));
        let http_shared = Arc::clone(&shared);
        let http_fut = async move {
            http::serve::serve(http, http_router, http_shared, http_stop).await;
            http_done.cancel();
        };
        let (g, ()) = tokio::join!(grpc_fut, http_fut);
        // Stop every subscription, scrape and watch, and wait for them (a
        // scrape in flight ends within its timeout).
        stop.cancel();
        shared.tasks.close();
        let grace = shared.config.scrape_timeout + std::time::Duration::from_secs(1);
        if tokio::time::timeout(grace, shared.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!("some background tasks did not stop in time");
        }
        // Every subscription has stopped: the index is still.
        snapshot::write_now(&shared).await;
        g.map_err(|e| StartError::Serve {
            what: "grpc",
            reason: e.to_string(),
        })?;
        Ok(())
    }
}

/// Binds and serves until `shutdown` fires.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), StartError> {
    Server::bind(config).await?.serve(shutdown).await
}

/// A read-mostly view of a running indexd.
#[derive(Debug, Clone)]
pub struct Handle {
    shared: Arc<Shared>,
}

/// One replica as seen through a [`Handle`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaStatus {
    /// Subscribed with no unrecovered gap.
    pub fresh: bool,
    /// Scrapes succeed (or none configured).
    pub healthy: bool,
    /// Blocks indexed for it.
    pub entries: usize,
}

impl Handle {
    /// The shared state (advanced use).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The Prometheus page.
    pub fn metrics_text(&self) -> String {
        http::render(&self.shared)
    }

    /// The status of one replica.
    pub fn replica(&self, id: &EndpointId) -> Option<ReplicaStatus> {
        let r = crate::sync::read(&self.shared.registry).get(id)?;
        let entries = self.shared.index.replica_entries(r.slot);
        Some(ReplicaStatus {
            fresh: r.is_fresh(),
            healthy: r.is_healthy(),
            entries,
        })
    }

    /// Adds an endpoint at runtime (as discovery does); false if it is
    /// known already or is indexd's own HTTP listener (refused).
    pub fn add_endpoint(&self, config: EndpointConfig) -> bool {
        discovery::start_endpoint(&self.shared, config)
    }

    /// Removes an endpoint at runtime.
    pub fn remove_endpoint(&self, id: &EndpointId) -> bool {
        self.shared.remove_replica(id)
    }
}

#[cfg(test)]
#[cfg(target_os = "linux")]
mod tests {
    use super::{CpuSpec, IngestRuntime};
    use rustix::process::getpriority_process;

    fn own_nice() -> i32 {
        getpriority_process(Some(rustix::thread::gettid())).unwrap()
    }

    #[test]
    fn ingest_threads_run_nicer_than_the_request_path() {
        let here = own_nice();
        let rt = IngestRuntime::start(5, None).unwrap();
        let there =
            rt.0.as_ref()
                .unwrap()
                .block_on(async { tokio::spawn(async { own_nice() }).await.unwrap() });
        assert_eq!(there, (here + 5).min(19));
        assert_eq!(own_nice(), here, "the calling thread kept its priority");
        let same = IngestRuntime::start(0, None).unwrap();
        let there = same
            .0
            .as_ref()
            .unwrap()
            .block_on(async { tokio::spawn(async { own_nice() }).await.unwrap() });
        assert_eq!(there, here);
    }

    #[test]
    fn ingest_threads_run_on_the_cpus_named_one_worker_each() {
        let allowed = crate::cpus::allowed().unwrap();
        let last = crate::cpus::CpuList::new(vec![*allowed.cpus().last().unwrap()]).unwrap();
        let rt = IngestRuntime::start(0, Some(&CpuSpec::List(last.clone()))).unwrap();
        let rt = rt.0.as_ref().unwrap();
        assert_eq!(rt.metrics().num_workers(), 1);
        let there = rt.block_on(async {
            tokio::spawn(async { crate::cpus::allowed().unwrap() })
                .await
                .unwrap()
        });
        assert_eq!(there, last);
        assert_eq!(
            crate::cpus::allowed().unwrap(),
            allowed,
            "the caller is not moved"
        );
    }
}
