//! A body's ids from the local tokenizer ([`local_ids`]) within its
//! [`Limits`] (the caller's cancel, the time budget, the token cap), and
//! what a body tells besides, read without the tokenizer ([`head_of`]): its
//! `cache_salt`, and whether it continues a conversation.

use std::time::Instant;

use kvroute_tokenizer::{MessagesRequest, ResponsesRequest, TokenizeRequest, Tokenizer};

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
/// characters without `@ / \ NUL`) and whether it continues a conversation,
/// in one pass over the body. Only the salt can refuse it: `messages` and
/// `input` are read leniently (a shape vLLM refuses is its to refuse).
pub fn head_of(body: &[u8]) -> Result<Head, TokenizeError> {
    #[derive(serde::Deserialize)]
    struct Fields {
        cache_salt: Option<String>,
        #[serde(default)]
        messages: turns::Turns,
        #[serde(default)]
        input: turns::Turns,
        #[serde(default)]
        previous_response_id: turns::Named,
    }
    let f: Fields = serde_json::from_slice(body).map_err(|e| TokenizeError::Refused {
        status: 400,
        message: format!("invalid JSON body: {e}"),
    })?;
    let continuation = match (f.previous_response_id.0, f.messages.0, f.input.0) {
        (true, ..) => Some(true),
        (false, None, None) => None,
        (false, m, i) => Some(m.unwrap_or(false) || i.unwrap_or(false)),
    };
    Ok(Head {
        salt: valid_salt(f.cache_salt)?,
        continuation,
    })
}

/// The body's `cache_salt` ([`head_of`]).
pub fn salt_of(body: &[u8]) -> Result<Option<String>, TokenizeError> {
    head_of(body).map(|h| h.salt)
}

/// Lenient readers of the fields [`head_of`] looks at: any JSON value is
/// taken (serde's derive would refuse the body for a field of another
/// shape), and nothing but a role or a type is kept. Written by hand as
/// serde visitors so that the body is walked once, without building it.
mod turns {
    use std::fmt;

    use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

    /// Whether a field present holds an earlier turn ([`Item`]: a list
    /// of items; any other value holds none); `None` if absent.
    #[derive(Default)]
    pub(super) struct Turns(pub Option<bool>);

    /// A non-empty string.
    #[derive(Default)]
    pub(super) struct Named(pub bool);

    /// An item of a list: whether it is an earlier turn's.
    struct Item(bool);

    /// A string's text, if the value is one.
    struct Text(Option<String>);

    /// An item's key, as far as [`Item`] cares (no copy of its text).
    enum Key {
        Role,
        Type,
        Other,
    }

    /// The visitors' shared part: every value but the one each looks for
    /// is taken and read as `default`.
    macro_rules! any_other_value {
        ($default:expr) => {
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok($default)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok($default)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok($default)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok($default)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok($default)
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok($default)
            }
        };
    }

    /// Reads past a list's elements.
    fn drain_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }

    /// Reads past a map's entries.
    fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(())
    }

    struct TurnsVisitor;

    impl<'de> Visitor<'de> for TurnsVisitor {
        type Value = Turns;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("any JSON value")
        }
        any_other_value!(Turns(Some(false)));
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Turns, E> {
            Ok(Turns(Some(false)))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Turns, A::Error> {
            let mut any = false;
            while let Some(Item(earlier)) = seq.next_element::<Item>()? {
                any |= earlier;
            }
            Ok(Turns(Some(any)))
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Turns, A::Error> {
            drain_map(map).map(|()| Turns(Some(false)))
        }
    }

    impl<'de> de::Deserialize<'de> for Turns {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(TurnsVisitor)
        }
    }

    struct ItemVisitor;

    impl<'de> Visitor<'de> for ItemVisitor {
        type Value = Item;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("any JSON value")
        }
        any_other_value!(Item(false));
        fn visit_str<E: de::Error>(self, _: &str) -> Result<Item, E> {
            Ok(Item(false))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Item, A::Error> {
            drain_seq(seq).map(|()| Item(false))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Item, A::Error> {
            let mut earlier = false;
            while let Some(key) = map.next_key::<Key>()? {
                match key {
                    Key::Role => {
                        let Text(role) = map.next_value()?;
                        earlier |= role
                            .as_deref()
                            .is_some_and(kvroute_proto::turns::earlier_role);
                    }
                    Key::Type => {
                        let Text(kind) = map.next_value()?;
                        earlier |= kind
                            .as_deref()
                            .is_some_and(kvroute_proto::turns::output_item);
                    }
                    Key::Other => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            Ok(Item(earlier))
        }
    }

    impl<'de> de::Deserialize<'de> for Item {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(ItemVisitor)
        }
    }

    struct TextVisitor;

    impl<'de> Visitor<'de> for TextVisitor {
        type Value = Text;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("any JSON value")
        }
        any_other_value!(Text(None));
        fn visit_str<E: de::Error>(self, s: &str) -> Result<Text, E> {
            Ok(Text(Some(s.to_owned())))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Text, A::Error> {
            drain_seq(seq).map(|()| Text(None))
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Text, A::Error> {
            drain_map(map).map(|()| Text(None))
        }
    }

    impl<'de> de::Deserialize<'de> for Text {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(TextVisitor)
        }
    }

    struct KeyVisitor;

    impl Visitor<'_> for KeyVisitor {
        type Value = Key;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a key")
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<Key, E> {
            Ok(match s {
                "role" => Key::Role,
                "type" => Key::Type,
                _ => Key::Other,
            })
        }
    }

    impl<'de> de::Deserialize<'de> for Key {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_identifier(KeyVisitor)
        }
    }

    impl<'de> de::Deserialize<'de> for Named {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let Text(text) = d.deserialize_any(TextVisitor)?;
            Ok(Self(text.is_some_and(|t| !t.is_empty())))
        }
    }
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
