//! vLLM-exact tokenization for routing: `/tokenize` and
//! `/v1/responses/render` answered as vLLM 0.32 answers them, from a model
//! directory, at a cost proportional to what is new in a request.
//!
//! - [`Tokenizer`] (`tokenizer`): one model; loads a directory, serves the
//!   two endpoints, reports [`Stats`].
//! - `protocol`: the request and answer shapes ([`TokenizeRequest`],
//!   [`TokenizeResponse`], [`ResponsesRequest`], [`RenderResponse`],
//!   [`MessagesRequest`]).
//! - `chat`, `responses`, `messages`, `render`: vLLM's chat preprocessing,
//!   its Responses → chat and Anthropic Messages → chat conversions, and
//!   transformers' `apply_chat_template`; `responses_input`: the validation
//!   of Responses input items (the openai SDK's item types, as pydantic
//!   checks them for vLLM).
//! - `template`: chat templates as transformers' Jinja environment runs them
//!   ([`ChatTemplate`], [`ContentFormat`]); `pystr`: Python 3.11's Unicode
//!   string functions for them (`upper`, `lower`, `title`, `strip`, …), from
//!   tables read off Python itself; `generation`: transformers'
//!   `{% generation %}` tag as a scope.
//! - `budget`: what one request may cost ([`Budget`], [`Caps`]) and the ids
//!   it gets ([`Tokens`]): the `*_with` entry points of [`Tokenizer`].
//! - `encode`, `split`, `segment`, `cache`, `pretok`: text → ids as
//!   `tokenizers` encodes them, split on added tokens, cut at proven-safe
//!   boundaries, cached per segment, split regexes run in the `regex` crate
//!   ([`Encoder`], [`Boundaries`], [`CacheStats`]).
//! - `model`: reading `tokenizer.json`, `tokenizer_config.json`,
//!   `chat_template.jinja` and `config.json`.
//! - `loads`, `json`, `value`, `clock`: request JSON read as Python's
//!   `json.loads` reads it, Python's `json.dumps` and `str()`, ordered
//!   values, and `strftime_now`.
//! - `error`: [`LoadError`] and [`RequestError`].
#![deny(clippy::indexing_slicing)]

mod budget;
mod cache;
mod chat;
mod clock;
mod encode;
mod error;
mod generation;
mod json;
mod loads;
mod messages;
mod model;
mod pretok;
mod protocol;
mod pystr;
mod render;
mod responses;
mod responses_input;
mod segment;
mod split;
mod template;
mod tokenizer;
mod value;

pub use budget::{Budget, Caps, Tokens};
pub use cache::CacheStats;
pub use encode::{Encoder, EncoderStats, Mode, Truncation};
pub use error::{Cap, InexactKind, LoadError, RequestError};
pub use loads::MAX_DEPTH;
pub use messages::MessagesConversion;
pub use protocol::{
    MessagesRequest, RenderResponse, ResponsesRequest, SamplingParams, TokenizeRequest,
    TokenizeResponse, earlier_role, output_item,
};
pub use segment::{Analysis, Boundaries, SEGMENT_BYTES};
pub use template::{ChatTemplate, ContentFormat};
pub use tokenizer::{LoadOptions, SharedTokenizer, Stats, Tokenizer};
