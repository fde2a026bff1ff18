//! A TCP relay whose client-to-server direction can be slowed down: stands
//! between Envoy and indexd to make indexd slow without touching it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;

use crate::HarnessError;

#[derive(Debug, Default)]
struct Faults {
    delay_ms: AtomicU64,
}

/// Controls of a running relay; the relay runs until its runtime stops.
#[derive(Debug, Clone)]
pub struct Relay {
    addr: SocketAddr,
    faults: Arc<Faults>,
}

impl Relay {
    /// Starts relaying `127.0.0.1:0` to `target` on `runtime`.
    pub fn start(runtime: &Runtime, target: SocketAddr) -> Result<Self, HarnessError> {
        let listener = runtime
            .block_on(TcpListener::bind("127.0.0.1:0"))
            .map_err(|e| HarnessError::io("bind relay", e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| HarnessError::io("relay address", e))?;
        let faults = Arc::new(Faults::default());
        let shared = Arc::clone(&faults);
        runtime.spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(relay(client, target, Arc::clone(&shared)));
            }
        });
        Ok(Self { addr, faults })
    }

    /// The address to connect to instead of the target.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Holds every client chunk this long before passing it on.
    pub fn set_delay(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.faults.delay_ms.store(ms, Ordering::Relaxed);
    }
}

async fn relay(mut client: TcpStream, target: SocketAddr, faults: Arc<Faults>) {
    let Ok(mut server) = TcpStream::connect(target).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.split();
    let (mut server_read, mut server_write) = server.split();
    let upstream = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let delay = faults.delay_ms.load(Ordering::Relaxed);
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            let Some(chunk) = buf.get(..n) else { return };
            if server_write.write_all(chunk).await.is_err() {
                return;
            }
        }
    };
    let downstream = tokio::io::copy(&mut server_read, &mut client_write);
    tokio::select! {
        () = upstream => {}
        _ = downstream => {}
    }
}
