//! `tcp://host:port` endpoints: parsed once (config validation uses the same
//! parser), resolved at connect or bind time.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use super::ZmtpError;

/// A parsed `tcp://` endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    host: Host,
    port: u16,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Host {
    /// `*`: every IPv4 interface (bind only).
    Any,
    /// An address literal (`10.0.0.7`, `[::1]`).
    Ip(IpAddr),
    /// A name to resolve.
    Name(String),
}

/// Why an endpoint string was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    /// `ipc://`, `inproc://`, `udp://`, or no scheme.
    #[error("{0:?} is not a tcp:// endpoint (ipc, inproc and other transports are not supported)")]
    Scheme(String),
    /// No `:port`, or not a number in 0–65535.
    #[error("{0:?} needs a numeric :port")]
    Port(String),
    /// Nothing before the port.
    #[error("{0:?} names no host")]
    Host(String),
}

impl Endpoint {
    /// Parses `tcp://host:port`, `tcp://[v6]:port` or `tcp://*:port`.
    pub fn parse(text: &str) -> Result<Self, EndpointError> {
        let rest = text
            .strip_prefix("tcp://")
            .ok_or_else(|| EndpointError::Scheme(text.to_owned()))?;
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| EndpointError::Port(text.to_owned()))?;
        let port: u16 = port
            .parse()
            .map_err(|_| EndpointError::Port(text.to_owned()))?;
        let host = match host {
            "" => return Err(EndpointError::Host(text.to_owned())),
            "*" => Host::Any,
            h => {
                let literal = h.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
                match literal.unwrap_or(h).parse::<IpAddr>() {
                    Ok(ip) => Host::Ip(ip),
                    Err(_) if literal.is_some() || h.contains(['/', '[', ']', ' ']) => {
                        return Err(EndpointError::Host(text.to_owned()));
                    }
                    Err(_) => Host::Name(h.to_owned()),
                }
            }
        };
        Ok(Self { host, port })
    }

    /// True for `tcp://*:port` (only meaningful to bind).
    pub fn is_wildcard(&self) -> bool {
        self.host == Host::Any
    }

    /// The addresses to bind or connect to, in resolver order.
    pub async fn resolve(&self) -> Result<Vec<SocketAddr>, ZmtpError> {
        match &self.host {
            Host::Any => Ok(vec![SocketAddr::from((Ipv4Addr::UNSPECIFIED, self.port))]),
            Host::Ip(ip) => Ok(vec![SocketAddr::from((*ip, self.port))]),
            Host::Name(name) => {
                let addrs: Vec<SocketAddr> = tokio::net::lookup_host((name.as_str(), self.port))
                    .await
                    .map_err(|e| ZmtpError::Resolve {
                        endpoint: self.to_string(),
                        reason: e.to_string(),
                    })?
                    .collect();
                if addrs.is_empty() {
                    return Err(ZmtpError::Resolve {
                        endpoint: self.to_string(),
                        reason: "no addresses".into(),
                    });
                }
                Ok(addrs)
            }
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Host::Any => write!(f, "tcp://*:{}", self.port),
            Host::Ip(ip) => write!(f, "tcp://{}", SocketAddr::from((*ip, self.port))),
            Host::Name(name) => write!(f, "tcp://{name}:{}", self.port),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tcp_endpoints_only() {
        let e = Endpoint::parse("tcp://127.0.0.1:5557").unwrap();
        assert_eq!(e.to_string(), "tcp://127.0.0.1:5557");
        assert!(!e.is_wildcard());
        assert!(Endpoint::parse("tcp://*:5557").unwrap().is_wildcard());
        assert_eq!(
            Endpoint::parse("tcp://[::1]:9").unwrap().to_string(),
            "tcp://[::1]:9"
        );
        assert_eq!(
            Endpoint::parse("tcp://vllm-0.local:5557")
                .unwrap()
                .to_string(),
            "tcp://vllm-0.local:5557"
        );
        for (bad, what) in [
            ("ipc:///tmp/kv", "tcp://"),
            ("inproc://x", "tcp://"),
            ("127.0.0.1:5557", "tcp://"),
            ("tcp://127.0.0.1", "port"),
            ("tcp://host:99999", "port"),
            ("tcp://host:*", "port"),
            ("tcp://:5557", "host"),
            ("tcp://[nope]:1", "host"),
        ] {
            let err = Endpoint::parse(bad).unwrap_err().to_string();
            assert!(err.contains(what), "{bad}: {err}");
        }
    }

    #[tokio::test]
    async fn resolves_names_and_wildcards() {
        let any = Endpoint::parse("tcp://*:7")
            .unwrap()
            .resolve()
            .await
            .unwrap();
        assert_eq!(any, [SocketAddr::from(([0, 0, 0, 0], 7))]);
        let local = Endpoint::parse("tcp://localhost:7")
            .unwrap()
            .resolve()
            .await
            .unwrap();
        assert!(local.iter().all(|a| a.ip().is_loopback() && a.port() == 7));
    }
}
