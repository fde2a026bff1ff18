//! Where the gRPC listener listens, and the life of its socket file.
//!
//! [`ListenAddr`] is `ip:port` or a Unix domain socket path
//! (`unix:///run/kvroute/indexd.sock`). A socket file is created with mode
//! 0660: the owner (indexd's user) and its group may connect, nobody else
//! (the directory's permissions gate it too). At start a leftover socket
//! file is removed, but only if it is a socket that nothing serves; any
//! other file at the path, or a socket another process still serves, stops
//! indexd from starting. The file is unlinked when indexd stops, if it is
//! still the one this process created.

use std::fmt;
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use tokio::net::{TcpListener, UnixListener};

use crate::error::StartError;

/// The longest socket path (`sun_path` holds 108 bytes with its NUL).
pub const MAX_SOCKET_PATH_BYTES: usize = 107;

/// The socket file's mode: owner and group may connect.
pub const SOCKET_MODE: u32 = 0o660;

/// A listen address: TCP or a Unix domain socket.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ListenAddr {
    /// `ip:port` (port 0 picks one).
    Tcp(SocketAddr),
    /// A socket file (`unix:///abs/path` or `unix:relative/path`).
    Unix(PathBuf),
}

/// A listen address that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseListenAddrError(String);

impl ListenAddr {
    /// The TCP address, if this is one.
    pub fn tcp(&self) -> Option<SocketAddr> {
        match self {
            Self::Tcp(a) => Some(*a),
            Self::Unix(_) => None,
        }
    }

    /// The socket path, if this is one.
    pub fn unix_path(&self) -> Option<&Path> {
        match self {
            Self::Tcp(_) => None,
            Self::Unix(p) => Some(p),
        }
    }

    /// True when only this host can reach it: a socket file, or a loopback
    /// IP address.
    pub fn is_node_local(&self) -> bool {
        match self {
            Self::Tcp(a) => a.ip().is_loopback(),
            Self::Unix(_) => true,
        }
    }

    /// The URI a tonic client connects to: `http://ip:port` or
    /// `unix:///path`.
    pub fn grpc_uri(&self) -> String {
        match self {
            Self::Tcp(a) => format!("http://{a}"),
            Self::Unix(_) => self.to_string(),
        }
    }
}

impl From<SocketAddr> for ListenAddr {
    fn from(a: SocketAddr) -> Self {
        Self::Tcp(a)
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp(a) => write!(f, "{a}"),
            Self::Unix(p) if p.is_absolute() => write!(f, "unix://{}", p.display()),
            Self::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

impl FromStr for ListenAddr {
    type Err = ParseListenAddrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let Some(rest) = s.strip_prefix("unix:") else {
            return s.parse().map(Self::Tcp).map_err(|_| {
                ParseListenAddrError(format!(
                    "{s:?} is neither ip:port nor unix:///path/to/socket"
                ))
            });
        };
        let path = rest.strip_prefix("//").unwrap_or(rest);
        if path.is_empty() {
            return Err(ParseListenAddrError(format!("{s:?} names no socket path")));
        }
        if path.starts_with('@') || path.contains('\0') {
            return Err(ParseListenAddrError(format!(
                "{s:?}: abstract sockets are not supported, name a file"
            )));
        }
        if path.len() > MAX_SOCKET_PATH_BYTES {
            return Err(ParseListenAddrError(format!(
                "{s:?}: a socket path holds at most {MAX_SOCKET_PATH_BYTES} bytes"
            )));
        }
        if path.ends_with('/') {
            return Err(ParseListenAddrError(format!(
                "{s:?} names a directory, not a socket file"
            )));
        }
        Ok(Self::Unix(PathBuf::from(path)))
    }
}

/// The bound gRPC listener.
#[derive(Debug)]
pub(crate) enum GrpcListener {
    /// On TCP.
    Tcp(TcpListener),
    /// On a socket file, unlinked when the guard drops.
    Unix(UnixListener, SocketFile),
}

/// Binds `addr`; returns the listener and the address actually bound (the
/// TCP port resolved).
pub(crate) async fn bind_grpc(addr: &ListenAddr) -> Result<(GrpcListener, ListenAddr), StartError> {
    let err = |source: std::io::Error| StartError::Bind {
        what: "grpc",
        addr: addr.to_string(),
        source,
    };
    match addr {
        ListenAddr::Tcp(a) => {
            let l = TcpListener::bind(a).await.map_err(err)?;
            let bound = l.local_addr().map_err(err)?;
            Ok((GrpcListener::Tcp(l), ListenAddr::Tcp(bound)))
        }
        ListenAddr::Unix(path) => {
            clear_stale(path).await.map_err(err)?;
            let l = UnixListener::bind(path).map_err(err)?;
            // Owned from here on: a failure below unlinks it again.
            let file = SocketFile::created(path).map_err(err)?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(SOCKET_MODE))
                .map_err(err)?;
            Ok((GrpcListener::Unix(l, file), addr.clone()))
        }
    }
}

/// Removes a socket file nothing serves; refuses any other file, and a
/// socket another process still accepts on.
async fn clear_stale(path: &Path) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_socket() {
        return Err(Error::new(
            ErrorKind::AlreadyExists,
            "the path exists and is not a socket: remove it or choose another",
        ));
    }
    if tokio::net::UnixStream::connect(path).await.is_ok() {
        return Err(Error::new(
            ErrorKind::AddrInUse,
            "another process serves this socket",
        ));
    }
    tracing::info!(path = %path.display(), "removing a stale socket file");
    std::fs::remove_file(path)
}

/// A socket file this process created: unlinked on drop, unless another
/// file has replaced it since (same device and inode, still a socket).
#[derive(Debug)]
pub(crate) struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl SocketFile {
    fn created(path: &Path) -> std::io::Result<Self> {
        let meta = std::fs::symlink_metadata(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let ours = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|m| m.file_type().is_socket() && m.dev() == self.dev && m.ino() == self.ino);
        if ours && let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot remove the socket file");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_both_kinds() {
        let tcp: ListenAddr = "127.0.0.1:50061".parse().unwrap();
        assert_eq!(tcp.tcp(), Some(SocketAddr::from(([127, 0, 0, 1], 50061))));
        assert!(tcp.is_node_local());
        assert_eq!(tcp.grpc_uri(), "http://127.0.0.1:50061");
        let any: ListenAddr = "0.0.0.0:50061".parse().unwrap();
        assert!(!any.is_node_local());
        let unix: ListenAddr = "unix:///run/kvroute/indexd.sock".parse().unwrap();
        assert_eq!(
            unix.unix_path(),
            Some(Path::new("/run/kvroute/indexd.sock"))
        );
        assert!(unix.is_node_local());
        assert_eq!(unix.to_string(), "unix:///run/kvroute/indexd.sock");
        assert_eq!(unix.grpc_uri(), "unix:///run/kvroute/indexd.sock");
        let relative: ListenAddr = "unix:run/indexd.sock".parse().unwrap();
        assert_eq!(relative.to_string(), "unix:run/indexd.sock");
        for bad in [
            "unix://",
            "unix:",
            "unix:@abstract",
            "unix:///run/kvroute/",
            "localhost:50061",
            "tcp://127.0.0.1:1",
        ] {
            assert!(bad.parse::<ListenAddr>().is_err(), "{bad}");
        }
        let long = format!("unix:///{}", "x".repeat(MAX_SOCKET_PATH_BYTES));
        assert!(long.parse::<ListenAddr>().is_err());
    }

    #[tokio::test]
    async fn binds_with_mode_0660_replaces_stale_sockets_and_unlinks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("indexd.sock");
        let addr = ListenAddr::Unix(path.clone());
        let (listener, bound) = bind_grpc(&addr).await.unwrap();
        assert_eq!(bound, addr);
        let meta = std::fs::metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, SOCKET_MODE);
        // A second indexd on the same socket refuses: the first serves it.
        let err = bind_grpc(&addr).await.unwrap_err().to_string();
        assert!(err.contains("another process serves"), "{err}");
        // Stopping unlinks it.
        drop(listener);
        assert!(!path.exists());

        // A socket left behind by a crash (nothing accepts) is replaced.
        let stale = std::os::unix::net::UnixListener::bind(&path).unwrap();
        drop(stale);
        assert!(path.exists());
        let (listener, _) = bind_grpc(&addr).await.unwrap();
        drop(listener);
        assert!(!path.exists());

        // Anything else at the path is left alone.
        std::fs::write(&path, b"not a socket").unwrap();
        let err = bind_grpc(&addr).await.unwrap_err().to_string();
        assert!(err.contains("not a socket"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
    }
}
