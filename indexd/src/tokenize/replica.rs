//! A replica's own tokenizer: vLLM's `POST /v1/chat/completions/render`
//! (chat bodies as they came: exactly what the chat completion prefills),
//! falling back to `POST /tokenize` (cut to the fields it takes) on replicas
//! without the render endpoints (`--enable-scale-out`); `/tokenize` for
//! completions; `POST /v1/responses/render` for Responses bodies as they
//! came (`/tokenize` refuses them, and rendering them as chat would miss the
//! second BOS); Messages bodies converted to chat first, as vLLM converts
//! them, then `POST /tokenize` (vLLM serves no tokenizer endpoint for
//! them).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvroute_proto::tokenize_fields::{CHAT as CHAT_FIELDS, COMPLETION as COMPLETION_FIELDS};
use serde_json::value::RawValue;

use super::{Api, TokenizeError};

/// The header every request indexd forwards to a replica carries (value
/// [`HOP_VALUE`]): a request that arrives with it has been forwarded once
/// already, so a server that would forward it again (indexd itself, reached
/// through an address it does not know as its own) can refuse it instead
/// of looping.
pub const HOP_HEADER: &str = "x-kvroute-hop";
/// The value of [`HOP_HEADER`] on a forwarded request: one hop.
pub const HOP_VALUE: &str = "1";
/// Largest answer read from a replica.
const MAX_ANSWER_BYTES: usize = 64 << 20;

/// The client replicas are called with: no proxy, no redirects.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .pool_idle_timeout(Duration::from_secs(30))
        .build()
        .unwrap_or_default()
}

/// Which endpoint a replica is asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/tokenize`.
    Tokenize,
    /// `/v1/chat/completions/render`, `/v1/completions/render` or
    /// `/v1/responses/render`.
    Render,
}

/// The path and body of the tokenizer call for a body of `api`.
pub fn request(
    api: Api,
    endpoint: Endpoint,
    model: &str,
    body: &[u8],
) -> Result<(&'static str, Vec<u8>), TokenizeError> {
    let fields = match (api, endpoint) {
        (Api::Responses, _) => return Ok(("/v1/responses/render", with_model(model, body)?)),
        (Api::Messages, _) => return Ok(("/tokenize", messages_as_chat(model, body)?)),
        (Api::Chat, Endpoint::Render) => {
            return Ok(("/v1/chat/completions/render", with_model(model, body)?));
        }
        (Api::Completions, Endpoint::Render) => {
            return Ok(("/v1/completions/render", with_model(model, body)?));
        }
        (Api::Chat, Endpoint::Tokenize) => CHAT_FIELDS,
        (Api::Completions, _) => COMPLETION_FIELDS,
    };
    let all: BTreeMap<String, &RawValue> =
        serde_json::from_slice(body).map_err(|e| TokenizeError::Refused {
            status: 400,
            message: format!("invalid JSON body: {e}"),
        })?;
    let mut out = b"{\"model\":".to_vec();
    out.extend_from_slice(&json_string(model));
    for field in fields {
        if let Some(v) = all.get(*field).filter(|v| v.get() != "null") {
            out.push(b',');
            out.extend_from_slice(&json_string(field));
            out.push(b':');
            out.extend_from_slice(v.get().as_bytes());
        }
    }
    out.push(b'}');
    Ok(("/tokenize", out))
}

/// A Messages body as the `/tokenize` chat body vLLM's conversion makes of
/// it. Without the model's chat template, only a body that converts the
/// same under every template can be converted (no inline `system` message,
/// no `thinking` disabled); the others need indexd's own tokenizer.
fn messages_as_chat(model: &str, body: &[u8]) -> Result<Vec<u8>, TokenizeError> {
    use super::local::from_request_error;
    let req = kvroute_tokenizer::MessagesRequest::from_json(body).map_err(from_request_error)?;
    if !req.converts_without_template() {
        return Err(TokenizeError::Unsupported(
            "a Messages body with inline system messages or thinking disabled converts by what \
             vLLM reads off the model's chat template: only indexd's own tokenizer of the model \
             converts it"
                .to_owned(),
        ));
    }
    let chat = req
        .to_chat(&kvroute_tokenizer::MessagesConversion::default())
        .and_then(|c| c.to_json())
        .map_err(from_request_error)?;
    with_model(model, chat.as_bytes())
}

fn json_string(s: &str) -> Vec<u8> {
    // Serializing a string into memory cannot fail.
    serde_json::to_vec(s).unwrap_or_default()
}

/// `body` with its `model` set to `model` (a Responses body may name none
/// and rely on the gateway's fallback).
fn with_model(model: &str, body: &[u8]) -> Result<Vec<u8>, TokenizeError> {
    let mut all: BTreeMap<String, &RawValue> =
        serde_json::from_slice(body).map_err(|e| TokenizeError::Refused {
            status: 400,
            message: format!("invalid JSON body: {e}"),
        })?;
    if all.get("model").is_some_and(|m| m.get() != "null") {
        return Ok(body.to_vec());
    }
    all.remove("model");
    let mut out = b"{\"model\":".to_vec();
    out.extend_from_slice(&json_string(model));
    for (k, v) in all {
        out.push(b',');
        out.extend_from_slice(&json_string(&k));
        out.push(b':');
        out.extend_from_slice(v.get().as_bytes());
    }
    out.push(b'}');
    Ok(out)
}

/// The ids in a `/tokenize` (`tokens`) or render (`token_ids`, possibly in
/// a one-element list) answer.
pub fn parse_ids(answer: &[u8]) -> Option<Vec<u32>> {
    parse_answer(answer).map(|a| a.ids)
}

/// A replica's token ids for a body, and the model's context length where
/// the answer gives it (vLLM's `/tokenize` does: `max_model_len`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Replied {
    /// The prompt's token ids.
    pub ids: Vec<u32>,
    /// The serving replica's `max_model_len`, if the answer says.
    pub max_model_len: Option<u32>,
}

/// [`parse_ids`], with the answer's `max_model_len`.
fn parse_answer(answer: &[u8]) -> Option<Replied> {
    #[derive(serde::Deserialize)]
    struct Ids {
        tokens: Option<Vec<u32>>,
        token_ids: Option<Vec<u32>>,
        max_model_len: Option<u32>,
    }
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Answer {
        One(Ids),
        List(Vec<Ids>),
    }
    let ids = match serde_json::from_slice::<Answer>(answer).ok()? {
        Answer::One(ids) => ids,
        Answer::List(mut list) if list.len() == 1 => list.pop()?,
        Answer::List(_) => return None,
    };
    Some(Replied {
        ids: ids.tokens.or(ids.token_ids)?,
        max_model_len: ids.max_model_len.filter(|l| *l > 0),
    })
}

/// A vLLM error answer's message, if it is one.
fn error_message(answer: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(answer).unwrap_or_default();
    let msg = v
        .get("error")
        .and_then(|e| e.get("message").or(Some(e)))
        .or_else(|| v.get("message"))
        .and_then(|m| m.as_str().map(str::to_owned));
    msg.unwrap_or_else(|| String::from_utf8_lossy(answer.get(..200).unwrap_or(answer)).into_owned())
}

/// What a replica answered: its status and body, read up to a bound. The
/// request carries [`HOP_HEADER`].
pub async fn call(
    client: &reqwest::Client,
    address: SocketAddr,
    path: &str,
    body: Vec<u8>,
    timeout: Duration,
) -> Result<(u16, Vec<u8>), TokenizeError> {
    let url = format!("http://{address}{path}");
    let exchange = async {
        let mut response = client
            .post(&url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(HOP_HEADER, HOP_VALUE)
            .body(body)
            .send()
            .await
            .map_err(|e| TokenizeError::Unavailable(format!("{url}: {e}")))?;
        let status = response.status().as_u16();
        let mut out = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| TokenizeError::Unavailable(format!("{url}: {e}")))?
        {
            if out.len().saturating_add(chunk.len()) > MAX_ANSWER_BYTES {
                return Err(TokenizeError::Unavailable(format!(
                    "{url}: answer over {MAX_ANSWER_BYTES} bytes"
                )));
            }
            out.extend_from_slice(&chunk);
        }
        Ok((status, out))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| TokenizeError::Unavailable(format!("{url}: no answer within {timeout:?}")))?
}

/// Whether a chat or completions body sets `truncate_prompt_tokens`, which
/// the chat completion and the completion apply to the prompt and
/// `/tokenize` ignores: only a render endpoint gives its ids.
fn truncates(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Truncate<'a> {
        #[serde(borrow)]
        truncate_prompt_tokens: Option<&'a RawValue>,
    }
    serde_json::from_slice::<Truncate<'_>>(body)
        .ok()
        .and_then(|t| t.truncate_prompt_tokens)
        .is_some_and(|v| v.get() != "null")
}

/// `input_tokens` of the replica's `POST /v1/messages/count_tokens` for a
/// Messages body (vLLM's own conversion to chat, rendered and counted).
pub async fn count_tokens(
    client: &reqwest::Client,
    address: SocketAddr,
    body: &[u8],
    timeout: Duration,
) -> Result<usize, TokenizeError> {
    #[derive(serde::Deserialize)]
    struct Count {
        input_tokens: usize,
    }
    let path = "/v1/messages/count_tokens";
    let (status, answer) = call(client, address, path, body.to_vec(), timeout).await?;
    match status {
        200 => serde_json::from_slice::<Count>(&answer)
            .map(|c| c.input_tokens)
            .map_err(|e| {
                TokenizeError::Unavailable(format!("{address}{path}: no input_tokens: {e}"))
            }),
        400..=499 if status != 408 && status != 429 => Err(TokenizeError::Refused {
            status,
            message: error_message(&answer),
        }),
        _ => Err(TokenizeError::Unavailable(format!(
            "{address}{path} answered {status}: {}",
            error_message(&answer)
        ))),
    }
}

/// The ids the replica at `address` computes for a body of `api` (and its
/// `max_model_len`, where the answer gives it). A chat
/// body, and a completions body that sets `truncate_prompt_tokens`, go to
/// the render endpoints unless `chat_render` says the replicas lack them (a
/// 404 there clears it, and `/tokenize` answers); a body that truncates is
/// then not tokenized, since `/tokenize` would give the ids of the prompt
/// before its truncation.
pub async fn token_ids(
    client: &reqwest::Client,
    address: SocketAddr,
    api: Api,
    model: &str,
    body: &[u8],
    timeout: Duration,
    chat_render: &AtomicBool,
) -> Result<Replied, TokenizeError> {
    let truncating = api != Api::Responses && truncates(body);
    let without_render = || {
        TokenizeError::Unsupported(
            "truncate_prompt_tokens: the replicas serve no render endpoint (vLLM without --enable-scale-out), and /tokenize ignores it".to_owned(),
        )
    };
    let mut endpoint = if (api == Api::Chat || truncating) && chat_render.load(Ordering::Relaxed) {
        Endpoint::Render
    } else if truncating {
        return Err(without_render());
    } else {
        Endpoint::Tokenize
    };
    let (status, answer, path) = loop {
        let (path, request) = request(api, endpoint, model, body)?;
        let (status, answer) = call(client, address, path, request, timeout).await?;
        if status == 404 && endpoint == Endpoint::Render && api != Api::Responses {
            if chat_render.swap(false, Ordering::Relaxed) {
                tracing::info!(replica = %address, "no {path} (vLLM without --enable-scale-out): chat bodies go to /tokenize, which ignores documents and reasoning_effort; bodies with truncate_prompt_tokens are not tokenized");
            }
            if truncating {
                return Err(without_render());
            }
            endpoint = Endpoint::Tokenize;
            continue;
        }
        break (status, answer, path);
    };
    match status {
        200 => parse_answer(&answer).ok_or_else(|| {
            TokenizeError::Unavailable(format!("{address}{path}: no token ids in the answer"))
        }),
        400..=499 if status != 408 && status != 429 => Err(TokenizeError::Refused {
            status,
            message: error_message(&answer),
        }),
        _ => Err(TokenizeError::Unavailable(format!(
            "{address}{path} answered {status}: {}",
            error_message(&answer)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenize_bodies_keep_the_prompt_fields_only() {
        let (path, body) = request(
            Api::Chat,
            Endpoint::Tokenize,
            "m",
            br#"{"model":"x","messages":[{"role":"user","content":"hi"}],"stream":true,"tools":null,"max_tokens":3}"#,
        )
        .unwrap();
        assert_eq!(path, "/tokenize");
        assert_eq!(
            String::from_utf8(body).unwrap(),
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#
        );
        let (path, body) = request(
            Api::Completions,
            Endpoint::Tokenize,
            "m",
            br#"{"prompt":"a","add_special_tokens":false,"n":2}"#,
        )
        .unwrap();
        assert_eq!(path, "/tokenize");
        assert_eq!(
            String::from_utf8(body).unwrap(),
            r#"{"model":"m","prompt":"a","add_special_tokens":false}"#
        );
    }

    #[test]
    fn responses_bodies_go_to_render_as_they_came() {
        let raw = br#"{"model":"m","input":"x","stream":true}"#;
        let (path, body) = request(Api::Responses, Endpoint::Tokenize, "m", raw).unwrap();
        assert_eq!(path, "/v1/responses/render");
        assert_eq!(body, raw.to_vec());
        let (_, body) =
            request(Api::Responses, Endpoint::Render, "fb", br#"{"input":"x"}"#).unwrap();
        assert_eq!(
            String::from_utf8(body).unwrap(),
            r#"{"model":"fb","input":"x"}"#
        );
        let chat = br#"{"model":"m","messages":[],"documents":[{"t":"d"}],"stream":true}"#;
        let (path, body) = request(Api::Chat, Endpoint::Render, "m", chat).unwrap();
        assert_eq!(path, "/v1/chat/completions/render");
        assert_eq!(body, chat.to_vec(), "as the client sent it");
        assert!(request(Api::Chat, Endpoint::Tokenize, "m", b"{").is_err());
    }

    /// A one-shot HTTP server: answers each of `n` connections with
    /// `answer` and hands back each request's head, lower-cased.
    async fn stub(
        n: usize,
        answer: &'static str,
    ) -> (SocketAddr, tokio::task::JoinHandle<Vec<String>>) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let served = tokio::spawn(async move {
            let mut heads = Vec::new();
            for _ in 0..n {
                let (mut conn, _) = listener.accept().await.unwrap();
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                // The head, then as much body as it announces.
                let head_end = loop {
                    let got = conn.read(&mut chunk).await.unwrap();
                    assert!(got > 0, "the client closed before its head ended");
                    buf.extend_from_slice(&chunk[..got]);
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                    assert!(buf.len() < 1 << 20, "no end of head");
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                while buf.len() < head_end + length {
                    let got = conn.read(&mut chunk).await.unwrap();
                    assert!(got > 0, "the client closed before its body ended");
                    buf.extend_from_slice(&chunk[..got]);
                }
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                    answer.len()
                );
                conn.write_all(response.as_bytes()).await.unwrap();
                heads.push(head);
            }
            heads
        });
        (addr, served)
    }

    #[tokio::test]
    async fn every_forwarded_request_carries_the_hop_header() {
        let (addr, served) = stub(2, r#"{"tokens":[5,6]}"#).await;
        let client = client();
        let timeout = Duration::from_secs(10);
        // As /tokenize forwards a body (tokenize::http).
        let (status, answer) = call(&client, addr, "/tokenize", b"{}".to_vec(), timeout)
            .await
            .unwrap();
        assert_eq!(
            (status, answer.as_slice()),
            (200, br#"{"tokens":[5,6]}"#.as_slice())
        );
        // As a Pick's tokenization asks a replica.
        let ids = token_ids(
            &client,
            addr,
            Api::Completions,
            "m",
            br#"{"prompt":"hi"}"#,
            timeout,
            &AtomicBool::new(true),
        )
        .await
        .unwrap();
        assert_eq!(ids.ids, [5, 6]);
        let heads = served.await.unwrap();
        assert_eq!(heads.len(), 2);
        for head in heads {
            assert!(head.starts_with("post /tokenize "), "{head}");
            assert!(
                head.lines().any(|l| l.trim_end() == "x-kvroute-hop: 1"),
                "{head}"
            );
        }
        assert_eq!(HOP_HEADER, HOP_HEADER.to_ascii_lowercase());
    }

    #[tokio::test]
    async fn a_body_that_truncates_goes_to_render_or_is_not_tokenized() {
        assert!(truncates(br#"{"prompt":"a","truncate_prompt_tokens":3}"#));
        assert!(!truncates(
            br#"{"prompt":"a","truncate_prompt_tokens":null}"#
        ));
        assert!(!truncates(br#"{"prompt":"a"}"#));
        let raw = br#"{"prompt":"a b c","truncate_prompt_tokens":2}"#;
        let (path, body) = request(Api::Completions, Endpoint::Render, "m", raw).unwrap();
        assert_eq!(path, "/v1/completions/render");
        assert_eq!(
            String::from_utf8(body).unwrap(),
            r#"{"model":"m","prompt":"a b c","truncate_prompt_tokens":2}"#
        );
        let client = client();
        let timeout = Duration::from_secs(10);
        // Replicas with the render endpoints: completions go there.
        let (addr, served) = stub(1, r#"[{"token_ids":[7,8]}]"#).await;
        let render = AtomicBool::new(true);
        let ids = token_ids(&client, addr, Api::Completions, "m", raw, timeout, &render)
            .await
            .unwrap();
        assert_eq!(ids.ids, [7, 8]);
        assert_eq!(ids.max_model_len, None);
        let heads = served.await.unwrap();
        assert!(
            heads[0].starts_with("post /v1/completions/render "),
            "{}",
            heads[0]
        );
        // Replicas without them: /tokenize would give the untruncated
        // prompt's ids, so nothing is asked.
        let (addr, served) = stub(1, r#"{"tokens":[1]}"#).await;
        let err = token_ids(
            &client,
            addr,
            Api::Chat,
            "m",
            br#"{"messages":[],"truncate_prompt_tokens":-1}"#,
            timeout,
            &AtomicBool::new(false),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, TokenizeError::Unsupported(_)), "{err:?}");
        served.abort();
    }

    #[test]
    fn answers_of_both_endpoints() {
        assert_eq!(
            parse_ids(br#"{"count":2,"max_model_len":9,"tokens":[1,2]}"#),
            Some(vec![1, 2])
        );
        assert_eq!(
            parse_ids(br#"{"token_ids":[3],"request_id":"r"}"#),
            Some(vec![3])
        );
        assert_eq!(parse_ids(br#"[{"token_ids":[4]}]"#), Some(vec![4]));
        assert_eq!(parse_ids(br#"[{"token_ids":[4]},{"token_ids":[5]}]"#), None);
        assert_eq!(parse_ids(br#"{"tokens":[-1]}"#), None);
        assert_eq!(parse_ids(b"garbage"), None);
        // /tokenize gives the model's context length; render does not.
        assert_eq!(
            parse_answer(br#"{"count":2,"max_model_len":9,"tokens":[1,2]}"#),
            Some(Replied {
                ids: vec![1, 2],
                max_model_len: Some(9)
            })
        );
        assert_eq!(
            parse_answer(br#"{"max_model_len":0,"tokens":[1]}"#).and_then(|a| a.max_model_len),
            None
        );
        assert_eq!(
            error_message(br#"{"error":{"message":"bad","type":"BadRequestError","code":400}}"#),
            "bad"
        );
    }
}
