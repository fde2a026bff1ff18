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
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
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

/// True when a TCP connection to `target` would reach a listener bound to
/// `listen`: indexd refuses an endpoint whose address is its own HTTP
/// listener, where a tokenize request it forwards would come back to it.
///
/// Caught: the same `ip:port`; a `target` on the unspecified address
/// (`0.0.0.0:P`, `[::]:P`: Linux connects those to loopback) when `listen` is
/// loopback or a wildcard; and, when `listen` is a wildcard (`0.0.0.0:P`
/// takes IPv4, `[::]:P` both families, as Linux binds it by default), any
/// loopback `target` with port P and any other whose address `is_local`
/// says is this host's ([`is_local_ip`]: one of its interfaces'
/// addresses). IPv4-mapped IPv6 addresses count as their IPv4 address. Not
/// caught: a name or address that reaches this host another way (a NAT or
/// port forward, a Service's cluster IP or a load balancer in front of
/// indexd, a proxy), an IPv6 link-local address (binding it needs a scope),
/// and anything while the port is 0 (not bound yet: indexd checks again with
/// the port it got).
pub fn reaches(listen: SocketAddr, target: SocketAddr, is_local: &dyn Fn(IpAddr) -> bool) -> bool {
    if listen.port() == 0 || target.port() != listen.port() {
        return false;
    }
    let listen_ip = listen.ip().to_canonical();
    let mut target_ip = target.ip().to_canonical();
    if target_ip.is_unspecified() {
        target_ip = match target_ip {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        };
    }
    if target_ip == listen_ip {
        return true;
    }
    let family = match listen_ip {
        IpAddr::V4(a) if a.is_unspecified() => target_ip.is_ipv4(),
        IpAddr::V6(a) if a.is_unspecified() => true,
        _ => return false,
    };
    family && (target_ip.is_loopback() || is_local(target_ip))
}

/// True when `ip` is one of this host's own addresses (in indexd's network
/// namespace): a UDP socket can be bound to it. No packet is sent. Loopback
/// and unspecified addresses are, multicast ones are not asked; with
/// `net.ipv4.ip_nonlocal_bind` (or its IPv6 twin) set, every address would
/// look local, so [`reaches`] only asks about addresses on its own listener's
/// port.
pub fn is_local_ip(ip: IpAddr) -> bool {
    if ip.is_loopback() || ip.is_unspecified() {
        return true;
    }
    if ip.is_multicast() {
        return false;
    }
    std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
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

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn an_endpoint_on_the_own_listener_is_recognised() {
        // This "host" owns 10.0.0.5 and fd00::5 besides loopback.
        let local = |ip: IpAddr| {
            ip == IpAddr::from([10, 0, 0, 5]) || ip == "fd00::5".parse::<IpAddr>().unwrap()
        };
        let yes = [
            ("127.0.0.1:9471", "127.0.0.1:9471"),
            ("127.0.0.1:9471", "0.0.0.0:9471"),
            ("127.0.0.1:9471", "[::ffff:127.0.0.1]:9471"),
            ("[::1]:9471", "[::1]:9471"),
            ("[::1]:9471", "[::]:9471"),
            ("10.0.0.5:9471", "10.0.0.5:9471"),
            ("0.0.0.0:9471", "127.0.0.1:9471"),
            ("0.0.0.0:9471", "127.0.0.2:9471"),
            ("0.0.0.0:9471", "0.0.0.0:9471"),
            ("0.0.0.0:9471", "10.0.0.5:9471"),
            ("[::]:9471", "127.0.0.1:9471"),
            ("[::]:9471", "[::1]:9471"),
            ("[::]:9471", "10.0.0.5:9471"),
            ("[::]:9471", "[fd00::5]:9471"),
            ("[::]:9471", "[::]:9471"),
        ];
        for (listen, target) in yes {
            assert!(
                reaches(addr(listen), addr(target), &local),
                "{listen} {target}"
            );
        }
        let no = [
            // Another port, another host, another loopback address than
            // the one bound, a family a v4 wildcard does not take.
            ("127.0.0.1:9471", "127.0.0.1:8000"),
            ("0.0.0.0:9471", "10.0.0.6:9471"),
            ("127.0.0.1:9471", "127.0.0.2:9471"),
            ("127.0.0.1:9471", "10.0.0.5:9471"),
            ("0.0.0.0:9471", "[::1]:9471"),
            ("0.0.0.0:9471", "[fd00::5]:9471"),
            ("[::1]:9471", "127.0.0.1:9471"),
            // Not bound yet.
            ("127.0.0.1:0", "127.0.0.1:0"),
        ];
        for (listen, target) in no {
            assert!(
                !reaches(addr(listen), addr(target), &local),
                "{listen} {target}"
            );
        }
    }

    #[test]
    fn local_addresses_are_those_a_socket_binds() {
        assert!(is_local_ip(IpAddr::from([127, 0, 0, 1])));
        assert!(is_local_ip(IpAddr::from([0, 0, 0, 0])));
        // TEST-NET-3 (RFC 5737): never assigned to a host.
        assert!(!is_local_ip(IpAddr::from([203, 0, 113, 77])));
        assert!(!is_local_ip(IpAddr::from([224, 0, 0, 1])));
        // An address this host does have: the one it connects out from.
        let probe = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        if probe.connect("192.0.2.1:9").is_ok() {
            let own = probe.local_addr().unwrap().ip();
            assert!(is_local_ip(own), "{own}");
        }
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
