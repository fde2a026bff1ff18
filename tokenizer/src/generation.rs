//! transformers' `{% generation %}` … `{% endgeneration %}` tag (its
//! `AssistantTracker` Jinja extension). The tag marks the assistant's span
//! for `return_assistant_tokens_mask` and changes no text. Jinja2 compiles it
//! as a call block whose body is the `caller` macro: the body is a scope of
//! its own (a `set` inside does not reach outside, a namespace's attributes
//! do) and a `break` or `continue` there cannot reach an enclosing loop (the
//! template does not compile). minijinja's `with` block is such a scope, so
//! the tags become one before the template compiles (`{%- generation %}`
//! reads `{%- with %}`, whitespace control and line breaks kept), and a loop
//! control directly in the body is refused here. minijinja's own call block
//! would not do: its macros do not capture a namespace the body only assigns
//! to.
//!
//! Only tags are read: the words inside string literals, comments and raw
//! blocks stay text, as Jinja2's lexer leaves them. A tag Jinja2 would not
//! parse (`{% generation x %}`) is left as it is, and fails to compile here
//! too.

use std::borrow::Cow;

/// `source` with every `generation` / `endgeneration` tag as a `with`
/// block, or Jinja2's compile error for a loop control the body's scope
/// cuts off from its loop.
pub fn rewrite(source: &str) -> Result<Cow<'_, str>, String> {
    if !source.contains("generation") {
        return Ok(Cow::Borrowed(source));
    }
    let mut out = String::with_capacity(source.len());
    let mut copied = 0;
    let mut pos = 0;
    // Open `for` (true) and `generation` (false) blocks, innermost last.
    let mut open: Vec<bool> = Vec::new();
    while let Some(at) = find_from(source, pos, "{") {
        let after = at + 1;
        pos = match source.as_bytes().get(after) {
            Some(b'#') => find_from(source, after + 1, "#}").map_or(source.len(), |e| e + 2),
            Some(b'{') => expression_end(source, after + 1, b'}'),
            Some(b'%') => {
                let tag = block(source, at);
                match tag.name {
                    "for" => open.push(true),
                    "endfor" if open.last() == Some(&true) => drop(open.pop()),
                    "break" | "continue" if open.last() == Some(&false) => {
                        return Err(format!("'{}' outside loop", tag.name));
                    }
                    _ => {}
                }
                if let Some(opens) = tag.generation {
                    if opens {
                        open.push(false);
                    } else if open.last() == Some(&false) {
                        open.pop();
                    }
                    out.push_str(source.get(copied..tag.span.0).unwrap_or_default());
                    out.push_str(if opens { "with" } else { "endwith" });
                    let rest = source.get(tag.span.1..tag.end).unwrap_or_default();
                    out.extend(rest.chars().filter(|&c| c != ':'));
                    copied = tag.end;
                }
                tag.end
            }
            _ => after,
        };
    }
    if copied == 0 {
        return Ok(Cow::Borrowed(source));
    }
    out.push_str(source.get(copied..).unwrap_or_default());
    Ok(Cow::Owned(out))
}

/// A `{% … %}` tag read from its `{%`.
struct Block<'a> {
    /// Its statement's name.
    name: &'a str,
    /// The name's byte range.
    span: (usize, usize),
    /// Where the tag (for `raw`, the raw block) ends.
    end: usize,
    /// A `generation` (true) or `endgeneration` (false) tag Jinja2 parses.
    generation: Option<bool>,
}

fn block(source: &str, at: usize) -> Block<'_> {
    let start = skip_space(source, skip_marker(source, at + 2));
    let rest = source.get(start..).unwrap_or_default();
    let name_len = rest
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    let name = rest.get(..name_len).unwrap_or_default();
    let span = (start, start + name_len);
    let mut tag = Block {
        name,
        span,
        end: expression_end(source, span.1, b'%'),
        generation: None,
    };
    match name {
        "raw" => tag.end = raw_end(source, span.1),
        "generation" | "endgeneration" => {
            // Jinja2 takes an optional colon after the opening name (its
            // `parse_statements`), then nothing but the tag's end.
            let mut j = skip_space(source, span.1);
            if name == "generation" && source.as_bytes().get(j) == Some(&b':') {
                j = skip_space(source, j + 1);
            }
            j = skip_marker(source, j);
            if source.get(j..).is_some_and(|r| r.starts_with("%}")) {
                tag.end = j + 2;
                tag.generation = Some(name == "generation");
            }
        }
        _ => {}
    }
    tag
}

fn find_from(source: &str, from: usize, needle: &str) -> Option<usize> {
    source.get(from..)?.find(needle).map(|i| i + from)
}

fn skip_marker(source: &str, i: usize) -> usize {
    match source.as_bytes().get(i) {
        Some(b'-' | b'+') => i + 1,
        _ => i,
    }
}

fn skip_space(source: &str, i: usize) -> usize {
    let rest = source.get(i..).unwrap_or_default();
    i + (rest.len() - rest.trim_start().len())
}

/// Where the tag or expression started before `from` ends (after its
/// `}}` or `%}`, `close` being `}` or `%`): string literals skipped, and, as
/// in Jinja2's lexer, no end while a bracket is open.
fn expression_end(source: &str, from: usize, close: u8) -> usize {
    let bytes = source.as_bytes();
    let mut depth = 0usize;
    let mut i = from;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'\'' | b'"' => {
                i += 1;
                while let Some(&c) = bytes.get(i) {
                    match c {
                        b'\\' => i += 1,
                        c if c == b => break,
                        _ => {}
                    }
                    i += 1;
                }
            }
            b if depth == 0 && b == close && bytes.get(i + 1) == Some(&b'}') => return i + 2,
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    source.len()
}

/// The end of a raw block whose `raw` name ends at `from`: after the first
/// `{% endraw %}` (any whitespace control) past the opening tag.
fn raw_end(source: &str, from: usize) -> usize {
    let Some(body) = find_from(source, from, "%}") else {
        return source.len();
    };
    let mut pos = body + 2;
    while let Some(at) = find_from(source, pos, "{%") {
        let mut i = skip_space(source, skip_marker(source, at + 2));
        if source.get(i..).is_some_and(|r| r.starts_with("endraw")) {
            i = skip_marker(source, skip_space(source, i + "endraw".len()));
            if source.get(i..).is_some_and(|r| r.starts_with("%}")) {
                return i + 2;
            }
        }
        pos = at + 2;
    }
    source.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_tags_only() {
        for (src, want) in [
            (
                "a{% generation %}b{% endgeneration %}c",
                "a{% with %}b{% endwith %}c",
            ),
            (
                "{%- generation -%}b{%+endgeneration+%}",
                "{%- with -%}b{%+endwith+%}",
            ),
            ("{%generation:%}{%endgeneration%}", "{%with%}{%endwith%}"),
            ("{%\ngeneration\n%}", "{%\nwith\n%}"),
            ("{{ '{% generation %}' }}", "{{ '{% generation %}' }}"),
            (
                "{{ {'a': {'b': '%}'}} ~ '{% generation %}' }}",
                "{{ {'a': {'b': '%}'}} ~ '{% generation %}' }}",
            ),
            ("{# {% generation %} #}", "{# {% generation %} #}"),
            (
                "{% raw %}{% generation %}{%- endraw %}",
                "{% raw %}{% generation %}{%- endraw %}",
            ),
            (
                "{% if x == \"%}{% generation %}\" %}",
                "{% if x == \"%}{% generation %}\" %}",
            ),
            (
                "{% generation x %}{% generations %}",
                "{% generation x %}{% generations %}",
            ),
            (
                "{% set generation = 1 %}{{ generation }}",
                "{% set generation = 1 %}{{ generation }}",
            ),
            ("{% generation", "{% generation"),
            ("{", "{"),
            ("{% raw %}{% generation %}", "{% raw %}{% generation %}"),
        ] {
            assert_eq!(rewrite(src).as_deref(), Ok(want), "{src}");
        }
    }

    #[test]
    fn refuses_loop_controls_cut_off_from_their_loop() {
        for src in [
            "{% for m in x %}{% generation %}{%- break %}{% endgeneration %}{% endfor %}",
            "{% for m in x %}{% generation %}{% for k in m %}{% endfor %}{% continue %}{% endgeneration %}{% endfor %}",
        ] {
            assert!(rewrite(src).is_err(), "{src}");
        }
        let nested = "{% generation %}{% for k in m %}{% break %}{% endfor %}{% endgeneration %}";
        assert!(rewrite(nested).is_ok());
    }

    fn render(src: &str) -> Result<String, String> {
        crate::template::ChatTemplate::new(src, None).and_then(|t| {
            t.render(&minijinja::Value::from(()))
                .map_err(|e| e.to_string())
        })
    }

    /// Renders each template as Jinja2 with transformers' extension does
    /// (`None`: refuses it).
    fn renders_as_transformers(cases: &[(&str, Option<&str>)]) {
        for (src, want) in cases {
            let got = render(src);
            match want {
                Some(w) => assert_eq!(got.as_deref(), Ok(*w), "{src}"),
                None => assert!(got.is_err(), "{src}: {got:?}"),
            }
        }
    }

    /// The tags' syntax and whitespace control, and their words as text.
    #[test]
    fn parses_as_transformers() {
        renders_as_transformers(&[
            (
                "a\n  {% generation %}\n  b\n  {% endgeneration %}\nc",
                Some("a\n  b\nc"),
            ),
            (
                "a\n  {%- generation -%}\n  b\n  {%- endgeneration -%}\nc",
                Some("abc"),
            ),
            (
                "a\n  {%+ generation +%}\n  b\n  {%+ endgeneration +%}\nc",
                Some("a\n  \n  b\n  \nc"),
            ),
            ("{% generation: %}x{% endgeneration %}", Some("x")),
            ("{% generation x %}x{% endgeneration %}", None),
            ("{% generation %}x{% endgeneration x %}", None),
            ("{% generation %}x", None),
            ("{{ '{% generation %}' }}", Some("{% generation %}")),
            ("{# {% generation %} #}ok", Some("ok")),
            (
                "{% raw %}{% generation %}{% endraw %}",
                Some("{% generation %}"),
            ),
            (
                "{% generation %}{% generation %}n{% endgeneration %}{% endgeneration %}",
                Some("n"),
            ),
            ("{%generation%}x{%endgeneration%}", Some("x")),
            (
                "{% if true %}{% generation %}y{% endif %}{% endgeneration %}",
                None,
            ),
        ]);
    }

    /// The body is a scope of its own, cut off from an enclosing loop's
    /// controls.
    #[test]
    fn scopes_as_transformers() {
        renders_as_transformers(&[
            (
                "{% set x = 1 %}{% generation %}{% set x = 2 %}{{ x }}{% endgeneration %}{{ x }}",
                Some("21"),
            ),
            (
                "{% set ns = namespace(a=1) %}{% generation %}{% set ns.a = 2 %}{% endgeneration %}{{ ns.a }}",
                Some("2"),
            ),
            (
                "{% for m in [1,2] %}{% generation %}{{ loop.index }}{{ m }}{% endgeneration %}{% endfor %}",
                Some("1122"),
            ),
            (
                "{% for m in [1,2,3] %}{% generation %}{% if m == 2 %}{% break %}{% endif %}{% endgeneration %}{% endfor %}",
                None,
            ),
            (
                "{% for m in [1,2,3] %}{% generation %}{% continue %}{% endgeneration %}{% endfor %}",
                None,
            ),
            (
                "{% for i in range(2) %}{% set z = i %}{% generation %}{{ z }}{% endgeneration %}{% endfor %}",
                Some("01"),
            ),
            (
                "{% macro f(a) %}{% generation %}[{{ a }}]{% endgeneration %}{% endmacro %}{{ f(3) }}",
                Some("[3]"),
            ),
            (
                "{% set y = 5 %}{% generation %}{% set y = y + 1 %}{{ y }}{% endgeneration %}{{ y }}",
                Some("65"),
            ),
            (
                "{% generation %}{% set w = 5 %}{% endgeneration %}{{ w is defined }}",
                Some("False"),
            ),
            (
                "{% generation %}{% set q = 1 %}{% generation %}{{ q }}{% set q = 2 %}{% endgeneration %}{{ q }}{% endgeneration %}",
                Some("11"),
            ),
            (
                "{% for m in [1,2] %}{% generation %}{{ loop.first }}{% endgeneration %}{% endfor %}",
                Some("TrueFalse"),
            ),
            (
                "{% set y = 5 %}{% generation %}{{ y }}{% set y = 6 %}{{ y }}{% endgeneration %}{{ y }}",
                Some("565"),
            ),
            (
                "{% for m in [1,2,3] %}{% generation %}{% for k in [1] %}{% break %}{% endfor %}{{ m }}{% endgeneration %}{% endfor %}",
                Some("123"),
            ),
            (
                "{% generation %}{% for k in [1,2] %}{{ k }}{% else %}{% endfor %}{% break %}{% endgeneration %}",
                None,
            ),
            (
                "{% generation %}{% set ns = namespace(a=1) %}{% for k in [1,2] %}{% set ns.a = ns.a + k %}{% endfor %}{{ ns.a }}{% endgeneration %}",
                Some("4"),
            ),
            (
                "{% for m in [1,2] %}{% generation %}{% set m = 9 %}{{ m }}{% endgeneration %}{{ m }}{% endfor %}",
                Some("9192"),
            ),
            (
                "{% set x = 1 %}{% for m in [1] %}{% generation %}{% set x = 7 %}{% endgeneration %}{{ x }}{% endfor %}{{ x }}",
                Some("11"),
            ),
        ]);
    }
}
