//! A body's ids from the local tokenizer ([`local_ids`]) within its
//! [`Limits`] (the caller's cancel, the time budget, the token cap), and
//! what a body tells besides, read without the tokenizer ([`head_of`]): its
//! `cache_salt`, and whether it continues a conversation.

use std::time::Instant;

use kvroute_proto::turns;
use kvroute_tokenizer::{MessagesRequest, ResponsesRequest, TokenizeRequest, Tokenizer};
use serde_json::value::RawValue;

use super::{Api, Cancel, TokenizeError};

/// What bounds one body's local tokenization.
#[derive(Clone, Debug, Default)]
pub struct Limits {
    /// Set once the caller has gone away.
    pub cancel: Cancel,
    /// When to give up.
    pub deadline: Option<Instant>,
    /// Encoding stops once this many ids exist.
    pub max_tokens: Option<usize>,
}

/// A body's ids from the local tokenizer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalIds {
    /// The ids: all of them, or the first [`Limits::max_tokens`].
    pub ids: Vec<u32>,
    /// Encoding stopped at [`Limits::max_tokens`].
    pub truncated: bool,
    /// The request's `cache_salt`, and whether it continues a conversation
    /// (read from the request the tokenizer parsed).
    pub head: Head,
}

impl Limits {
    /// No bounds (the probe set, tests).
    pub fn none() -> Self {
        Self::default()
    }

    /// The tokenizer's budget for a request salted `salt`: these bounds,
    /// the model's caps, and the salt's cache namespace (a hash; 0 without
    /// a salt), so that text one tenant sent is no faster for another.
    pub fn budget(&self, tokenizer: &Tokenizer, salt: Option<&str>) -> kvroute_tokenizer::Budget {
        kvroute_tokenizer::Budget {
            max_tokens: self.max_tokens,
            deadline: self.deadline,
            cancelled: Some(self.cancel.flag().clone()),
            namespace: salt.map_or(0, |s| body_hash(s.as_bytes()) | 1),
            caps: tokenizer.caps(),
        }
    }

    /// Whether the work should stop now.
    fn check(&self) -> Result<(), TokenizeError> {
        if self.cancel.is_cancelled() {
            return Err(TokenizeError::Cancelled);
        }
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(TokenizeError::OverBudget(
                "tokenize.time_budget passed".to_owned(),
            ));
        }
        Ok(())
    }
}

/// The tokenizer's error as indexd's: what vLLM refuses is refused, a
/// local refusal asks a replica, over a cap or the time budget is over
/// budget.
pub(crate) fn from_request_error(e: kvroute_tokenizer::RequestError) -> TokenizeError {
    use kvroute_tokenizer::RequestError as E;
    match e {
        E::Cancelled => TokenizeError::Cancelled,
        E::OverCap { .. } | E::DeadlineExceeded => TokenizeError::OverBudget(e.to_string()),
        e if e.is_client_error() => TokenizeError::Refused {
            status: 400,
            message: e.to_string(),
        },
        e => TokenizeError::Unsupported(e.to_string()),
    }
}

/// A body's hash (telling distinct bodies apart in the gate's window).
pub(crate) fn body_hash(body: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    body.hash(&mut h);
    h.finish()
}

/// The ids `tokenizer` computes for a body of `api`, within `limits`: the
/// body is parsed once (and no further than the tokenizer's text cap), its
/// salt read from it.
pub fn local_ids(
    tokenizer: &Tokenizer,
    api: Api,
    body: &[u8],
    limits: &Limits,
) -> Result<LocalIds, TokenizeError> {
    limits.check()?;
    let refused = from_request_error;
    let caps = tokenizer.caps();
    let (tokens, salt, continuation) = match api {
        Api::Completions | Api::Chat => {
            let req = TokenizeRequest::from_json_within(body, &caps).map_err(refused)?;
            let salt = valid_salt(req.cache_salt().map_err(refused)?)?;
            let budget = limits.budget(tokenizer, salt.as_deref());
            let tokens = if api == Api::Chat {
                // What the chat completion itself renders (`/tokenize`
                // ignores the few fields only chat completions hand the
                // template).
                tokenizer.chat_completion_tokens_with(&req, &budget)
            } else {
                tokenizer.completion_tokens_with(&req, &budget)
            };
            (
                tokens.map_err(refused)?,
                salt,
                req.continues_a_conversation(),
            )
        }
        Api::Messages => {
            let req = MessagesRequest::from_json_within(body, &caps).map_err(refused)?;
            let salt = valid_salt(req.cache_salt().map_err(refused)?)?;
            let budget = limits.budget(tokenizer, salt.as_deref());
            let tokens = tokenizer
                .tokenize_messages_with(&req, &budget)
                .map_err(refused)?;
            (tokens, salt, req.continues_a_conversation())
        }
        Api::Responses => {
            let req = ResponsesRequest::from_json_within(body, &caps).map_err(refused)?;
            let salt = valid_salt(req.cache_salt().map_err(refused)?)?;
            let budget = limits.budget(tokenizer, salt.as_deref());
            let tokens = tokenizer
                .responses_tokens_with(&req, &budget)
                .map_err(refused)?;
            (tokens, salt, req.continues_a_conversation())
        }
    };
    Ok(LocalIds {
        ids: tokens.ids,
        truncated: tokens.truncated,
        head: Head { salt, continuation },
    })
}

/// What a body tells without the tokenizer ([`head_of`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Head {
    /// Its `cache_salt`, valid by vLLM's rules.
    pub salt: Option<String>,
    /// `Some(true)` if it carries an earlier turn of its conversation (a
    /// chat or Messages body's assistant or tool message, a Responses
    /// body's `previous_response_id` or output item), `Some(false)` if it
    /// is a conversation's first turn, `None` if it does not tell (a
    /// completions prompt), as
    /// [`kvroute_tokenizer::TokenizeRequest::continues_a_conversation`].
    pub continuation: Option<bool>,
}

/// The body's `cache_salt` (vLLM's rules: a non-empty string of at most 128
/// characters without `@ / \ NUL`) and whether it continues a conversation
/// ([`kvroute_proto::turns`], as the filter reads it). Only the salt can
/// refuse it: `messages`, `input` and `previous_response_id` are taken as
/// any JSON value (a shape vLLM refuses is its to refuse).
pub fn head_of(body: &[u8]) -> Result<Head, TokenizeError> {
    #[derive(serde::Deserialize)]
    struct Fields<'a> {
        cache_salt: Option<String>,
        #[serde(borrow)]
        messages: Option<&'a RawValue>,
        #[serde(borrow)]
        input: Option<&'a RawValue>,
        #[serde(borrow)]
        previous_response_id: Option<&'a RawValue>,
    }
    let f: Fields<'_> = serde_json::from_slice(body).map_err(|e| TokenizeError::Refused {
        status: 400,
        message: format!("invalid JSON body: {e}"),
    })?;
    let named = f
        .previous_response_id
        .and_then(|id| serde_json::from_str::<String>(id.get()).ok())
        .is_some_and(|id| !id.is_empty());
    let continuation = match (f.messages, f.input) {
        _ if named => Some(true),
        (None, None) => None,
        (m, i) => Some([m, i].into_iter().flatten().any(turns::holds_earlier_turn)),
    };
    Ok(Head {
        salt: valid_salt(f.cache_salt)?,
        continuation,
    })
}

/// `salt` if vLLM takes it, else its 400.
pub fn valid_salt(salt: Option<String>) -> Result<Option<String>, TokenizeError> {
    match salt {
        None => Ok(None),
        Some(s)
            if !s.is_empty() && s.chars().count() <= 128 && !s.contains(['@', '/', '\\', '\0']) =>
        {
            Ok(Some(s))
        }
        Some(_) => Err(TokenizeError::Refused {
            status: 400,
            message: "`cache_salt` is not a valid salt".to_owned(),
        }),
    }
}
