//! JSON the way Python writes it: `json.dumps` for the templates' `tojson`,
//! and `str()` for values printed with `{{ … }}` (request bodies are read in
//! `loads`).

use std::fmt::Write as _;

use minijinja::Value;
use minijinja::value::ValueKind;

use crate::loads::MAX_DEPTH;

/// Options of Python's `json.dumps` that chat templates pass to `tojson`.
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    /// `indent`: `None`, a number of spaces or a string.
    pub indent: Option<String>,
    /// `separators`: (item, key) separators; Python's defaults when `None`.
    pub separators: Option<(String, String)>,
    /// `sort_keys`.
    pub sort_keys: bool,
}

/// `json.dumps(value, ensure_ascii=False, …)`.
pub fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, String> {
    let (item_sep, key_sep) = match &opts.separators {
        Some((i, k)) => (i.clone(), k.clone()),
        None if opts.indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let mut out = String::new();
    let seps = Seps {
        item: &item_sep,
        key: &key_sep,
        indent: opts.indent.as_deref(),
        sort: opts.sort_keys,
    };
    dump_into(&mut out, value, &seps, 0)?;
    Ok(out)
}

struct Seps<'a> {
    item: &'a str,
    key: &'a str,
    indent: Option<&'a str>,
    sort: bool,
}

fn newline(out: &mut String, indent: Option<&str>, level: usize) {
    if let Some(ind) = indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn dump_into(out: &mut String, value: &Value, seps: &Seps<'_>, level: usize) -> Result<(), String> {
    if level > MAX_DEPTH * 2 {
        return Err("value nests too deeply for tojson".to_owned());
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Undefined => return Err("Undefined is not JSON serializable".to_owned()),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => push_number(out, value, true),
        ValueKind::String => push_json_str(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter().map_err(|e| e.to_string())?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            let next = level.saturating_add(1);
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(seps.item);
                }
                newline(out, seps.indent, next);
                dump_into(out, item, seps, next)?;
            }
            newline(out, seps.indent, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut pairs = Vec::new();
            for key in value.try_iter().map_err(|e| e.to_string())? {
                let v = value.get_item(&key).map_err(|e| e.to_string())?;
                pairs.push((key_string(&key)?, v));
            }
            if seps.sort {
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if pairs.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            let next = level.saturating_add(1);
            for (i, (k, v)) in pairs.iter().enumerate() {
                if i > 0 {
                    out.push_str(seps.item);
                }
                newline(out, seps.indent, next);
                push_json_str(out, k);
                out.push_str(seps.key);
                dump_into(out, v, seps, next)?;
            }
            newline(out, seps.indent, level);
            out.push('}');
        }
        _ => return Err(format!("{} is not JSON serializable", value.kind())),
    }
    Ok(())
}

/// A map key as `json.dumps` writes it (strings as they are, numbers and
/// booleans as their JSON text, `None` as `null`).
fn key_string(key: &Value) -> Result<String, String> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Number => {
            let mut s = String::new();
            push_number(&mut s, key, true);
            Ok(s)
        }
        _ => Err("keys must be str, int, float, bool or None".to_owned()),
    }
}

/// A JSON string literal with `ensure_ascii=False` escaping.
pub fn push_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A number as Python prints it (`repr`); `json` spells the non-finite
/// floats `NaN`, `Infinity`, `-Infinity`.
fn push_number(out: &mut String, value: &Value, json: bool) {
    if let Some(i) = value.as_i64()
        && value.is_integer()
    {
        let _ = write!(out, "{i}");
        return;
    }
    if value.is_integer() {
        // Integers beyond i64 (u64 or i128) print as they are.
        let _ = write!(out, "{value}");
        return;
    }
    match f64::try_from(value.clone()) {
        Ok(f) => out.push_str(&float_repr(f, json)),
        Err(_) => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(float)`: the shortest digits that round-trip, in fixed
/// notation for exponents -4 ≤ e < 16 and scientific notation otherwise.
pub fn float_repr(f: f64, json: bool) -> String {
    if f.is_nan() {
        return if json { "NaN" } else { "nan" }.to_owned();
    }
    if f.is_infinite() {
        let s = if json { "Infinity" } else { "inf" };
        return if f < 0.0 {
            format!("-{s}")
        } else {
            s.to_owned()
        };
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if negative { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        let body = if exp < 0 {
            let zeros = "0".repeat(usize::try_from(-exp - 1).unwrap_or(0));
            format!("0.{zeros}{digits}")
        } else if exp + 1 >= n {
            let zeros = "0".repeat(usize::try_from(exp + 1 - n).unwrap_or(0));
            format!("{digits}{zeros}.0")
        } else {
            let cut = usize::try_from(exp + 1).unwrap_or(0);
            let (int, frac) = digits.split_at(cut.min(digits.len()));
            format!("{int}.{frac}")
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1.min(digits.len()));
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{frac}e{esign}{:02}", exp.unsigned_abs())
    }
}

/// `str(value)` as Jinja under Python prints it: `True`, `None`, Python
/// float reprs, and `repr` of the items of lists and dicts.
pub fn py_str(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::String => out.push_str(value.as_str().unwrap_or_default()),
        _ => py_repr(out, value, 0),
    }
}

fn py_repr(out: &mut String, value: &Value, level: usize) {
    if level > MAX_DEPTH * 2 {
        out.push_str("...");
        return;
    }
    match value.kind() {
        ValueKind::None | ValueKind::Undefined => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => push_number(out, value, false),
        ValueKind::String => push_py_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(items) = value.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(out, &item, level.saturating_add(1));
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr(out, &key, level.saturating_add(1));
                    out.push_str(": ");
                    let v = value.get_item(&key).unwrap_or_default();
                    py_repr(out, &v, level.saturating_add(1));
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// `repr(str)`: single quotes unless the text holds a single quote and no
/// double quote.
fn push_py_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumps_str(json: &str, opts: &DumpOptions) -> String {
        dumps(&crate::loads::parse(json.as_bytes()).unwrap(), opts).unwrap()
    }

    #[test]
    fn floats_print_as_python_does() {
        for (f, s) in [
            (1.0, "1.0"),
            (1e100, "1e+100"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5, "-2.5"),
            (123.456, "123.456"),
            (0.1, "0.1"),
            (1.5e-7, "1.5e-07"),
        ] {
            assert_eq!(float_repr(f, true), s, "{f}");
        }
    }

    #[test]
    fn dumps_matches_python_defaults() {
        let d = DumpOptions::default();
        assert_eq!(
            dumps_str(
                r#"{"b": [1, 2.0, "é\n"], "a": {}, "c": null, "d": true}"#,
                &d
            ),
            r#"{"b": [1, 2.0, "é\n"], "a": {}, "c": null, "d": true}"#
        );
        let indented = DumpOptions {
            indent: Some("  ".into()),
            ..Default::default()
        };
        assert_eq!(
            dumps_str(r#"{"a": [1], "b": []}"#, &indented),
            "{\n  \"a\": [\n    1\n  ],\n  \"b\": []\n}"
        );
        let sorted = DumpOptions {
            sort_keys: true,
            ..Default::default()
        };
        assert_eq!(
            dumps_str(r#"{"b": 1, "a": 2}"#, &sorted),
            r#"{"a": 2, "b": 1}"#
        );
    }

    #[test]
    fn python_str_of_values() {
        let v = crate::loads::parse(br#"[true, null, 1.5, "it's", {"a": "b"}]"#).unwrap();
        let mut out = String::new();
        py_str(&mut out, &v);
        assert_eq!(out, r#"[True, None, 1.5, "it's", {'a': 'b'}]"#);
    }
}
