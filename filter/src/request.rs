//! Parsing of completions, chat and responses request bodies.
//!
//! The filter needs only what determines the prompt's block identities (the
//! fields vLLM renders into the prompt), the `model`, the `cache_salt` and a
//! Responses `previous_response_id`. Requests whose blocks the router cannot
//! compute (images, audio, video, files, prompt embeddings) are refused as
//! [`Rejection::IncompleteIdentity`]; anything malformed as
//! [`Rejection::Unparseable`]. vLLM will answer those itself.

use serde_json::{Map, Value};

use crate::config::Api;

/// A request body the filter can route.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedRequest {
    /// Which API the body speaks.
    pub api: Api,
    /// `model`, if present and a non-empty string.
    pub model: Option<String>,
    /// `cache_salt`, validated as vLLM does.
    pub cache_salt: Option<String>,
    /// Responses API continuation id.
    pub previous_response_id: Option<String>,
    /// Token ids given directly as a completions `prompt`.
    pub prompt_ids: Option<Vec<u32>>,
    /// The body's top-level object.
    pub body: Map<String, Value>,
}

/// Why a body cannot be routed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// Not JSON, not an object, or a field of the wrong shape.
    Unparseable(String),
    /// Media or embeddings: identities the router cannot compute.
    IncompleteIdentity(String),
}

impl Rejection {
    fn bad(msg: impl Into<String>) -> Self {
        Self::Unparseable(msg.into())
    }
}

/// Content part types and keys that carry media into the prompt.
const MEDIA_TYPES: &[&str] = &[
    "image_url",
    "input_image",
    "image",
    "image_pil",
    "image_embeds",
    "input_audio",
    "audio_url",
    "audio",
    "audio_embeds",
    "video_url",
    "video",
    "input_file",
    "file",
];
const MEDIA_KEYS: &[&str] = &[
    "image_url",
    "input_audio",
    "audio_url",
    "video_url",
    "image_embeds",
    "audio_embeds",
    "image_pil",
    "file_data",
    "file_id",
    "file_url",
];
/// Top-level fields that replace or extend the text prompt.
const EMBED_FIELDS: &[&str] = &["prompt_embeds", "multi_modal_data", "mm_embeds"];

/// vLLM's limit on `cache_salt`.
const MAX_SALT_CHARS: usize = 128;

/// Parses a request body of `api`.
pub fn parse(api: Api, bytes: &[u8]) -> Result<ParsedRequest, Rejection> {
    let value: Value =
        serde_json::from_slice(bytes).map_err(|e| Rejection::bad(format!("invalid JSON: {e}")))?;
    let Value::Object(body) = value else {
        return Err(Rejection::bad("body is not a JSON object"));
    };
    for field in EMBED_FIELDS {
        if body.get(*field).is_some_and(|v| !v.is_null()) {
            return Err(Rejection::IncompleteIdentity(format!("`{field}` present")));
        }
    }
    let model = match body.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => return Err(Rejection::bad("`model` is not a non-empty string")),
    };
    let cache_salt = salt(body.get("cache_salt"))?;
    let mut previous_response_id = None;
    let mut prompt_ids = None;
    match api {
        Api::Completions => prompt_ids = completions(&body)?,
        Api::Chat => chat(&body)?,
        Api::Responses => previous_response_id = responses(&body)?,
    }
    Ok(ParsedRequest {
        api,
        model,
        cache_salt,
        previous_response_id,
        prompt_ids,
        body,
    })
}

fn salt(value: Option<&Value>) -> Result<Option<String>, Rejection> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            let ok = !s.is_empty()
                && s.chars().count() <= MAX_SALT_CHARS
                && !s.contains(['@', '/', '\\', '\0']);
            if ok {
                Ok(Some(s.clone()))
            } else {
                Err(Rejection::bad("`cache_salt` is not a valid salt"))
            }
        }
        Some(_) => Err(Rejection::bad("`cache_salt` is not a string")),
    }
}

/// `prompt`: a string, one string in a list, or token ids (one list).
fn completions(body: &Map<String, Value>) -> Result<Option<Vec<u32>>, Rejection> {
    match body.get("prompt") {
        Some(Value::String(_)) => Ok(None),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(_)] => Ok(None),
            [Value::Array(ids)] => token_ids(ids).map(Some),
            [] => Err(Rejection::bad("`prompt` is empty")),
            [_, _, ..] if items.iter().all(Value::is_number) => token_ids(items).map(Some),
            [Value::Number(_)] => token_ids(items).map(Some),
            _ => Err(Rejection::bad("batched `prompt` cannot go to one replica")),
        },
        Some(_) => Err(Rejection::bad("`prompt` has an unsupported shape")),
        None => Err(Rejection::bad("`prompt` missing")),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, Rejection> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| Rejection::bad("token id is not a u32"))
        })
        .collect()
}

fn chat(body: &Map<String, Value>) -> Result<(), Rejection> {
    let Some(Value::Array(messages)) = body.get("messages") else {
        return Err(Rejection::bad("`messages` missing or not a list"));
    };
    if messages.is_empty() {
        return Err(Rejection::bad("`messages` is empty"));
    }
    if messages.iter().any(|m| !m.is_object()) {
        return Err(Rejection::bad("a message is not an object"));
    }
    optional_shape(body, "tools", Value::is_array)?;
    optional_shape(body, "chat_template_kwargs", Value::is_object)?;
    optional_shape(body, "add_generation_prompt", Value::is_boolean)?;
    optional_shape(body, "continue_final_message", Value::is_boolean)?;
    media("messages", body.get("messages"))
}

fn responses(body: &Map<String, Value>) -> Result<Option<String>, Rejection> {
    let previous = match body.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => return Err(Rejection::bad("`previous_response_id` is not a string")),
    };
    match body.get("input") {
        Some(Value::String(_)) => {}
        Some(Value::Array(items)) => {
            if items.iter().any(|m| !m.is_object() && !m.is_string()) {
                return Err(Rejection::bad("an `input` item is not an object"));
            }
        }
        None | Some(Value::Null) if previous.is_some() => {}
        _ => return Err(Rejection::bad("`input` missing or of the wrong shape")),
    }
    optional_shape(body, "instructions", Value::is_string)?;
    optional_shape(body, "tools", Value::is_array)?;
    media("input", body.get("input"))?;
    Ok(previous)
}

fn optional_shape(
    body: &Map<String, Value>,
    field: &str,
    ok: fn(&Value) -> bool,
) -> Result<(), Rejection> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(()),
        Some(v) if ok(v) => Ok(()),
        Some(_) => Err(Rejection::bad(format!("`{field}` has the wrong type"))),
    }
}

/// Looks for media content parts anywhere under `value`.
fn media(field: &str, value: Option<&Value>) -> Result<(), Rejection> {
    match value {
        Some(v) if has_media(v) => Err(Rejection::IncompleteIdentity(format!(
            "media content in `{field}`"
        ))),
        _ => Ok(()),
    }
}

fn has_media(value: &Value) -> bool {
    // serde_json limits nesting to 128 levels, so recursion is bounded.
    match value {
        Value::Array(items) => items.iter().any(has_media),
        Value::Object(map) => {
            let typed = map
                .get("type")
                .and_then(Value::as_str)
                .is_some_and(|t| MEDIA_TYPES.contains(&t));
            typed
                || map.iter().any(|(k, v)| {
                    (MEDIA_KEYS.contains(&k.as_str()) && !v.is_null()) || has_media(v)
                })
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(api: Api, json: &str) -> ParsedRequest {
        parse(api, json.as_bytes()).unwrap()
    }

    fn unparseable(api: Api, bytes: &[u8]) {
        match parse(api, bytes) {
            Err(Rejection::Unparseable(_)) => {}
            other => panic!(
                "expected unparseable for {:?}: {other:?}",
                String::from_utf8_lossy(bytes)
            ),
        }
    }

    fn incomplete(api: Api, json: &str) {
        match parse(api, json.as_bytes()) {
            Err(Rejection::IncompleteIdentity(_)) => {}
            other => panic!("expected incomplete_identity for {json}: {other:?}"),
        }
    }

    #[test]
    fn completions_shapes() {
        let r = ok(
            Api::Completions,
            r#"{"model":"m","prompt":"hello","cache_salt":"t1"}"#,
        );
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.cache_salt.as_deref(), Some("t1"));
        assert_eq!(r.prompt_ids, None);
        assert_eq!(ok(Api::Completions, r#"{"prompt":["x"]}"#).model, None);
        assert_eq!(
            ok(Api::Completions, r#"{"model":"m","prompt":[1,2,3]}"#).prompt_ids,
            Some(vec![1, 2, 3])
        );
        assert_eq!(
            ok(Api::Completions, r#"{"model":"m","prompt":[[7,8]]}"#).prompt_ids,
            Some(vec![7, 8])
        );
        unparseable(Api::Completions, br#"{"model":"m","prompt":["a","b"]}"#);
        unparseable(Api::Completions, br#"{"model":"m","prompt":[1,-2]}"#);
        unparseable(Api::Completions, br#"{"model":"m","prompt":[]}"#);
        unparseable(Api::Completions, br#"{"model":"m"}"#);
        unparseable(Api::Completions, br#"{"model":"m","prompt":5}"#);
        unparseable(Api::Completions, br#"{"model":7,"prompt":"x"}"#);
        incomplete(Api::Completions, r#"{"model":"m","prompt_embeds":"AAAA"}"#);
    }

    #[test]
    fn chat_shapes() {
        let r = ok(
            Api::Chat,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],
                "tools":[{"type":"function","function":{"name":"f","parameters":{"properties":{"image_url":{"type":"string"}}}}}],
                "chat_template_kwargs":{"enable_thinking":false},"add_generation_prompt":true}"#,
        );
        assert!(r.body.contains_key("tools"));
        unparseable(Api::Chat, br#"{"model":"m","messages":[]}"#);
        unparseable(Api::Chat, br#"{"model":"m","messages":"hi"}"#);
        unparseable(Api::Chat, br#"{"model":"m","messages":[1]}"#);
        unparseable(Api::Chat, br#"{"model":"m","messages":[{}],"tools":{}}"#);
        unparseable(
            Api::Chat,
            br#"{"model":"m","messages":[{}],"add_generation_prompt":"yes"}"#,
        );
        incomplete(
            Api::Chat,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:"}}]}]}"#,
        );
        incomplete(
            Api::Chat,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"x"}}]}]}"#,
        );
        incomplete(
            Api::Chat,
            r#"{"model":"m","messages":[{"role":"user","content":[{"video_url":{"url":"x"}}]}]}"#,
        );
    }

    #[test]
    fn responses_shapes() {
        let r = ok(
            Api::Responses,
            r#"{"model":"m","input":"hi","instructions":"be brief","previous_response_id":"resp_1"}"#,
        );
        assert_eq!(r.previous_response_id.as_deref(), Some("resp_1"));
        let r = ok(
            Api::Responses,
            r#"{"model":"m","previous_response_id":"resp_2"}"#,
        );
        assert_eq!(r.previous_response_id.as_deref(), Some("resp_2"));
        let r = ok(
            Api::Responses,
            r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"x"}]}]}"#,
        );
        assert_eq!(r.previous_response_id, None);
        unparseable(Api::Responses, br#"{"model":"m"}"#);
        unparseable(Api::Responses, br#"{"model":"m","input":3}"#);
        unparseable(
            Api::Responses,
            br#"{"model":"m","input":"x","instructions":[1]}"#,
        );
        unparseable(
            Api::Responses,
            br#"{"model":"m","input":"x","previous_response_id":5}"#,
        );
        incomplete(
            Api::Responses,
            r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_image","image_url":"https://x"}]}]}"#,
        );
        incomplete(
            Api::Responses,
            r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_file","file_id":"f"}]}]}"#,
        );
    }

    #[test]
    fn salts_are_checked_like_vllm() {
        for bad in [
            r#""""#,
            r#""a/b""#,
            r#""a@b""#,
            r#""a\\b""#,
            r#""a\u0000""#,
            "5",
        ] {
            unparseable(
                Api::Completions,
                format!(r#"{{"model":"m","prompt":"x","cache_salt":{bad}}}"#).as_bytes(),
            );
        }
        let long = "s".repeat(129);
        unparseable(
            Api::Completions,
            format!(r#"{{"model":"m","prompt":"x","cache_salt":"{long}"}}"#).as_bytes(),
        );
        let max = "é".repeat(128);
        let r = ok(
            Api::Completions,
            &format!(r#"{{"prompt":"x","cache_salt":"{max}"}}"#),
        );
        assert_eq!(r.cache_salt.as_deref(), Some(max.as_str()));
    }

    #[test]
    fn malformed_truncated_and_non_utf8_bodies() {
        let full = br#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#;
        for cut in 0..full.len() {
            unparseable(Api::Chat, &full[..cut]);
        }
        unparseable(Api::Chat, b"\xff\xfe{\"model\":\"m\"}");
        unparseable(
            Api::Completions,
            b"{\"model\":\"m\",\"prompt\":\"\xc3\x28\"}",
        );
        unparseable(Api::Completions, b"[1,2]");
        unparseable(Api::Completions, b"null");
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        unparseable(Api::Chat, deep.as_bytes());
    }

    #[test]
    fn huge_bodies_parse() {
        let text = "lorem ipsum ".repeat(80_000);
        let r = ok(
            Api::Completions,
            &format!(r#"{{"model":"m","prompt":"{text}"}}"#),
        );
        assert_eq!(r.model.as_deref(), Some("m"));
    }
}
