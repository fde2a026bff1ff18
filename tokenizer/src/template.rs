//! Chat templates rendered as transformers renders them: Jinja with
//! `trim_blocks`, `lstrip_blocks` and loop controls; `tojson` being Python's
//! `json.dumps(…, ensure_ascii=False)` with `indent`, `separators` and
//! `sort_keys`; `raise_exception` and `strftime_now`; Python's string methods
//! (minijinja-contrib's pycompat); values printed as Python prints them;
//! transformers' `{% generation %}` tag (`generation`).
//! Also vLLM's detection of the template's content format.

use std::sync::{Arc, LazyLock};

use minijinja::value::{Kwargs, Rest, Value};
use minijinja::{Environment, Error as JinjaError, ErrorKind, State, UndefinedBehavior};
use regex::Regex;

use crate::error::{InexactKind, RequestError};
use crate::generation;
use crate::json::{DumpOptions, dumps, py_str};
use crate::pystr;

/// How vLLM hands message content to the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// Text parts joined with `"\n"` into one string.
    String,
    /// A list of `{"type": "text", "text": …}` parts.
    OpenAi,
}

/// Instructions a template may execute per render: bounds the work a hostile
/// conversation can cause (a 32k-token chat uses well under a million).
const FUEL: u64 = 50_000_000;

/// A compiled chat template and what vLLM reads off its source.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    source: Arc<str>,
    /// vLLM's detected content format.
    pub format: ContentFormat,
    /// The source names the role "developer" (else vLLM turns developer
    /// messages into system messages).
    pub knows_developer: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("format", &self.format)
            .field("knows_developer", &self.knows_developer)
            .field("len", &self.source.len())
            .finish()
    }
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`; `format` overrides the detected content format.
    pub fn new(source: &str, format: Option<ContentFormat>) -> Result<Self, String> {
        let mut env = Environment::new();
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        syntax.trim_blocks(true).lstrip_blocks(true);
        env.set_syntax(syntax.build().map_err(|e| e.to_string())?);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(python_methods);
        env.set_formatter(|out, _state, value| {
            let written = match value.as_str() {
                Some(text) => out.write_str(text),
                None => {
                    let mut s = String::new();
                    py_str(&mut s, value);
                    out.write_str(&s)
                }
            };
            written.map_err(|_| JinjaError::new(ErrorKind::WriteFailure, "write"))
        });
        env.add_filter("tojson", tojson);
        env.add_filter("upper", |v: Value| Value::from(pystr::upper(&soft_str(&v))));
        env.add_filter("lower", |v: Value| Value::from(pystr::lower(&soft_str(&v))));
        env.add_filter("title", |v: Value| {
            Value::from(pystr::jinja_title(&soft_str(&v)))
        });
        env.add_filter("capitalize", |v: Value| {
            Value::from(pystr::capitalize(&soft_str(&v)))
        });
        env.add_filter("trim", |v: Value, chars: Option<String>| {
            let s = soft_str(&v);
            Value::from(pystr::strip(&s, chars.as_deref(), pystr::Ends::Both))
        });
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let owned: String = generation::rewrite(source)?.into_owned();
        env.add_template_owned(NAME, owned)
            .map_err(|e| e.to_string())?;
        Ok(Self {
            env: Arc::new(env),
            source: Arc::from(source),
            format: format.unwrap_or_else(|| detect_content_format(source)),
            knows_developer: source.contains("\"developer\"") || source.contains("'developer'"),
        })
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders with `ctx` (a map of the template's variables): a
    /// [`RequestError::Template`] when the template fails, as in Python, or
    /// [`RequestError::Inexact`] where it used a string function whose
    /// Python result is not reproduced here.
    pub fn render(&self, ctx: &Value) -> Result<String, RequestError> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| RequestError::Template(e.to_string()))?;
        tmpl.render(ctx).map_err(|e| match not_reproduced(&e) {
            Some(detail) => RequestError::Inexact {
                kind: InexactKind::Text,
                detail,
            },
            None => RequestError::Template(template_error(&e)),
        })
    }
}

/// A template string function whose Python result is not reproduced,
/// carried as the source of the template error.
#[derive(Debug)]
struct NotReproduced(String);

impl std::fmt::Display for NotReproduced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NotReproduced {}

fn not_reproduced(e: &JinjaError) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(n) = err.downcast_ref::<NotReproduced>() {
            return Some(n.0.clone());
        }
        cur = err.source();
    }
    None
}

fn inexact(detail: String) -> JinjaError {
    JinjaError::new(ErrorKind::InvalidOperation, detail.clone()).with_source(NotReproduced(detail))
}

/// Jinja2's `soft_str`: strings as they are, anything else as Python's
/// `str()` prints it (undefined: empty).
fn soft_str(v: &Value) -> String {
    match v.as_str() {
        Some(s) => s.to_owned(),
        None => {
            let mut out = String::new();
            py_str(&mut out, v);
            out
        }
    }
}

/// Python `str` methods minijinja-contrib's pycompat does not have: a
/// template calling one renders in Python but not here.
const UNREPRODUCED_STR_METHODS: &[&str] = &[
    "casefold",
    "swapcase",
    "istitle",
    "isdecimal",
    "isidentifier",
    "isprintable",
    "center",
    "ljust",
    "rjust",
    "zfill",
    "expandtabs",
    "partition",
    "rpartition",
    "rsplit",
    "index",
    "rindex",
    "encode",
    "translate",
    "maketrans",
    "removeprefix",
    "removesuffix",
    "format_map",
];

/// Python's string methods: those whose result depends on Unicode data
/// from Python 3.11's tables ([`pystr`]); the Unicode predicates pycompat
/// approximates, on ASCII text only; the rest from minijinja-contrib's
/// pycompat (as for maps and lists).
fn python_methods(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, JinjaError> {
    use minijinja::value::from_args;
    let Some(s) = value.as_str() else {
        return minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args);
    };
    match method {
        "upper" | "lower" | "title" | "capitalize" | "isspace" | "isupper" | "islower" => {
            let () = from_args(args)?;
            Ok(match method {
                "upper" => Value::from(pystr::upper(s)),
                "lower" => Value::from(pystr::lower(s)),
                "title" => Value::from(pystr::title(s)),
                "capitalize" => Value::from(pystr::capitalize(s)),
                "isspace" => Value::from(pystr::isspace(s)),
                "isupper" => Value::from(pystr::isupper(s)),
                _ => Value::from(pystr::islower(s)),
            })
        }
        "strip" | "lstrip" | "rstrip" => {
            let (chars,): (Option<&str>,) = from_args(args)?;
            let ends = match method {
                "strip" => pystr::Ends::Both,
                "lstrip" => pystr::Ends::Start,
                _ => pystr::Ends::End,
            };
            Ok(Value::from(pystr::strip(s, chars, ends)))
        }
        "split" if args.first().is_none_or(Value::is_none) => {
            let (_, maxsplit): (Option<Value>, Option<i64>) = from_args(args)?;
            Ok(pystr::split_whitespace(s, maxsplit.unwrap_or(-1))
                .into_iter()
                .map(Value::from)
                .collect())
        }
        "splitlines" => {
            let (keepends,): (Option<bool>,) = from_args(args)?;
            Ok(pystr::splitlines(s, keepends.unwrap_or(false))
                .into_iter()
                .map(Value::from)
                .collect())
        }
        "isdigit" | "isnumeric" | "isalnum" | "isalpha" if !s.is_ascii() => {
            Err(inexact(format!("str.{method}() of non-ASCII text")))
        }
        m if UNREPRODUCED_STR_METHODS.contains(&m) => Err(inexact(format!("str.{method}()"))),
        _ => minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args),
    }
}

/// The message Jinja would raise: `raise_exception` carries the template's
/// own text.
fn template_error(e: &JinjaError) -> String {
    match e.detail() {
        Some(detail) if e.kind() == ErrorKind::InvalidOperation => detail.to_owned(),
        _ => e.to_string(),
    }
}

fn raise_exception(message: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

fn tojson(value: Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, JinjaError> {
    let bad = |m: String| JinjaError::new(ErrorKind::InvalidOperation, m);
    let mut opts = DumpOptions::default();
    let mut positional = args.iter();
    let indent: Option<Value> = match positional.next() {
        Some(v) => Some(v.clone()),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    if let Some(ind) = indent.filter(|v| !v.is_none()) {
        opts.indent = Some(match ind.as_i64() {
            Some(n) => " ".repeat(usize::try_from(n).unwrap_or(0)),
            None => ind
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| bad("indent must be an int or str".into()))?,
        });
    }
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    if ensure_ascii == Some(true) {
        return Err(bad("tojson(ensure_ascii=True) is not supported".into()));
    }
    if let Some(seps) = kwargs
        .get::<Option<Value>>("separators")?
        .filter(|v| !v.is_none())
    {
        let parts: Vec<String> = seps
            .try_iter()?
            .map(|s| s.as_str().map(str::to_owned).unwrap_or_default())
            .collect();
        if let [item, key] = parts.as_slice() {
            opts.separators = Some((item.clone(), key.clone()));
        } else {
            return Err(bad("separators must be a pair".into()));
        }
    }
    opts.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    dumps(&value, &opts).map(Value::from).map_err(bad)
}

fn strftime_now(_state: &State, format: String) -> Result<Value, JinjaError> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(Value::from(crate::clock::strftime_utc(secs, &format)))
}

static SET_ALIAS: LazyLock<Option<Regex>> =
    LazyLock::new(|| Regex::new(r"\{%-?\s*set\s+(\w+)\s*=\s*(\w+)\s*(?:[\[|%-]|\}|$)").ok());
static FOR_IN: LazyLock<Option<Regex>> = LazyLock::new(|| {
    Regex::new(r#"\{%-?\s*for\s+(\w+)\s+in\s+(\w+)(?:\s*\.\s*(\w+)|\s*\[\s*['"](\w+)['"]\s*\])?"#)
        .ok()
});

/// vLLM's content-format detection, read off the source: "openai" when the
/// template loops over a message's `content` (`for x in message['content']`,
/// `message.content`, or a loop over a variable named `content`), where a
/// message is a loop variable over `messages` or an alias of it; "string"
/// otherwise.
pub fn detect_content_format(source: &str) -> ContentFormat {
    let (Some(set_alias), Some(for_in)) = (SET_ALIAS.as_ref(), FOR_IN.as_ref()) else {
        return ContentFormat::String;
    };
    let mut lists = vec!["messages".to_owned()];
    loop {
        let before = lists.len();
        for c in set_alias.captures_iter(source) {
            if let (Some(lhs), Some(rhs)) = (c.get(1), c.get(2))
                && lists.iter().any(|l| l == rhs.as_str())
                && !lists.iter().any(|l| l == lhs.as_str())
            {
                lists.push(lhs.as_str().to_owned());
            }
        }
        if lists.len() == before {
            break;
        }
    }
    let mut message_vars = Vec::new();
    for c in for_in.captures_iter(source) {
        if let (Some(target), Some(iter)) = (c.get(1), c.get(2))
            && c.get(3).is_none()
            && c.get(4).is_none()
            && lists.iter().any(|l| l == iter.as_str())
        {
            message_vars.push(target.as_str().to_owned());
        }
    }
    for c in for_in.captures_iter(source) {
        let iter = c.get(2).map(|m| m.as_str()).unwrap_or_default();
        let field = c.get(3).or_else(|| c.get(4)).map(|m| m.as_str());
        let over_content = match field {
            Some("content") => message_vars.iter().any(|m| m == iter),
            Some(_) => false,
            None => iter == "content",
        };
        if over_content {
            return ContentFormat::OpenAi;
        }
    }
    ContentFormat::String
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, ctx: Value) -> String {
        ChatTemplate::new(src, None).unwrap().render(&ctx).unwrap()
    }

    #[test]
    fn detects_content_formats() {
        use ContentFormat::*;
        for (src, want) in [
            (
                "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                String,
            ),
            (
                "{% for m in messages %}{% for c in m['content'] %}{% endfor %}{% endfor %}",
                OpenAi,
            ),
            (
                "{% for m in messages %}{% for c in m.content %}{% endfor %}{% endfor %}",
                OpenAi,
            ),
            (
                "{%- set msgs = messages %}{% for m in msgs %}{% for p in m[\"content\"] %}{% endfor %}{% endfor %}",
                OpenAi,
            ),
            (
                "{% macro r(content) %}{% for p in content %}{% endfor %}{% endmacro %}",
                OpenAi,
            ),
            (
                "{% for m in messages %}{{ m['content'] | map(attribute='text') | join('') }}{% endfor %}",
                String,
            ),
        ] {
            assert_eq!(detect_content_format(src), want, "{src}");
        }
    }

    #[test]
    fn renders_as_python_jinja() {
        let ctx = crate::loads::parse(
            r#"{"a": true, "b": null, "x": [1, "y"], "f": 1.0, "t": {"k": "é", "n": 1}}"#
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(
            render("{{ a }} {{ b }} {{ x }} {{ f }}", ctx.clone()),
            "True None [1, 'y'] 1.0"
        );
        assert_eq!(
            render("{{ t | tojson }}|{{ t | tojson(indent=2) }}", ctx.clone()),
            "{\"k\": \"é\", \"n\": 1}|{\n  \"k\": \"é\",\n  \"n\": 1\n}"
        );
        assert_eq!(
            render(
                "{{ t.get('k') }}{{ t.get('zz', 'd') }} {{ '  s '.strip() }}",
                ctx.clone()
            ),
            "éd s"
        );
        assert_eq!(
            render(
                "{% for i in x %}{% if loop.first %}{% continue %}{% endif %}{{ i }}{% endfor %}",
                ctx.clone()
            ),
            "y"
        );
        // trim_blocks and lstrip_blocks
        assert_eq!(
            render("a\n  {% if a %}\nb\n  {% endif %}\nc", ctx.clone()),
            "a\nb\nc"
        );
        let err = ChatTemplate::new("{{ raise_exception('no ' ~ 'way') }}", None)
            .unwrap()
            .render(&ctx)
            .unwrap_err();
        assert_eq!(err, RequestError::Template("no way".into()));
    }

    #[test]
    fn string_functions_are_python_3_11s() {
        let ctx = crate::loads::parse(
            r#"{"t": "\u001c a \u001f", "k": "\u1c8a stra\u00dfe", "g": "\u039f\u0394\u039f\u03a3 don't"}"#
                .as_bytes(),
        )
        .unwrap();
        let r = |src: &str| render(src, ctx.clone());
        assert_eq!(
            r("[{{ t.strip() }}|{{ t | trim }}|{{ t.lstrip() }}]"),
            "[a|a|a \u{1f}]"
        );
        assert_eq!(
            r("{{ k.upper() }}|{{ k | upper }}"),
            "\u{1c8a} STRASSE|\u{1c8a} STRASSE"
        );
        assert_eq!(
            r("{{ g.lower() }}|{{ g | lower }}"),
            "οδος don't|οδος don't"
        );
        assert_eq!(
            r("{{ g.title() }}|{{ g | title }}"),
            "Οδος Don'T|Οδος Don't"
        );
        assert_eq!(
            r("{{ g.capitalize() }}|{{ g | capitalize }}"),
            "Οδος don't|Οδος don't"
        );
        assert_eq!(
            r("{{ t.split() }}|{{ 'a\\rb'.splitlines() }}"),
            "['a']|['a', 'b']"
        );
        assert_eq!(r("{{ 'AB'.isalpha() }} {{ ' '.isspace() }}"), "True True");
    }

    #[test]
    fn unreproduced_string_functions_are_refused_as_inexact() {
        let ctx = Value::from(());
        for src in [
            "{{ 'é'.isalpha() }}",
            "{{ 'x'.casefold() }}",
            "{% set y = 'é'.isdigit() %}",
        ] {
            let err = ChatTemplate::new(src, None)
                .unwrap()
                .render(&ctx)
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    RequestError::Inexact {
                        kind: InexactKind::Text,
                        ..
                    }
                ),
                "{src}: {err:?}"
            );
        }
        // A missing method stays a template error.
        let err = ChatTemplate::new("{{ 'x'.nope() }}", None)
            .unwrap()
            .render(&ctx)
            .unwrap_err();
        assert!(matches!(err, RequestError::Template(_)), "{err:?}");
    }
}
