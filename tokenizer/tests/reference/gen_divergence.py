#!/usr/bin/env python3
"""Writes a JSONL of requests where a tokenizer written outside Python is
most likely to differ from vLLM 0.32 (deterministic per seed):

- numbers as Python's `json.loads` reads them and `json.dumps` prints them
  (through the templates' `tojson`): `-0`, `-0.0`, integers past 64 and 128
  bits, `1e400`, `NaN`, `Infinity`, subnormals, exponents, long fractions; in
  tool schemas, tool-call arguments and Responses function calls;
- `truncate_prompt_tokens`, which `/tokenize` ignores and the chat
  completion applies (endpoint "chat_render": vLLM's
  `/v1/chat/completions/render`);
- Python's Unicode case mapping and whitespace (`upper`, `lower`, `title`,
  `capitalize`, `trim`, `.strip()`, `.split()` in request-supplied chat
  templates) on text chosen where Python 3.11 and other Unicode tables or
  definitions of whitespace disagree;
- transformers' `{% generation %}` blocks (a Qwen3-style template with the
  assistant turn in one), under every whitespace control of the tags.

Each line: {"id", "endpoint": "tokenize" | "render" | "chat_render",
"kind", "may_fall_back", "body": ...} with "body" last and written raw (it
may hold `-0`, `1e400` or `NaN`, which a strict JSON reader refuses: read
the fields before it, and take the body as text). `may_fall_back` marks
requests the native tokenizer may decline (a local refusal that sends the
request to a replica) rather than match; every other request must match.
Bodies carry `chat_template` only with a tokenizer that trusts request
templates (vLLM's `--trust-request-chat-template`).

    python gen_divergence.py OUT.jsonl [--count N] [--seed S]
"""
import argparse
import json
import random

# Number texts as a client may write them. The second element: whether the
# native tokenizer may decline it (an integer wider than 128 bits).
NUMBERS = [
    ("-0", False), ("-0.0", False), ("0.0", False), ("0", False), ("-1", False),
    ("1.0", False), ("0.1", False), ("1e16", False), ("1E5", False), ("1e-7", False),
    ("0.0001", False), ("5e-324", False), ("1.7976931348623157e308", False),
    ("123456789.123456789", False), ("100000000000000000000.0", False), ("1e400", False),
    ("-1e400", False), ("NaN", False), ("Infinity", False), ("-Infinity", False),
    ("9223372036854775807", False), ("9223372036854775808", False),
    ("18446744073709551615", False), ("18446744073709551616", False),
    ("-9223372036854775809", False), ("1267650600228229401496703205376", False),
    ("170141183460469231731687303715884105727", False),
    ("-170141183460469231731687303715884105728", False),
    ("340282366920938463463374607431768211455", False),
    ("340282366920938463463374607431768211456", True),
    ("-340282366920938463463374607431768211456", True),
    ("10000000000000000000000000000000000000000000000000", True),
    ("1.5e300", False), ("2.5", False), ("-2.5e-3", False), ("3.141592653589793", False),
]

# Text where Python 3.11's str methods and jinja filters are easy to get
# wrong: special casings, title case, final sigma, characters newer than
# some Unicode tables, and every kind of whitespace `str.strip` knows.
UNICODE_TEXTS = [
    "stra\u00dfe gro\u00df", "\u0149 apostrophe-n", "\u01c5 \u01c6 \u01c4 dz digraphs",
    "\u0390 \u03b0 greek with tonos", "\ufb01 \ufb02 \ufb00 ligatures", "\u0130stanbul \u0131 dotted",
    "\u039f\u0394\u039f\u03a3 \u03a3\u0399\u03a3\u03a5\u03a6\u039f\u03a3 final sigma",
    "\u1c8a\u1c89 cyrillic new", "\u10d0\u10d1\u10d2 \u1c90\u1c91 georgian mtavruli",
    "\u13a0\u13a1 \uab70\uab71 cherokee", "they're bill's friends' o'neil", "hello2world 3rd x1y",
    "\x1c\x1d\x1e\x1f info separators \x1f", "\x85next line\x85", "\u00a0nbsp\u00a0",
    "\u2028line sep\u2029", "\u3000ideographic\u3000", "\u180emongolian vs\u180e", "\u200bzero width\u200b",
    "\u2000\u2001\u2002\u200a en quads \u202f\u205f", "\t\n\x0b\x0c\r mixed ascii ws \r\n",
    "e\u0301 combining \u0345 ypogegrammeni", "\U0001e900\U0001e922 adlam", "\U00010400\U00010428 deseret",
    "\u1e9e capital sharp s", "\u2126 ohm \u212a kelvin \u212b angstrom", "\u0587 ech yiwn", "\u1f80 \u1fb3 \u1ff3 greek iota",
    "\u24b6\u24d0 circled", "\uff21\uff41 fullwidth", "\u2160\u2170 roman numerals", "plain ascii Words Here",
]

# Request-supplied chat templates applying Python's string functions to the
# messages. The second element: whether the native tokenizer may decline
# them (functions it does not reproduce, such as `split`).
TEMPLATES = [
    ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] | upper }}\n{% endfor %}", False),
    ("{% for m in messages %}{{ m['content'] | lower }}|{{ m['content'] | title }}\n{% endfor %}", False),
    ("{% for m in messages %}{{ m['content'] | capitalize }}<{{ m['content'] | trim }}>\n{% endfor %}", False),
    ("{% for m in messages %}<{{ m['content'].strip() }}>({{ m['content'].upper() }})\n{% endfor %}", False),
    ("{% for m in messages %}{{ m['content'].lower() }}/{{ m['content'].title() }}\n{% endfor %}", False),
    ("{% for m in messages %}{{ m['content'].split() | join('_') }}\n{% endfor %}", True),
    ("{% for m in messages %}{{ m.content | trim | upper }}{% if not loop.last %}\n{% endif %}{% endfor %}"
     "{% if add_generation_prompt %}\nA:{% endif %}", False),
]

TOOL_NAMES = ["get_weather", "search", "read_file"]

# A Qwen3-style chat template whose assistant turn sits in transformers'
# `{% generation %}` block (its AssistantTracker extension), which marks a
# span and changes no text. The block is a scope of its own: `content` and
# `reasoning_content` set inside it do not reach the line after it, while
# the namespace's counter does. String literals and comments name the tags
# too, which stay text.
GENERATION_TEMPLATE = """{%- set tag_text = '{% generation %} and {% endgeneration %}' %}
{#- {% generation %} in a comment #}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1, turns=0) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        @OPEN@
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>' }}
        {%- set ns.turns = ns.turns + 1 %}
        @CLOSE@
        {{- '\\n' }}
        {{- '<!-- ' ~ (content | length) ~ ' ' ~ (reasoning_content is defined) ~ ' -->\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{{- '<!-- turns ' ~ ns.turns ~ ' -->' }}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# The generation tags with each whitespace control: none (the environment's
# trim_blocks and lstrip_blocks alone), `-` before, `-` on both sides, `+`
# (whitespace kept), and inline in text.
GENERATION_TAGS = [
    ("{% generation %}", "{% endgeneration %}"),
    ("{%- generation %}", "{%- endgeneration %}"),
    ("{%- generation -%}", "{%- endgeneration -%}"),
    ("{%+ generation +%}\n", "{%+ endgeneration +%}\n"),
    ("{%- generation: -%}\n   [", "]\n  {%generation%}{%endgeneration%}  {% endgeneration %}"),
]
GENERATION_TEMPLATES = [GENERATION_TEMPLATE.replace("@OPEN@", o).replace("@CLOSE@", c)
                        for o, c in GENERATION_TAGS]


class Raw:
    """A number written as its text into the JSON."""

    def __init__(self, text):
        self.text = text


def dumps(v):
    """JSON text with each Raw written as its text."""
    if isinstance(v, Raw):
        return v.text
    if isinstance(v, dict):
        return "{" + ", ".join(json.dumps(k, ensure_ascii=False) + ": " + dumps(x) for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(dumps(x) for x in v) + "]"
    return json.dumps(v, ensure_ascii=False)


def pick_numbers(rng, n):
    chosen = [rng.choice(NUMBERS) for _ in range(n)]
    return [t for t, _ in chosen], any(wide for _, wide in chosen)


def schema(rng, nums):
    props = {}
    for i, t in enumerate(nums):
        props[f"p{i}"] = {"type": "number", rng.choice(["minimum", "maximum", "default", "multipleOf"]): Raw(t)}
    return {"type": "object", "properties": props, "required": list(props)[:1]}


def numbers_chat(rng):
    nums, wide = pick_numbers(rng, rng.randint(1, 4))
    fn = {"name": rng.choice(TOOL_NAMES), "description": "numbers", "parameters": schema(rng, nums)}
    args_nums, wide2 = pick_numbers(rng, rng.randint(1, 3))
    arguments = "{" + ", ".join(f'"a{i}": {t}' for i, t in enumerate(args_nums)) + "}"
    msgs = [{"role": "user", "content": "use the tool"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "call_0", "type": "function",
                             "function": {"name": fn["name"], "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": "done"}]
    body = {"messages": msgs, "tools": [{"type": "function", "function": fn}]}
    # Arguments are a string: json.loads reads them, so wide integers there
    # decline as in the body.
    return body, wide or wide2


def numbers_responses(rng):
    nums, wide = pick_numbers(rng, rng.randint(1, 4))
    tool = {"type": "function", "name": rng.choice(TOOL_NAMES), "description": "numbers",
            "parameters": schema(rng, nums)}
    args_nums, wide2 = pick_numbers(rng, rng.randint(1, 3))
    arguments = "{" + ", ".join(f'"a{i}": {t}' for i, t in enumerate(args_nums)) + "}"
    items = [{"role": "user", "content": "use the tool"},
             {"type": "function_call", "call_id": "fc_0", "name": tool["name"], "arguments": arguments},
             {"type": "function_call_output", "call_id": "fc_0", "output": "done"}]
    return {"input": items, "tools": [tool]}, wide or wide2


def unicode_text(rng):
    parts = [rng.choice(UNICODE_TEXTS) for _ in range(rng.randint(1, 3))]
    return rng.choice([" ", "", "\n", "\x1f"]).join(parts)


def unicode_chat(rng):
    template, may = rng.choice(TEMPLATES)
    msgs = [{"role": "user", "content": unicode_text(rng)}]
    if rng.random() < 0.5:
        msgs.insert(0, {"role": "system", "content": unicode_text(rng)})
    if rng.random() < 0.4:
        msgs.append({"role": "assistant", "content": unicode_text(rng)})
        msgs.append({"role": "user", "content": unicode_text(rng)})
    return {"messages": msgs, "chat_template": template}, may


def generation_chat(rng, template):
    msgs = []
    if rng.random() < 0.6:
        msgs.append({"role": "system", "content": "be brief"})
    for turn in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": rng.choice(["hi", "what is the weather?", " spaced \n text "])})
        reply = {"role": "assistant", "content": rng.choice([
            "fine", "<think>\nlet me see\n</think>\n\nsunny", "", "  two\n\nlines  "])}
        if rng.random() < 0.3:
            reply["reasoning"] = rng.choice(["thought", "\nstep\n"])
        if rng.random() < 0.3:
            reply["tool_calls"] = [{"id": f"call_{turn}", "type": "function", "function": {
                "name": rng.choice(TOOL_NAMES), "arguments": rng.choice(['{"city": "Paris"}', "{}"])}}]
            msgs.append(reply)
            msgs.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": "22C"})
        else:
            msgs.append(reply)
    body = {"messages": msgs, "chat_template": template}
    if rng.random() < 0.3:
        body["tools"] = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                         for n in TOOL_NAMES[:2]]
        body["tool_choice"] = "none"
    if rng.random() < 0.2:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    if rng.random() < 0.15 and msgs[-1]["role"] == "assistant" and msgs[-1]["content"]:
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    return body


def truncating_chat(rng):
    msgs = [{"role": "user", "content": unicode_text(rng) + " and some ordinary words to cut"}]
    body = {"messages": msgs, "truncate_prompt_tokens": rng.choice([1, 3, 8, 100000, -1, None])}
    if rng.random() < 0.3:
        body["truncation_side"] = rng.choice(["left", "right"])
    return body


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--count", type=int, default=400)
    ap.add_argument("--seed", type=int, default=38)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    n = 0
    with open(a.out, "w", encoding="utf-8") as f:
        def put(endpoint, kind, may, body):
            nonlocal n
            head = json.dumps({"id": n, "endpoint": endpoint, "kind": kind, "may_fall_back": may})
            f.write(head[:-1] + ", \"body\": " + dumps(body) + "}\n")
            n += 1
        # Every number alone first, in both places, then mixtures.
        for text, wide in NUMBERS:
            fn = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"default": Raw(text)}}}}
            put("tokenize", "number", wide, {"messages": [{"role": "user", "content": "n"}],
                                             "tools": [{"type": "function", "function": fn}]})
            put("render", "number", wide, {"input": "n", "tools": [{"type": "function", **fn}]})
        # Every text under every template.
        for text in UNICODE_TEXTS:
            for template, may in TEMPLATES:
                put("tokenize", "unicode", may,
                    {"messages": [{"role": "user", "content": text}], "chat_template": template})
        for _ in range(a.count):
            r = rng.random()
            if r < 0.3:
                body, may = numbers_chat(rng)
                endpoint = rng.choice(["tokenize", "chat_render"])
                if endpoint == "chat_render":
                    # A chat completion with tools and the default "auto"
                    # needs a server started with a tool-call parser.
                    body["tool_choice"] = "none"
                put(endpoint, "number", may, body)
            elif r < 0.5:
                body, may = numbers_responses(rng)
                put("render", "number", may, body)
            elif r < 0.85:
                body, may = unicode_chat(rng)
                put(rng.choice(["tokenize", "chat_render"]), "unicode", may, body)
            else:
                body = truncating_chat(rng)
                # /tokenize ignores it; the chat completion applies it, and
                # the native tokenizer declines it there.
                endpoint = rng.choice(["tokenize", "chat_render"])
                may = endpoint == "chat_render" and body["truncate_prompt_tokens"] is not None
                put(endpoint, "truncate", may, body)
        # Generation tags, last (the requests above keep their ids).
        grng = random.Random(a.seed)
        for template in GENERATION_TEMPLATES:
            for _ in range(8):
                put(grng.choice(["tokenize", "chat_render"]), "generation", False,
                    generation_chat(grng, template))


if __name__ == "__main__":
    main()
