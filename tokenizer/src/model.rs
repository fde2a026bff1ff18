//! Reading a model directory as transformers and vLLM read it:
//! `tokenizer.json`; `tokenizer_config.json` (special tokens, explicit
//! `add_bos_token`/`add_eos_token`, which make transformers rebuild the
//! post-processor, `split_special_tokens`, `chat_template` as a string or
//! named list); `chat_template.jinja`, which wins over the config; and
//! `config.json` for the context length when the caller gives none.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::LoadError;

/// Special-token names transformers exposes to templates
/// (`special_tokens_map`).
const SPECIAL_NAMES: &[&str] = &[
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// config.json keys vLLM reads the context length from (the smallest
/// present wins; `model_max_length`, when set, wins outright).
const LEN_KEYS: &[&str] = &[
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
];

/// RoPE types whose `factor` vLLM does not apply to the derived length.
const ROPE_UNSCALED: &[&str] = &[
    "su",
    "longrope",
    "llama3",
    "yarn",
    "deepseek_yarn",
    "deepseek_llama_scaling",
];

/// What a model directory holds.
#[derive(Debug)]
pub struct ModelFiles {
    /// The tokenizer, post-processor as transformers would leave it.
    pub tokenizer: Tokenizer,
    /// `tokenizer.json`, parsed (for the boundary analysis).
    pub tokenizer_json: Json,
    /// `special_tokens_map` (name → text), in transformers' order.
    pub special_tokens: Vec<(String, String)>,
    /// The default chat template, if any.
    pub chat_template: Option<(String, String)>,
    /// Named templates from the config (name → source).
    pub named_templates: Vec<(String, String)>,
    /// The context length.
    pub max_model_len: u32,
}

fn read_json(path: &Path) -> Result<Json, LoadError> {
    let bytes = std::fs::read(path).map_err(|source| LoadError::Io {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|source| LoadError::Json {
        path: path.to_owned(),
        source,
    })
}

fn field(path: &Path, field: &str, reason: impl Into<String>) -> LoadError {
    LoadError::Field {
        path: path.to_owned(),
        field: field.to_owned(),
        reason: reason.into(),
    }
}

/// A token given as text or as an `AddedToken` object.
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

/// Loads `dir`; `max_model_len` overrides config.json.
pub fn load(dir: &Path, max_model_len: Option<u32>) -> Result<ModelFiles, LoadError> {
    let tok_path = dir.join("tokenizer.json");
    let bytes = std::fs::read(&tok_path).map_err(|source| LoadError::Io {
        path: tok_path.clone(),
        source,
    })?;
    let tokenizer_json: Json =
        serde_json::from_slice(&bytes).map_err(|source| LoadError::Json {
            path: tok_path.clone(),
            source,
        })?;
    let mut tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| LoadError::Tokenizer {
        path: tok_path.clone(),
        reason: e.to_string(),
    })?;

    let cfg_path = dir.join("tokenizer_config.json");
    let config = if cfg_path.exists() {
        read_json(&cfg_path)?
    } else {
        Json::Object(Default::default())
    };

    let mut special_tokens = Vec::new();
    for name in SPECIAL_NAMES {
        match config.get(*name) {
            None | Some(Json::Null) => {}
            Some(v) => {
                let text = token_text(v)
                    .ok_or_else(|| field(&cfg_path, name, "not a string or AddedToken"))?;
                special_tokens.push(((*name).to_owned(), text));
            }
        }
    }
    // transformers adds named and extra special tokens missing from the
    // added vocabulary, as special and not normalized.
    let mut to_add: Vec<String> = special_tokens.iter().map(|(_, t)| t.clone()).collect();
    if let Some(extra) = config
        .get("extra_special_tokens")
        .or_else(|| config.get("additional_special_tokens"))
    {
        let list: Vec<String> = match extra {
            Json::Array(a) => a.iter().filter_map(token_text).collect(),
            Json::Object(o) => o.values().filter_map(token_text).collect(),
            _ => Vec::new(),
        };
        to_add.extend(list);
    }
    let present = tokenizer.get_vocab(true);
    // `added_tokens_decoder` entries missing from tokenizer.json, with their flags.
    let mut missing: Vec<AddedToken> = Vec::new();
    if let Some(Json::Object(decoder)) = config.get("added_tokens_decoder") {
        let mut entries: Vec<(u64, &Json)> = decoder
            .iter()
            .filter_map(|(id, t)| id.parse::<u64>().ok().map(|id| (id, t)))
            .collect();
        entries.sort_by_key(|(id, _)| *id);
        for (_, t) in entries {
            let Some(content) = token_text(t) else {
                continue;
            };
            if present.contains_key(&content) {
                continue;
            }
            let flag = |k: &str, d: bool| t.get(k).and_then(Json::as_bool).unwrap_or(d);
            let special = flag("special", false);
            missing.push(
                AddedToken::from(content, special)
                    .single_word(flag("single_word", false))
                    .lstrip(flag("lstrip", false))
                    .rstrip(flag("rstrip", false))
                    .normalized(flag("normalized", !special)),
            );
        }
    }
    let named: Vec<AddedToken> = to_add
        .iter()
        .filter(|t| !present.contains_key(t.as_str()) && !missing.iter().any(|m| &m.content == *t))
        .map(|t| AddedToken::from(t.clone(), true))
        .collect();
    missing.extend(named);
    if !missing.is_empty() {
        tokenizer
            .add_special_tokens(missing)
            .map_err(|e| LoadError::Tokenizer {
                path: tok_path.clone(),
                reason: e.to_string(),
            })?;
    }
    if config.get("split_special_tokens").and_then(Json::as_bool) == Some(true) {
        tokenizer.set_encode_special_tokens(true);
    }

    let add_bos = config.get("add_bos_token").and_then(Json::as_bool);
    let add_eos = config.get("add_eos_token").and_then(Json::as_bool);
    if add_bos.is_some() || add_eos.is_some() {
        rebuild_post_processor(
            &mut tokenizer,
            &special_tokens,
            add_bos.unwrap_or(false),
            add_eos.unwrap_or(false),
            &cfg_path,
        )?;
    }

    let (chat_template, named_templates) = templates(dir, &config, &cfg_path)?;
    let max_model_len = match max_model_len {
        Some(n) => n,
        None => config_len(dir)?,
    };
    Ok(ModelFiles {
        tokenizer,
        tokenizer_json,
        special_tokens,
        chat_template,
        named_templates,
        max_model_len,
    })
}

/// transformers' `update_post_processor`: `[bos] $A [eos]`.
fn rebuild_post_processor(
    tokenizer: &mut Tokenizer,
    special: &[(String, String)],
    add_bos: bool,
    add_eos: bool,
    cfg_path: &Path,
) -> Result<(), LoadError> {
    let named = |n: &str| special.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let mut single = Vec::new();
    let mut specials = Vec::new();
    let mut push = |tok: Option<String>,
                    field_name: &str,
                    single: &mut Vec<String>|
     -> Result<(), LoadError> {
        let Some(tok) = tok else { return Ok(()) };
        let id = tokenizer
            .token_to_id(&tok)
            .ok_or_else(|| field(cfg_path, field_name, "token not in the vocabulary"))?;
        single.push(format!("{tok}:0"));
        specials.push((tok, id));
        Ok(())
    };
    if add_bos {
        push(named("bos_token"), "bos_token", &mut single)?;
    }
    single.push("$A:0".to_owned());
    if add_eos {
        push(named("eos_token"), "eos_token", &mut single)?;
    }
    let pair = format!("{} $B:1", single.join(" "));
    let processor = TemplateProcessing::builder()
        .try_single(single.join(" "))
        .and_then(|b| b.try_pair(pair))
        .map_err(|e| field(cfg_path, "add_bos_token", e))?
        .special_tokens(specials)
        .build()
        .map_err(|e| field(cfg_path, "add_bos_token", e.to_string()))?;
    tokenizer.with_post_processor(Some(processor));
    Ok(())
}

type Templates = (Option<(String, String)>, Vec<(String, String)>);

/// The default template (origin, source) and the named ones.
fn templates(dir: &Path, config: &Json, cfg_path: &Path) -> Result<Templates, LoadError> {
    let mut named = Vec::new();
    let mut default = None;
    match config.get("chat_template") {
        None | Some(Json::Null) => {}
        Some(Json::String(s)) => {
            default = Some((format!("{}: chat_template", cfg_path.display()), s.clone()))
        }
        Some(Json::Array(list)) => {
            for t in list {
                let name = t.get("name").and_then(Json::as_str);
                let src = t.get("template").and_then(Json::as_str);
                match (name, src) {
                    (Some(n), Some(s)) => named.push((n.to_owned(), s.to_owned())),
                    _ => {
                        return Err(field(
                            cfg_path,
                            "chat_template",
                            "list items need `name` and `template`",
                        ));
                    }
                }
            }
            if let Some((_, s)) = named.iter().find(|(n, _)| n == "default") {
                default = Some((
                    format!("{}: chat_template[default]", cfg_path.display()),
                    s.clone(),
                ));
            }
        }
        Some(_) => {
            return Err(field(
                cfg_path,
                "chat_template",
                "not a string or a list of named templates",
            ));
        }
    }
    let jinja: PathBuf = dir.join("chat_template.jinja");
    if jinja.exists() {
        let src = std::fs::read_to_string(&jinja).map_err(|source| LoadError::Io {
            path: jinja.clone(),
            source,
        })?;
        default = Some((jinja.display().to_string(), src));
    }
    Ok((default, named))
}

/// vLLM's derived `max_model_len`: the smallest length key (or
/// `model_max_length` when set), times the RoPE scaling factor for RoPE types
/// that do not scale `max_position_embeddings` themselves; LongRoPE models
/// default to `original_max_position_embeddings`.
fn config_len(dir: &Path) -> Result<u32, LoadError> {
    let path = dir.join("config.json");
    let none = || LoadError::NoMaxModelLen(LEN_KEYS.join(", "));
    if !path.exists() {
        return Err(none());
    }
    let config = read_json(&path)?;
    let cfg = config.get("text_config").unwrap_or(&config);
    let mut len = LEN_KEYS
        .iter()
        .filter_map(|k| cfg.get(*k).and_then(Json::as_f64))
        .reduce(f64::min)
        .ok_or_else(none)?;
    if let Some(m) = cfg
        .get("model_max_length")
        .and_then(Json::as_f64)
        .filter(|m| *m > 0.0)
    {
        len = m;
    }
    let rope = cfg
        .get("rope_parameters")
        .or_else(|| cfg.get("rope_scaling"))
        .filter(|r| r.is_object());
    if let Some(rope) = rope {
        let kind = rope
            .get("rope_type")
            .or_else(|| rope.get("type"))
            .and_then(Json::as_str)
            .unwrap_or("default");
        if kind == "longrope" {
            if let Some(orig) = cfg
                .get("original_max_position_embeddings")
                .and_then(Json::as_f64)
            {
                len = orig;
            }
        } else if !ROPE_UNSCALED.contains(&kind)
            && cfg
                .get("model_type")
                .and_then(Json::as_str)
                .is_none_or(|t| !t.contains("gemma3"))
        {
            len *= rope.get("factor").and_then(Json::as_f64).unwrap_or(1.0);
        }
    }
    Ok(if len >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        len as u32
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn len_of(config: &str) -> Result<u32, LoadError> {
        let dir = std::env::temp_dir().join(format!(
            "kvroute-config-{}-{}",
            std::process::id(),
            config.len()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), config).unwrap();
        let len = config_len(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        len
    }

    #[test]
    fn context_length_as_vllm_derives_it() {
        assert_eq!(
            len_of(r#"{"max_position_embeddings": 16384}"#).unwrap(),
            16384
        );
        assert_eq!(
            len_of(r#"{"max_position_embeddings": 8192, "seq_length": 4096}"#).unwrap(),
            4096
        );
        assert_eq!(len_of(r#"{"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}"#).unwrap(), 16384);
        assert_eq!(len_of(r#"{"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}"#).unwrap(), 131072);
        assert_eq!(
            len_of(r#"{"text_config": {"n_positions": 1024}}"#).unwrap(),
            1024
        );
        assert!(matches!(
            len_of(r#"{"hidden_size": 1}"#),
            Err(LoadError::NoMaxModelLen(_))
        ));
    }
}
