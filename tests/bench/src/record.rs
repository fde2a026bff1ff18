//! What the overhead, soak and bodies runs share in their records: the two
//! profiles they set side by side and the run's `key,value` settings.

use serde::{Deserialize, Serialize};

/// The profile with Envoy, the kvroute filter and indexd (precise mode).
pub const KVROUTE: &str = "kvroute-precise";
/// The profile with Envoy alone (least-request, no filter).
pub const BASELINE: &str = "least-request";

/// One setting of the run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRow {
    /// The setting.
    pub key: String,
    /// Its value.
    pub value: String,
}

/// The settings a report quotes: the machine's cores and the build, then
/// `run`'s own, in order.
pub fn settings(run: impl IntoIterator<Item = (&'static str, String)>) -> Vec<RunRow> {
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    let build = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    [("cores", cores.to_string()), ("build", build.to_owned())]
        .into_iter()
        .chain(run)
        .map(|(key, value)| RunRow {
            key: key.to_owned(),
            value,
        })
        .collect()
}
