//! What the open-loop senders share: a blocking HTTP agent sized to them
//! and whole microseconds for their rows.

use std::time::Duration;

/// A blocking agent with one idle connection kept per sender and host.
pub fn agent(timeout: Duration, senders: usize) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .max_idle_connections(senders * 4)
        .max_idle_connections_per_host(senders)
        .build()
        .into()
}

/// Whole microseconds (saturating).
pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
