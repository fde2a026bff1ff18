//! Parsing of completions, chat, Responses and Messages request bodies.
//!
//! The filter needs only what determines the prompt's block identities (the
//! fields vLLM renders into the prompt), the `model`, the `cache_salt` and a
//! Responses `previous_response_id`. Requests whose blocks the router cannot
//! compute (images, audio, video, files, prompt embeddings) are refused as
//! [`Rejection::IncompleteIdentity`]; anything malformed as
//! [`Rejection::Unparseable`]. vLLM will answer those itself.

use std::collections::BTreeMap;

use serde_json::Value;
use serde_json::value::RawValue;

use crate::config::Api;

/// A request body the filter can route. Its fields are slices of the
/// original bytes: nothing is parsed into a tree but what a check needs
/// (token ids go straight into a `Vec<u32>`, forwarded fields are copied as
/// they came).
#[derive(Clone, Debug)]
pub struct ParsedRequest<'a> {
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
    /// The body's top-level fields as raw JSON (the last of duplicates).
    fields: BTreeMap<String, &'a RawValue>,
}

impl<'a> ParsedRequest<'a> {
    /// A top-level field's raw JSON, unless absent or `null`.
    pub fn raw(&self, name: &str) -> Option<&'a RawValue> {
        self.fields.get(name).copied().filter(|v| v.get() != "null")
    }

    /// A top-level field parsed into a value (for the few that need one).
    pub fn value(&self, name: &str) -> Option<Value> {
        self.raw(name)
            .and_then(|raw| serde_json::from_str(raw.get()).ok())
    }

    /// Every top-level field but `skip`, in name order, raw.
    pub fn fields_except(&self, skip: &str) -> impl Iterator<Item = (&str, &'a RawValue)> {
        self.fields
            .iter()
            .filter(move |(k, _)| k.as_str() != skip)
            .map(|(k, v)| (k.as_str(), *v))
    }
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
    "document",
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

/// The kind of JSON value a raw slice holds, from its first byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    String,
    Array,
    Object,
    Bool,
    Other,
}

fn kind(raw: &RawValue) -> Kind {
    match raw.get().trim_start().as_bytes().first() {
        Some(b'"') => Kind::String,
        Some(b'[') => Kind::Array,
        Some(b'{') => Kind::Object,
        Some(b't' | b'f') => Kind::Bool,
        _ => Kind::Other,
    }
}

fn string(raw: &RawValue) -> Option<String> {
    serde_json::from_str(raw.get()).ok()
}

/// Parses a request body of `api`.
pub fn parse(api: Api, bytes: &[u8]) -> Result<ParsedRequest<'_>, Rejection> {
    let fields: BTreeMap<String, &RawValue> = serde_json::from_slice(bytes).map_err(|e| {
        if e.classify() == serde_json::error::Category::Data {
            Rejection::bad("body is not a JSON object")
        } else {
            Rejection::bad(format!("invalid JSON: {e}"))
        }
    })?;
    let mut req = ParsedRequest {
        api,
        model: None,
        cache_salt: None,
        previous_response_id: None,
        prompt_ids: None,
        fields,
    };
    for field in EMBED_FIELDS {
        if req.raw(field).is_some() {
            return Err(Rejection::IncompleteIdentity(format!("`{field}` present")));
        }
    }
    req.model = match req.raw("model") {
        None => None,
        Some(raw) => match string(raw) {
            Some(s) if !s.is_empty() => Some(s),
            _ => return Err(Rejection::bad("`model` is not a non-empty string")),
        },
    };
    req.cache_salt = salt(req.raw("cache_salt"))?;
    match api {
        Api::Completions => req.prompt_ids = completions(&req)?,
        Api::Chat => chat(&req)?,
        Api::Responses => req.previous_response_id = responses(&req)?,
        Api::Messages => messages(&req)?,
    }
    Ok(req)
}

fn salt(value: Option<&RawValue>) -> Result<Option<String>, Rejection> {
    let Some(raw) = value else {
        return Ok(None);
    };
    let Some(s) = string(raw) else {
        return Err(Rejection::bad("`cache_salt` is not a string"));
    };
    let ok =
        !s.is_empty() && s.chars().count() <= MAX_SALT_CHARS && !s.contains(['@', '/', '\\', '\0']);
    if ok {
        Ok(Some(s))
    } else {
        Err(Rejection::bad("`cache_salt` is not a valid salt"))
    }
}

/// `prompt`: a string, one string in a list, or token ids (one list). Ids
/// are decoded straight into `u32`s, whatever their number.
fn completions(req: &ParsedRequest<'_>) -> Result<Option<Vec<u32>>, Rejection> {
    let Some(raw) = req.raw("prompt") else {
        return Err(Rejection::bad("`prompt` missing"));
    };
    match kind(raw) {
        Kind::String => return Ok(None),
        Kind::Array => {}
        _ => return Err(Rejection::bad("`prompt` has an unsupported shape")),
    }
    let text = raw.get();
    if let Ok(ids) = serde_json::from_str::<Vec<u32>>(text) {
        return if ids.is_empty() {
            Err(Rejection::bad("`prompt` is empty"))
        } else {
            Ok(Some(ids))
        };
    }
    if let Ok(mut lists) = serde_json::from_str::<Vec<Vec<u32>>>(text) {
        return match lists.len() {
            1 => Ok(lists.pop()),
            0 => Err(Rejection::bad("`prompt` is empty")),
            _ => Err(Rejection::bad("batched `prompt` cannot go to one replica")),
        };
    }
    let items: Vec<&RawValue> = serde_json::from_str(text)
        .map_err(|_| Rejection::bad("`prompt` has an unsupported shape"))?;
    match items.as_slice() {
        [one] if kind(one) == Kind::String => Ok(None),
        items if items.iter().all(|i| kind(i) == Kind::Other) => {
            Err(Rejection::bad("token id is not a u32"))
        }
        _ => Err(Rejection::bad("batched `prompt` cannot go to one replica")),
    }
}

/// `messages`: a non-empty list of objects (chat and Anthropic Messages).
fn message_list(req: &ParsedRequest<'_>) -> Result<Vec<Value>, Rejection> {
    let messages = match req.raw("messages") {
        Some(raw) if kind(raw) == Kind::Array => serde_json::from_str::<Vec<Value>>(raw.get())
            .map_err(|_| Rejection::bad("`messages` is not a list"))?,
        _ => return Err(Rejection::bad("`messages` missing or not a list")),
    };
    if messages.is_empty() {
        return Err(Rejection::bad("`messages` is empty"));
    }
    if messages.iter().any(|m| !m.is_object()) {
        return Err(Rejection::bad("a message is not an object"));
    }
    Ok(messages)
}

fn chat(req: &ParsedRequest<'_>) -> Result<(), Rejection> {
    let messages = message_list(req)?;
    optional_shape(req, "tools", Kind::Array)?;
    optional_shape(req, "chat_template_kwargs", Kind::Object)?;
    optional_shape(req, "add_generation_prompt", Kind::Bool)?;
    optional_shape(req, "continue_final_message", Kind::Bool)?;
    if messages.iter().any(has_media) {
        return Err(Rejection::IncompleteIdentity(
            "media content in `messages`".to_owned(),
        ));
    }
    Ok(())
}

/// Anthropic's Messages: `messages` (a non-empty list of objects), an
/// optional `system` (a string or a list of blocks) and `tools`. Image and
/// document blocks carry media.
fn messages(req: &ParsedRequest<'_>) -> Result<(), Rejection> {
    let messages = message_list(req)?;
    let system = match req.raw("system") {
        None => None,
        Some(raw) if matches!(kind(raw), Kind::String | Kind::Array) => req.value("system"),
        Some(_) => return Err(Rejection::bad("`system` has the wrong type")),
    };
    optional_shape(req, "tools", Kind::Array)?;
    optional_shape(req, "chat_template_kwargs", Kind::Object)?;
    if messages.iter().chain(system.as_ref()).any(has_media) {
        return Err(Rejection::IncompleteIdentity(
            "media content in `messages`".to_owned(),
        ));
    }
    Ok(())
}

fn responses(req: &ParsedRequest<'_>) -> Result<Option<String>, Rejection> {
    let previous = match req.raw("previous_response_id") {
        None => None,
        Some(raw) => match string(raw) {
            Some(s) if !s.is_empty() => Some(s),
            _ => return Err(Rejection::bad("`previous_response_id` is not a string")),
        },
    };
    match req.raw("input") {
        Some(raw) if kind(raw) == Kind::String => {}
        Some(raw) if kind(raw) == Kind::Array => {
            let items: Vec<Value> = serde_json::from_str(raw.get())
                .map_err(|_| Rejection::bad("`input` is not a list"))?;
            if items.iter().any(|m| !m.is_object() && !m.is_string()) {
                return Err(Rejection::bad("an `input` item is not an object"));
            }
            if items.iter().any(has_media) {
                return Err(Rejection::IncompleteIdentity(
                    "media content in `input`".to_owned(),
                ));
            }
        }
        None if previous.is_some() => {}
        _ => return Err(Rejection::bad("`input` missing or of the wrong shape")),
    }
    optional_shape(req, "instructions", Kind::String)?;
    optional_shape(req, "tools", Kind::Array)?;
    Ok(previous)
}

fn optional_shape(req: &ParsedRequest<'_>, field: &str, want: Kind) -> Result<(), Rejection> {
    match req.raw(field) {
        Some(raw) if kind(raw) != want => {
            Err(Rejection::bad(format!("`{field}` has the wrong type")))
        }
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

    fn ok(api: Api, json: &str) -> ParsedRequest<'_> {
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
        assert!(r.raw("tools").is_some());
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
    fn messages_shapes() {
        let r = ok(
            Api::Messages,
            r#"{"model":"m","max_tokens":8,"system":"be brief","messages":[{"role":"user","content":"hi"}],"cache_salt":"s1"}"#,
        );
        assert_eq!(r.cache_salt.as_deref(), Some("s1"));
        assert_eq!(r.previous_response_id, None);
        ok(
            Api::Messages,
            r#"{"model":"m","system":[{"type":"text","text":"x"}],"messages":[{"role":"user","content":[{"type":"text","text":"x"}]},{"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"f","input":{}}]}],"tools":[{"name":"f","input_schema":{"type":"object"}}]}"#,
        );
        unparseable(Api::Messages, br#"{"model":"m"}"#);
        unparseable(Api::Messages, br#"{"model":"m","messages":[]}"#);
        unparseable(Api::Messages, br#"{"model":"m","messages":["hi"]}"#);
        unparseable(
            Api::Messages,
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"system":3}"#,
        );
        unparseable(
            Api::Messages,
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"tools":{}}"#,
        );
        incomplete(
            Api::Messages,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AA=="}}]}]}"#,
        );
        incomplete(
            Api::Messages,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"document","source":{"type":"text","data":"x"}}]}]}"#,
        );
        incomplete(
            Api::Messages,
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"system":[{"type":"image","source":{}}]}"#,
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
        let body = format!(r#"{{"prompt":"x","cache_salt":"{max}"}}"#);
        let r = ok(Api::Completions, &body);
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
    fn huge_token_id_prompts_decode_straight_to_ids() {
        // ~8 MB of ids, as one list or one list in a list.
        let ids: Vec<String> = (0..1_200_000u32)
            .map(|i| (i % 32_000).to_string())
            .collect();
        for wrap in [false, true] {
            let list = format!("[{}]", ids.join(","));
            let prompt = if wrap { format!("[{list}]") } else { list };
            let body = format!(r#"{{"model":"m","prompt":{prompt},"max_tokens":1}}"#);
            let r = ok(Api::Completions, &body);
            let got = r.prompt_ids.unwrap();
            assert_eq!(got.len(), 1_200_000);
            assert_eq!(got[31_999], 31_999);
        }
    }

    #[test]
    fn the_last_of_duplicate_fields_counts_and_raw_fields_are_kept_as_sent() {
        let r = ok(
            Api::Chat,
            r#"{"model":"a","model":"b","messages":[{"role":"user","content":"x\u00e9"}]}"#,
        );
        assert_eq!(r.model.as_deref(), Some("b"));
        assert_eq!(
            r.raw("messages").map(|m| m.get()),
            Some(r#"[{"role":"user","content":"x\u00e9"}]"#)
        );
    }

    #[test]
    fn huge_bodies_parse() {
        let text = "lorem ipsum ".repeat(80_000);
        let body = format!(r#"{{"model":"m","prompt":"{text}"}}"#);
        let r = ok(Api::Completions, &body);
        assert_eq!(r.model.as_deref(), Some("m"));
    }
}
