//! The plugin configuration: JSON in, a validated [`Config`] out.
//!
//! Envoy hands the root context the `configuration` of the Wasm filter once;
//! [`Config::parse`] checks every field and names the offending one in its
//! error, and the root context returns `false` so that Envoy refuses the
//! listener instead of running a filter that silently does nothing.

use std::fmt;
use std::time::Duration;

use kvroute_proto::BlockSize;
use serde::Deserialize;

mod token;

pub use token::IndexToken;

/// Which OpenAI-compatible API a routed path speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `POST /v1/completions`: `prompt`.
    Completions,
    /// `POST /v1/chat/completions`: `messages`, `tools`, template options.
    Chat,
    /// `POST /v1/responses`: `input`, `instructions`, `tools`,
    /// `previous_response_id`.
    Responses,
    /// `POST /v1/messages` (Anthropic's Messages API): `system`, `messages`,
    /// `tools`, `tool_choice`, `thinking`. vLLM serves no tokenizer
    /// endpoint for these bodies, so the Pick carries the body and indexd
    /// tokenizes it (converting it to chat as vLLM does), whatever
    /// `tokenize_at` says.
    Messages,
}

/// Which tokenizer endpoint turns a request into the prompt's token ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerCall {
    /// vLLM's `POST /tokenize` (completions and chat bodies).
    Tokenize,
    /// vLLM's `POST /v1/…/render` (the request body as is; returns `token_ids`).
    Render,
}

/// Where a precise-mode request is tokenized.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizeAt {
    /// indexd: the Pick carries the body, and indexd tokenizes it (its own
    /// tokenizer, or a replica's when it has none for the model), keys and
    /// picks in one call.
    Indexd,
    /// The `tokenizer_cluster` (a vLLM replica or render sidecar), then a
    /// Pick with the keys: two calls.
    Cluster,
}

/// How block keys are derived.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Token ids from the tokenizer, keyed with `kvroute_proto::keys`.
    Precise,
    /// Raw request text chunks, no tokenizer call.
    Approximate,
}

/// One routed path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// The request path without query string, matched exactly.
    pub path: String,
    /// The API its bodies speak.
    pub api: Api,
    /// The tokenizer endpoint kind.
    pub call: TokenizerCall,
    /// The `:path` of the tokenizer call.
    pub tokenizer_path: String,
}

/// Circuit-breaker thresholds (shared by all workers of one VM).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive index failures that open the breaker.
    pub failures: u32,
    /// Failures further apart than this do not add up.
    pub window_ms: u64,
    /// How long the breaker stays open.
    pub cooldown_ms: u64,
    /// While open, one request per this many ms still calls the peer (0:
    /// none).
    pub probe_ms: u64,
}

/// The validated configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Where precise-mode requests are tokenized.
    pub tokenize_at: TokenizeAt,
    /// Envoy cluster of the tokenizer (a vLLM replica or render sidecar);
    /// empty unless `tokenize_at` is `cluster`.
    pub tokenizer_cluster: String,
    /// `:authority` of tokenizer calls.
    pub tokenizer_authority: String,
    /// Envoy cluster (HTTP/2) of indexd.
    pub index_cluster: String,
    /// Timeout of the tokenizer call.
    pub tokenizer_timeout: Duration,
    /// Timeout of the Pick and Observe calls.
    pub index_timeout: Duration,
    /// Routed paths.
    pub routes: Vec<Route>,
    /// vLLM's `--block-size`.
    pub block_size: BlockSize,
    /// Bodies larger than this are not buffered (reason `body_too_large`).
    pub max_body_bytes: usize,
    /// Largest tokenizer answer read.
    pub max_tokenizer_response_bytes: usize,
    /// Request header carrying the ordered override host list.
    pub override_header: String,
    /// Request header carrying the data-parallel rank.
    pub rank_header: String,
    /// Response header carrying the reason label, if enabled.
    pub decision_header: Option<String>,
    /// Index breaker thresholds.
    pub breaker: BreakerConfig,
    /// Tokenizer breaker thresholds.
    pub tokenizer_breaker: BreakerConfig,
    /// Most block keys sent in one Pick (the prompt's first ones); must not
    /// exceed indexd's `max_pick_keys`.
    pub max_pick_keys: usize,
    /// Key derivation mode.
    pub mode: Mode,
    /// Bytes per text chunk in approximate mode.
    pub approximate_chunk_bytes: BlockSize,
    /// Model name used when a body has no `model`.
    pub model_fallback: Option<String>,
    /// Upper bound on candidates asked of indexd (0: indexd's default).
    pub max_candidates: u32,
    /// Whether to send Observe calls.
    pub observe: bool,
    /// Whether to remember where conversations went, for when indexd cannot
    /// answer.
    pub remember: bool,
    /// Turns in a row a continuation may be sent where its previous turn
    /// went, from the memory alone, before one asks indexd again (0: every
    /// request asks indexd). Needs `remember`.
    pub local_continuations: u32,
    /// How old indexd's latest answer on the replicas' load may be for a
    /// continuation to follow its previous turn without a Pick ([`busy`]).
    ///
    /// [`busy`]: crate::busy
    pub continuation_load: Duration,
    /// How much of a Responses answer is scanned for its id.
    pub response_scan_bytes: usize,
    /// The shared token indexd requires, if it requires one.
    pub index_token: Option<IndexToken>,
}

/// A configuration error naming its field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The field (JSON path), or `configuration` for the document itself.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

impl ConfigError {
    fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    tokenize_at: Option<TokenizeAt>,
    tokenizer_cluster: Option<String>,
    tokenizer_authority: Option<String>,
    index_cluster: Option<String>,
    tokenizer_timeout_ms: Option<u64>,
    index_timeout_ms: Option<u64>,
    routes: Option<Vec<RawRoute>>,
    block_size: Option<u32>,
    max_body_bytes: Option<u64>,
    max_tokenizer_response_bytes: Option<u64>,
    override_header: Option<String>,
    rank_header: Option<String>,
    decision_header: Option<String>,
    breaker: Option<RawBreaker>,
    tokenizer_breaker: Option<RawBreaker>,
    max_pick_keys: Option<u64>,
    mode: Option<Mode>,
    approximate_chunk_bytes: Option<u32>,
    model_fallback: Option<String>,
    max_candidates: Option<u32>,
    observe: Option<bool>,
    remember: Option<bool>,
    local_continuations: Option<u32>,
    continuation_load_ms: Option<u64>,
    response_scan_bytes: Option<u64>,
    index_token: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    path: String,
    api: Api,
    tokenizer: Option<TokenizerCall>,
    tokenizer_path: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawBreaker {
    failures: Option<u32>,
    window_ms: Option<u64>,
    cooldown_ms: Option<u64>,
    probe_ms: Option<u64>,
}

/// Defaults, also quoted in the README.
pub mod defaults {
    /// `tokenizer_timeout_ms`.
    pub const TOKENIZER_TIMEOUT_MS: u64 = 500;
    /// `index_timeout_ms`.
    pub const INDEX_TIMEOUT_MS: u64 = 50;
    /// `block_size`.
    pub const BLOCK_SIZE: u32 = 64;
    /// `max_body_bytes`: below Envoy's default 1 MiB buffer limit by more
    /// than one read chunk.
    pub const MAX_BODY_BYTES: u64 = 960 * 1024;
    /// `max_tokenizer_response_bytes`.
    pub const MAX_TOKENIZER_RESPONSE_BYTES: u64 = 8 * 1024 * 1024;
    /// `override_header`.
    pub const OVERRIDE_HEADER: &str = "x-gateway-destination-endpoint";
    /// `rank_header`.
    pub const RANK_HEADER: &str = "x-data-parallel-rank";
    /// `breaker.failures`.
    pub const BREAKER_FAILURES: u32 = 5;
    /// `breaker.window_ms`.
    pub const BREAKER_WINDOW_MS: u64 = 10_000;
    /// `breaker.cooldown_ms`.
    pub const BREAKER_COOLDOWN_MS: u64 = 5_000;
    /// `breaker.probe_ms`.
    pub const BREAKER_PROBE_MS: u64 = 250;
    /// `approximate_chunk_bytes`.
    pub const APPROXIMATE_CHUNK_BYTES: u32 = 256;
    /// `response_scan_bytes`.
    pub const RESPONSE_SCAN_BYTES: u64 = 64 * 1024;
    /// `continuation_load_ms`: indexd's default scrape interval (the load it
    /// saw cannot be more current than that).
    pub const CONTINUATION_LOAD_MS: u64 = 1_000;
    /// `max_pick_keys`: indexd's default.
    pub const MAX_PICK_KEYS: u64 = 65_536;
}

/// Upper bound on `max_pick_keys`.
const MAX_PICK_KEYS_LIMIT: u64 = 1 << 20;

/// Upper bound on any timeout, so a typo cannot pause requests for hours.
const MAX_TIMEOUT_MS: u64 = 60_000;
/// Upper bound on buffered sizes (Envoy would refuse larger buffers anyway).
const MAX_BYTES: u64 = 256 * 1024 * 1024;

impl Config {
    /// Parses and validates the plugin configuration.
    pub fn parse(bytes: &[u8]) -> Result<Self, ConfigError> {
        let raw: RawConfig = if bytes.iter().all(u8::is_ascii_whitespace) {
            RawConfig::default()
        } else {
            serde_json::from_slice(bytes)
                .map_err(|e| ConfigError::new("configuration", e.to_string()))?
        };
        Self::validate(raw)
    }

    fn validate(raw: RawConfig) -> Result<Self, ConfigError> {
        let mode = raw.mode.unwrap_or(Mode::Precise);
        let index_cluster = required_name("index_cluster", raw.index_cluster)?;
        // A tokenizer cluster alone means the two-call path, as before
        // indexd tokenized.
        let tokenize_at = raw
            .tokenize_at
            .unwrap_or(if raw.tokenizer_cluster.is_some() {
                TokenizeAt::Cluster
            } else {
                TokenizeAt::Indexd
            });
        let tokenizer_cluster = match (mode, tokenize_at, raw.tokenizer_cluster) {
            (_, _, Some(name)) => non_empty("tokenizer_cluster", name)?,
            (Mode::Precise, TokenizeAt::Cluster, None) => {
                return Err(ConfigError::new(
                    "tokenizer_cluster",
                    "required when tokenize_at is `cluster`",
                ));
            }
            _ => String::new(),
        };
        let tokenizer_authority = match raw.tokenizer_authority {
            Some(a) => non_empty("tokenizer_authority", a)?,
            None => tokenizer_cluster.clone(),
        };
        let tokenizer_timeout = timeout(
            "tokenizer_timeout_ms",
            raw.tokenizer_timeout_ms,
            defaults::TOKENIZER_TIMEOUT_MS,
        )?;
        let index_timeout = timeout(
            "index_timeout_ms",
            raw.index_timeout_ms,
            defaults::INDEX_TIMEOUT_MS,
        )?;
        let routes = match raw.routes {
            None => default_routes(),
            Some(list) => routes(list)?,
        };
        let block_size = parse_block_size("block_size", raw.block_size, defaults::BLOCK_SIZE)?;
        let approximate_chunk_bytes = parse_block_size(
            "approximate_chunk_bytes",
            raw.approximate_chunk_bytes,
            defaults::APPROXIMATE_CHUNK_BYTES,
        )?;
        let max_body_bytes = bytes(
            "max_body_bytes",
            raw.max_body_bytes,
            defaults::MAX_BODY_BYTES,
        )?;
        let max_tokenizer_response_bytes = bytes(
            "max_tokenizer_response_bytes",
            raw.max_tokenizer_response_bytes,
            defaults::MAX_TOKENIZER_RESPONSE_BYTES,
        )?;
        let response_scan_bytes = bytes(
            "response_scan_bytes",
            raw.response_scan_bytes,
            defaults::RESPONSE_SCAN_BYTES,
        )?;
        let remember = raw.remember.unwrap_or(true);
        let local_continuations = raw.local_continuations.unwrap_or(0);
        if local_continuations > 0 && !remember {
            return Err(ConfigError::new(
                "local_continuations",
                "needs \"remember\": the memory is where a continuation's previous turn went",
            ));
        }
        let continuation_load = timeout(
            "continuation_load_ms",
            raw.continuation_load_ms,
            defaults::CONTINUATION_LOAD_MS,
        )?;
        let override_header = header_name(
            "override_header",
            raw.override_header,
            defaults::OVERRIDE_HEADER,
        )?;
        let rank_header = header_name("rank_header", raw.rank_header, defaults::RANK_HEADER)?;
        if rank_header == override_header {
            return Err(ConfigError::new(
                "rank_header",
                "must differ from override_header",
            ));
        }
        let decision_header = match raw.decision_header {
            None => None,
            Some(name) => Some(header_name("decision_header", Some(name), "")?),
        };
        let breaker = breaker_config("breaker", raw.breaker.unwrap_or_default())?;
        let tokenizer_breaker = breaker_config(
            "tokenizer_breaker",
            raw.tokenizer_breaker.unwrap_or_default(),
        )?;
        let max_pick_keys = raw.max_pick_keys.unwrap_or(defaults::MAX_PICK_KEYS);
        if max_pick_keys == 0 || max_pick_keys > MAX_PICK_KEYS_LIMIT {
            return Err(ConfigError::new(
                "max_pick_keys",
                format!("must be between 1 and {MAX_PICK_KEYS_LIMIT}, got {max_pick_keys}"),
            ));
        }
        let max_pick_keys = usize::try_from(max_pick_keys)
            .map_err(|_| ConfigError::new("max_pick_keys", "too large for this platform"))?;
        let model_fallback = match raw.model_fallback {
            None => None,
            Some(m) => Some(non_empty("model_fallback", m)?),
        };
        Ok(Self {
            tokenize_at,
            tokenizer_cluster,
            tokenizer_authority,
            index_cluster,
            tokenizer_timeout,
            index_timeout,
            routes,
            block_size,
            max_body_bytes,
            max_tokenizer_response_bytes,
            override_header,
            rank_header,
            decision_header,
            breaker,
            tokenizer_breaker,
            max_pick_keys,
            mode,
            approximate_chunk_bytes,
            model_fallback,
            max_candidates: raw.max_candidates.unwrap_or(0),
            observe: raw.observe.unwrap_or(true),
            remember,
            local_continuations,
            continuation_load,
            response_scan_bytes,
            index_token: raw.index_token.map(token::parse).transpose()?,
        })
    }

    /// The initial metadata of every call to indexd: its token, if any.
    pub fn index_metadata(&self) -> Vec<(&'static str, &[u8])> {
        let token = self.index_token.as_ref();
        token
            .map(|t| ("authorization", t.authorization().as_bytes()))
            .into_iter()
            .collect()
    }

    /// The route for a request path (query string ignored), if routed.
    pub fn route(&self, path: &str) -> Option<&Route> {
        let path = path.split(['?', '#']).next().unwrap_or(path);
        self.routes.iter().find(|r| r.path == path)
    }
}

fn required_name(field: &str, value: Option<String>) -> Result<String, ConfigError> {
    match value {
        Some(v) => non_empty(field, v),
        None => Err(ConfigError::new(field, "required")),
    }
}

fn non_empty(field: &str, value: String) -> Result<String, ConfigError> {
    if value.trim().is_empty() {
        Err(ConfigError::new(field, "must not be empty"))
    } else if value.chars().any(char::is_control) {
        Err(ConfigError::new(
            field,
            "must not contain control characters",
        ))
    } else {
        Ok(value)
    }
}

fn timeout(field: &str, value: Option<u64>, default: u64) -> Result<Duration, ConfigError> {
    let ms = value.unwrap_or(default);
    if ms == 0 || ms > MAX_TIMEOUT_MS {
        return Err(ConfigError::new(
            field,
            format!("must be between 1 and {MAX_TIMEOUT_MS} ms, got {ms}"),
        ));
    }
    Ok(Duration::from_millis(ms))
}

fn parse_block_size(
    field: &str,
    value: Option<u32>,
    default: u32,
) -> Result<BlockSize, ConfigError> {
    let n = value.unwrap_or(default);
    match BlockSize::new(n) {
        Some(bs) if n <= 1 << 16 => Ok(bs),
        _ => Err(ConfigError::new(
            field,
            format!("must be between 1 and 65536, got {n}"),
        )),
    }
}

fn bytes(field: &str, value: Option<u64>, default: u64) -> Result<usize, ConfigError> {
    let n = value.unwrap_or(default);
    if n == 0 || n > MAX_BYTES {
        return Err(ConfigError::new(
            field,
            format!("must be between 1 and {MAX_BYTES}, got {n}"),
        ));
    }
    usize::try_from(n).map_err(|_| ConfigError::new(field, "too large for this platform"))
}

fn header_name(field: &str, value: Option<String>, default: &str) -> Result<String, ConfigError> {
    let name = value.unwrap_or_else(|| default.to_owned());
    let valid = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if valid {
        Ok(name)
    } else {
        Err(ConfigError::new(
            field,
            format!("must be a lower-case header name (a-z, 0-9, '-', '_'), got {name:?}"),
        ))
    }
}

fn breaker_config(field: &str, raw: RawBreaker) -> Result<BreakerConfig, ConfigError> {
    let at_least_one =
        |name: &str| ConfigError::new(format!("{field}.{name}"), "must be at least 1");
    let failures = raw.failures.unwrap_or(defaults::BREAKER_FAILURES);
    if failures == 0 {
        return Err(at_least_one("failures"));
    }
    let window_ms = raw.window_ms.unwrap_or(defaults::BREAKER_WINDOW_MS);
    if window_ms == 0 {
        return Err(at_least_one("window_ms"));
    }
    let cooldown_ms = raw.cooldown_ms.unwrap_or(defaults::BREAKER_COOLDOWN_MS);
    if cooldown_ms == 0 {
        return Err(at_least_one("cooldown_ms"));
    }
    let probe_ms = raw.probe_ms.unwrap_or(defaults::BREAKER_PROBE_MS);
    Ok(BreakerConfig {
        failures,
        window_ms,
        cooldown_ms,
        probe_ms,
    })
}

/// The tokenizer path vLLM serves for an API and call kind.
fn default_tokenizer_path(api: Api, call: TokenizerCall) -> &'static str {
    match (call, api) {
        (TokenizerCall::Tokenize, _) => "/tokenize",
        (TokenizerCall::Render, Api::Completions) => "/v1/completions/render",
        (TokenizerCall::Render, Api::Chat) => "/v1/chat/completions/render",
        (TokenizerCall::Render, Api::Responses) => "/v1/responses/render",
        // Never called: indexd tokenizes Messages bodies ([`Api::Messages`]).
        (TokenizerCall::Render, Api::Messages) => "/v1/messages",
    }
}

fn default_call(api: Api) -> TokenizerCall {
    match api {
        Api::Completions | Api::Chat => TokenizerCall::Tokenize,
        Api::Responses | Api::Messages => TokenizerCall::Render,
    }
}

fn default_routes() -> Vec<Route> {
    [
        ("/v1/completions", Api::Completions),
        ("/v1/chat/completions", Api::Chat),
        ("/v1/responses", Api::Responses),
        ("/v1/messages", Api::Messages),
    ]
    .into_iter()
    .map(|(path, api)| {
        let call = default_call(api);
        Route {
            path: path.to_owned(),
            api,
            call,
            tokenizer_path: default_tokenizer_path(api, call).to_owned(),
        }
    })
    .collect()
}

fn routes(list: Vec<RawRoute>) -> Result<Vec<Route>, ConfigError> {
    if list.is_empty() {
        return Err(ConfigError::new("routes", "must name at least one path"));
    }
    let mut out: Vec<Route> = Vec::with_capacity(list.len());
    for (i, raw) in list.into_iter().enumerate() {
        let field = |name: &str| format!("routes[{i}].{name}");
        if !raw.path.starts_with('/') || raw.path.contains(['?', '#']) {
            return Err(ConfigError::new(
                field("path"),
                "must start with '/' and carry no query",
            ));
        }
        if out.iter().any(|r| r.path == raw.path) {
            return Err(ConfigError::new(field("path"), "duplicate path"));
        }
        if raw.api == Api::Messages && (raw.tokenizer.is_some() || raw.tokenizer_path.is_some()) {
            return Err(ConfigError::new(
                field("tokenizer"),
                "messages bodies are tokenized by indexd (vLLM serves no tokenizer endpoint for \
                 them): leave `tokenizer` and `tokenizer_path` out",
            ));
        }
        let call = raw.tokenizer.unwrap_or_else(|| default_call(raw.api));
        if raw.api == Api::Responses && call == TokenizerCall::Tokenize {
            return Err(ConfigError::new(
                field("tokenizer"),
                "responses bodies need `render` (/tokenize rejects them)",
            ));
        }
        let tokenizer_path = match raw.tokenizer_path {
            Some(p) if p.starts_with('/') && !p.chars().any(char::is_control) => p,
            Some(_) => {
                return Err(ConfigError::new(
                    field("tokenizer_path"),
                    "must start with '/'",
                ));
            }
            None => default_tokenizer_path(raw.api, call).to_owned(),
        };
        out.push(Route {
            path: raw.path,
            api: raw.api,
            call,
            tokenizer_path,
        });
    }
    Ok(out)
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
