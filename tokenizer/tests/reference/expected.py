#!/usr/bin/env python3
"""Token ids for the requests of gen_requests.py, computed the way vLLM 0.32
computes them, on transformers alone (no vLLM install): vLLM's chat
preprocessing (content format detection, message parsing, tool-call argument
parsing, developer roles, kwargs merging), its Responses -> chat conversion,
its Anthropic Messages -> chat conversion (checked against vLLM's own by
vllm_messages.py), then `apply_chat_template(tokenize=False)` and the encode with
vLLM's `add_special_tokens` (false for /tokenize chat unless asked, true for
completions and for Responses render: hence Responses' second BOS).

Checked against live vLLM with tests/vllm/live_ids.py on the same requests.

    python expected.py MODEL_DIR REQUESTS.jsonl OUT.jsonl [CHAT_TEMPLATE_FILE]
"""
import inspect
import json
import sys
import time
from collections import deque

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
from transformers import AutoTokenizer, PythonBackend
from transformers.utils import chat_template_utils as hf_chat

# --- vLLM's content-format detection (renderers/hf.py), on jinja2's AST ---


def _is_var_access(node, varname):
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == varname


def _is_attr_access(node, varname, key):
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var_access(node.node, varname) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node, varname, key=None):
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _assign_var_or_elems(root, varname):
    yield root, varname
    related = deque([varname])
    while related:
        name = related.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems_access(assign.node, name):
                yield assign, assign.target.name
                if assign.target.name != name:
                    related.append(assign.target.name)


def _message_items(root):
    names = [n for _, n in _assign_var_or_elems(root, "messages")]
    for loop in root.find_all(jinja2.nodes.For):
        for n in names:
            if _is_var_or_elems_access(loop.iter, n):
                yield loop, loop.target.name
                break


def _content_items(root):
    message_names = [n for _, n in _message_items(root)]
    params_by_loop, in_macros = {}, set()
    for macro in root.find_all(jinja2.nodes.Macro):
        arg_names = {a.name for a in macro.args}
        content_params = set()
        for call in root.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                for i, arg in enumerate(call.args):
                    if i < len(macro.args) and any(_is_var_or_elems_access(arg, n, "content") for n in message_names):
                        content_params.add(macro.args[i].name)
                for kw in call.kwargs:
                    if kw.key in arg_names and any(_is_var_or_elems_access(kw.value, n, "content") for n in message_names):
                        content_params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if content_params:
                params_by_loop[id(loop)] = content_params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems_access(loop.iter, n, "content") for n in message_names):
            yield loop
            continue
        params = params_by_loop.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name) and params is not None and loop.iter.name in params:
            yield loop
            continue
        if id(loop) not in in_macros and isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content":
            yield loop


def content_format(template):
    ast = hf_chat._compile_jinja_template(template).environment.parse(template)
    return "openai" if next(_content_items(ast), None) is not None else "string"


# --- vLLM's message parsing (renderers/chat_utils.py) ---

KNOWN_PART_FIELDS = {"type", "text", "image_url", "input_audio", "refusal", "file", "audio_url", "video_url",
                     "image_embeds", "audio_embeds", "video_embeds", "data", "image_pil", "uuid", "thinking",
                     "closed", "name", "image", "audio", "video", "detail", "file_id", "file_url", "filename"}
PART_TEXT = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking",
             "tool_reference": "name"}
BILLING_HEADER = "x-anthropic-billing-header"


def strip_billing_header(parts):
    """System text parts lose Claude Code's attribution line."""
    out = []
    for p in parts:
        t = p if isinstance(p, str) else (p.get("text") if p.get("type", "text") == "text" else None)
        if not (isinstance(t, str) and t.startswith(BILLING_HEADER)):
            out.append(p)
            continue
        rest = t.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(p, str) else {**p, "text": rest})
    return out


class Refused(Exception):
    pass


def pydantic_tool_calls(calls):
    """Chat requests' tool calls as pydantic leaves them: declared keys first."""
    out = []
    for c in calls:
        f = c["function"]
        fn = {"arguments": f["arguments"], "name": f["name"], **{k: v for k, v in f.items() if k not in ("arguments", "name")}}
        out.append({"id": c["id"], "function": fn, "type": c.get("type", "function"),
                    **{k: v for k, v in c.items() if k not in ("id", "function", "type")}})
    return out


def parse_message(msg, fmt, chat_origin):
    role = msg["role"]
    content = msg.get("content")
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if role == "system":
        content = strip_billing_header(content)
    texts, parts = [], []
    for part in content:
        if isinstance(part, str):
            if part or fmt != "string":
                texts.append(part)
            parts.append({"type": "text", "text": part})
            continue
        kind = part.get("type", "text")
        if kind not in PART_TEXT:
            raise Refused(f"part type {kind}")
        t = part.get(PART_TEXT[kind])
        if t is None:
            continue
        if t or fmt != "string":  # vLLM drops empty texts before joining them
            texts.append(t)
        if kind == "tool_reference":
            parts.append({"type": "tool_reference", "name": t})
            continue
        parts.append({"type": "text", "text": t, **{k: v for k, v in part.items() if k not in KNOWN_PART_FIELDS}})
    out = {"role": role, "content": "\n".join(texts) if fmt == "string" else parts}
    if role == "assistant":
        if msg.get("tool_calls") is not None:
            out["tool_calls"] = pydantic_tool_calls(msg["tool_calls"]) if chat_origin else [
                {**c, "function": dict(c["function"])} for c in msg["tool_calls"]]
        if msg.get("reasoning") is not None:
            out["reasoning"] = msg["reasoning"]
            out["reasoning_content"] = msg["reasoning"]
    elif role == "tool":
        if "tool_call_id" in msg:
            out["tool_call_id"] = msg["tool_call_id"]
        if isinstance(out["content"], list) and all(p["type"] == "text" for p in out["content"]):
            out["content"] = "\n".join(p["text"] for p in out["content"])
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    if role == "developer":
        out["tools"] = msg.get("tools")
    return out


def postprocess(conversation):
    for m in conversation:
        if m["role"] == "assistant" and "tool_calls" in m:
            if len(m["tool_calls"]) == 0:
                m.pop("tool_calls")
                continue
            for item in m["tool_calls"]:
                f = item["function"]
                a = f.get("arguments")
                if a:
                    if isinstance(a, dict):
                        parsed = a
                    else:
                        try:
                            parsed = json.loads(a)
                        except json.JSONDecodeError:
                            parsed = None
                    f["arguments"] = parsed if isinstance(parsed, dict) else {}
                else:
                    f["arguments"] = {}


def developer_to_system(conversation):
    conv = []
    for m in conversation:
        if m["role"] == "developer":
            m = dict(m, role="system")
            m.pop("tools", None)
        conv.append(m)
    system, rest, merge = [], [], False
    for i, m in enumerate(conv):
        if m["role"] == "system":
            if i > 0 or system:
                merge = True
            c = m.get("content", "")
            if isinstance(c, list):
                c = "\n".join(p["text"] if isinstance(p, dict) else p for p in c)
            if c:
                system.append(c)
        else:
            rest.append(m)
    return [{"role": "system", "content": "\n\n".join(system)}, *rest] if merge else conv


def chat_tools(tools):
    out = []
    for t in tools:
        f = t["function"]
        fn = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
        if f.get("strict") is not None:
            fn["strict"] = f["strict"]
        defer = f.get("defer_loading") if f.get("defer_loading") is not None else t.get("defer_loading")
        if defer is not None:
            fn["defer_loading"] = defer
        tool = {"type": "function", "function": fn}
        if t.get("defer_loading") is not None:
            tool["defer_loading"] = t["defer_loading"]
        out.append(tool)
    return out


# --- vLLM's Responses -> chat conversion (entrypoints/openai/responses/utils.py) ---


def responses_messages(body):
    msgs = []
    if body.get("instructions"):
        msgs.append({"role": "system", "content": body["instructions"]})
    inp = body["input"]
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
        return msgs, False
    for item in inp:
        prev = msgs[-1] if msgs and msgs[-1].get("role") == "assistant" else None
        kind = item.get("type")
        if kind == "function_call":
            call = {"id": item["call_id"], "function": {"name": item["name"], "arguments": item["arguments"]}, "type": "function"}
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call) if prev.get("tool_calls") is not None or "tool_calls" not in prev else None
                if prev.get("tool_calls") is None:
                    prev["tool_calls"] = [call]
                continue
            msgs.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "reasoning":
            r = (item.get("content") or [{}])[0].get("text") if item.get("content") else (
                item["summary"][0]["text"] if item.get("summary") else "")
            if prev is not None and prev.get("reasoning") is None:
                prev["reasoning"] = r
                continue
            msgs.append({"role": "assistant", "reasoning": r})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
        elif item.get("role") == "assistant":
            c = item.get("content")
            text = c if isinstance(c, str) else (c[0].get("text") if c else None)
            if prev is not None and prev.get("content") is None:
                prev["content"] = text
                continue
            msgs.append({"role": "assistant", "content": text})
        else:
            msgs.append(item)
    last = inp[-1] if inp else None
    cont = bool(last) and last.get("type", "message") in ("message", "reasoning") and last.get("status") in ("in_progress", "incomplete")
    return msgs, cont


def responses_tools(tools):
    if not tools:
        return None
    out = []
    for t in tools:
        if t.get("type") != "function":
            continue
        fn = {"name": t["name"], "description": t.get("description"), "parameters": t.get("parameters")}
        if t.get("strict") is not None:
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out


# --- vLLM's Messages -> chat conversion (entrypoints/anthropic/serving.py) ---

EFFORTS = ("low", "medium", "high", "xhigh", "max")
BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking",
               "tool_addition", "tool_removal")


def need(ok, why):
    if not ok:
        raise Refused(why)


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()


def opt(d, key, kinds):
    """pydantic's check of an optional field (None or one of `kinds`)."""
    v, kinds = d.get(key), kinds if isinstance(kinds, tuple) else (kinds,)
    need(v is None or isinstance(v, kinds) and not (bool not in kinds and isinstance(v, bool)), f"{key}: wrong type")
    return v


def check_tool(t):
    need(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("input_schema"), dict), "tool")
    opt(t, "description", str), opt(t, "strict", bool), opt(t, "defer_loading", bool)
    if "type" not in t["input_schema"]:
        t["input_schema"]["type"] = "object"


def check_block(b, system_role):
    need(isinstance(b, dict) and b.get("type") in BLOCK_TYPES, "block type")
    for k in ("text", "id", "tool_use_id", "name", "tool_name", "thinking", "signature", "data"):
        opt(b, k, str)
    opt(b, "source", dict), opt(b, "input", dict), opt(b, "is_error", bool)
    c = opt(b, "content", (str, list))
    need(not isinstance(c, list) or all(isinstance(i, dict) for i in c), "block content")
    if b["type"] in ("tool_addition", "tool_removal"):
        need(system_role, "tool changes are only allowed in system messages")
        t = b.get("tool")
        need(isinstance(t, dict) and t.get("type") in ("tool_reference", "tool_definition"), "tool change")
        if t["type"] == "tool_reference":
            need(isinstance(t.get("name"), str), "tool change name")
        else:
            need(b["type"] == "tool_addition", "tool_removal only accepts a tool_reference")
            check_tool(t.get("definition"))


def check_messages_body(body):
    """AnthropicMessagesRequest's validation of the fields the prompt depends on."""
    need(isinstance(body.get("model"), str) and body["model"], "Model is required")
    need(isinstance(body.get("messages"), list), "messages")
    for m in body["messages"]:
        need(isinstance(m, dict) and m.get("role") in ("user", "assistant", "system"), "role")
        need(isinstance(m.get("content"), (str, list)), "content")
        if isinstance(m["content"], list):
            for b in m["content"]:
                check_block(b, m["role"] == "system")
    need(is_int(body.get("max_tokens")) and body["max_tokens"] > 0, "max_tokens must be positive")
    system = opt(body, "system", (str, list))
    for b in system if isinstance(system, list) else []:
        check_block(b, False)
    for t in opt(body, "tools", list) or []:
        check_tool(t)
    tc = opt(body, "tool_choice", dict)
    if tc is not None:
        need(tc.get("type") in ("auto", "any", "tool", "none"), "tool_choice.type")
        opt(tc, "name", str), opt(tc, "disable_parallel_tool_use", bool)
        need(tc["type"] != "tool" or tc.get("name"), "tool_choice.name is required when type is 'tool'")
    th = opt(body, "thinking", dict)
    if th is not None:
        need(th.get("type") in ("enabled", "disabled", "adaptive"), "thinking.type")
        if th["type"] != "disabled":
            need(th.get("display") in (None, "summarized", "omitted", "updates"), "thinking.display")
        if th["type"] == "enabled":
            need(is_int(th.get("budget_tokens")) and th["budget_tokens"] >= 1024, "thinking.budget_tokens")
            kv = opt(body, "kv_transfer_params", dict)
            need(bool(kv and kv.get("do_remote_decode")) or th["budget_tokens"] < body["max_tokens"],
                 "thinking.budget_tokens must be less than max_tokens")
    oc = opt(body, "output_config", dict)
    if oc is not None:
        need(oc.get("effort") in (None, *EFFORTS), "output_config.effort")
        fmt = opt(oc, "format", dict)
        if fmt is not None:
            opt(fmt, "schema", dict)
            need(fmt.get("type", "json_schema") == "json_schema", "output_config.format.type")
    opt(body, "chat_template_kwargs", dict)
    stops = opt(body, "stop_sequences", list)
    need(stops is None or len(stops) <= 4 and all(isinstance(x, str) for x in stops), "stop_sequences")


def image_url(source):
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def system_text(content):
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [b["text"] for b in content if b["type"] == "text" and b.get("text")
             and not b["text"].startswith(BILLING_HEADER)]
    return "".join(parts) if parts else None


def user_tool_result(block, out):
    text, images, refs = "", [], []
    c = block.get("content")
    if isinstance(c, str):
        text = c
    elif isinstance(c, list):
        texts = []
        for item in c:
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image":
                url = image_url(item.get("source", {}))
                if url:
                    images.append(url)
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    refs.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text or ""})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    if refs:
        out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": refs})


def convert_blocks(msg, out):
    openai_msg, parts, calls, reasoning = {"role": msg["role"]}, [], [], []
    for b in msg["content"]:
        kind = b["type"]
        if kind == "text" and b.get("text"):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image" and b.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": image_url(b["source"])}})
        elif kind == "thinking" and b.get("thinking") is not None:
            reasoning.append(b["thinking"])
        elif kind == "tool_use":
            calls.append({"id": b.get("id") or f"call_{int(time.time())}", "type": "function",
                          "function": {"name": b.get("name") or "", "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result":
            if msg["role"] == "user":
                user_tool_result(b, out)
            else:
                parts.append({"type": "text", "text": f"Tool result: {str(b['content']) if b.get('content') else ''}"})
    if reasoning:
        openai_msg["reasoning"] = "".join(reasoning)
    if calls:
        openai_msg["tool_calls"] = calls
    if parts:
        openai_msg["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    return openai_msg


def resolve_tools(body):
    changes = [b for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]
               if b["type"] in ("tool_addition", "tool_removal")]
    if not changes:
        return body.get("tools")
    tools = {t["name"]: t for t in body.get("tools") or []}
    removed = set()
    for b in changes:
        change = b["tool"]
        if change["type"] == "tool_definition":
            name = change["definition"]["name"]
            tools[name] = change["definition"]
        else:
            name = change["name"]
            need(name in tools, f"{b['type']} references tool {name!r}, which is not declared in tools")
            if b["type"] == "tool_addition":
                tools[name] = {**tools[name], "defer_loading": None}
        if b["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [t for n, t in tools.items() if n not in removed]


def messages_chat(body, merge_inline_system, disabled_effort):
    """The chat completion request vLLM builds from a Messages body (its prompt-relevant fields)."""
    body = json.loads(json.dumps(body))
    check_messages_body(body)
    out, system = [], []
    if body.get("system"):
        if isinstance(body["system"], str):
            system.append(body["system"])
        else:
            system += [b["text"] for b in body["system"] if b["type"] == "text" and b.get("text")
                       and not b["text"].startswith(BILLING_HEADER)]
    for m in body["messages"] if merge_inline_system else []:
        if m["role"] == "system" and system_text(m["content"]):
            system.append(system_text(m["content"]))
    if system:
        out.append({"role": "system", "content": "".join(system)})
    for m in body["messages"]:
        if m["role"] == "system":
            if not merge_inline_system and system_text(m["content"]):
                out.append({"role": "system", "content": system_text(m["content"])})
            continue
        om = {"role": m["role"], "content": m["content"]} if isinstance(m["content"], str) else convert_blocks(m, out)
        if not (m["role"] == "user" and "content" not in om):
            out.append(om)
    chat = {"messages": out, "chat_template_kwargs": body.get("chat_template_kwargs"), "tool_choice": None,
            "reasoning_effort": None, "thinking_token_budget": None, "response_format": None}
    oc = body.get("output_config") or {}
    schema = (oc.get("format") or {}).get("schema")
    if schema:
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
    if oc.get("effort") is not None:
        chat["reasoning_effort"] = oc["effort"]
    th = body.get("thinking")
    if th is not None and th["type"] == "disabled":
        chat["reasoning_effort"] = disabled_effort
    elif th is not None and th["type"] == "enabled":
        chat["thinking_token_budget"] = th["budget_tokens"]
    tc = body.get("tool_choice")
    if tc is not None:
        chat["parallel_tool_calls"] = not tc.get("disable_parallel_tool_use")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(tc["type"]) or \
            {"function": {"name": tc["name"]}, "type": "function"}
    tools = resolve_tools(body)
    if tools is not None:
        chat["tools"] = [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description"), "parameters": t["input_schema"],
            **({"strict": t["strict"]} if t.get("strict") is not None else {}),
            **({"defer_loading": t["defer_loading"]} if t.get("defer_loading") is not None else {})}}
            for t in tools]
        if chat["tool_choice"] is None:
            chat["tool_choice"] = "auto"
    return chat


def detect_merge_inline_system(template):
    """vLLM's probe: a template that raises on [system, user, system, user] gets inline systems merged."""
    if not template:
        return True
    try:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.from_string(template).render(messages=[{"role": r, "content": "t"} for r in
                                                   ("system", "user", "system", "user")],
                                         add_generation_prompt=False)
        return False
    except jinja2.TemplateError:
        return True


def messages_render(tok, fmt, chat, template=None):
    conv = [parse_message(m, fmt, True) for m in chat["messages"]]
    postprocess(conv)
    tools = chat_tools(chat["tools"]) if chat.get("tools") is not None else None
    kwargs = dict(chat.get("chat_template_kwargs") or {})
    effort = chat.get("reasoning_effort")
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        if "enable_thinking" not in (chat.get("chat_template_kwargs") or {}):
            kwargs["enable_thinking"] = effort != "none"
    text, tokenized = render(tok, conv, tools, kwargs, True, False, template)
    return text, tok(text, add_special_tokens=False)["input_ids"]


def disabled_thinking_effort(tok, fmt, template=None):
    """vLLM's probe: "low" when the template refuses or ignores reasoning_effort="none"."""
    def probe(effort):
        try:
            return messages_render(tok, fmt, {"messages": [{"role": "user", "content": "Hi"}],
                                              "reasoning_effort": effort}, template)
        except Exception:
            return None
    none = probe("none")
    if none is None or any(probe(e) == none for e in EFFORTS):
        return "low"
    return "none"


MESSAGES_SETTINGS = {}


def messages_ids(tok, fmt, body, template=None):
    key = (id(tok), template)
    if key not in MESSAGES_SETTINGS:
        templates = [template] if template else [tok.get_chat_template(None, t) for t in (None, [])]
        MESSAGES_SETTINGS[key] = (any(detect_merge_inline_system(t) for t in templates),
                                  disabled_thinking_effort(tok, fmt, template))
    merge, disabled = MESSAGES_SETTINGS[key]
    chat = messages_chat(body, merge, disabled)
    return messages_render(tok, fmt, chat, template)[1]


# --- apply_chat_template as vLLM calls it ---

HF_BASE_PARAMS = frozenset(inspect.signature(PythonBackend.apply_chat_template).parameters)


class AssistantTracker(jinja2.ext.Extension):
    """The `{% generation %}` tag as vLLM parses templates for their
    variables (renderers/hf.py): transformers' extension, parse only."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)


def render(tok, conversation, tools, request_kwargs, add_generation_prompt, continue_final, template=None):
    template = template or tok.chat_template
    kw = {"tools": tools, "tokenize": False}
    merged = dict(request_kwargs or {})
    merged.update(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final)
    kw.update({k: v for k, v in merged.items() if v not in (None, "auto")})
    tools = kw.pop("tools")
    tokenize = kw.pop("tokenize")
    if any(m["role"] == "developer" for m in conversation) and \
            '"developer"' not in template and "'developer'" not in template:
        conversation = developer_to_system(conversation)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    template_vars = jinja2.meta.find_undeclared_variables(env.parse(template))
    accepted = (template_vars | HF_BASE_PARAMS) - {"chat_template", "tokenize"}
    kw = {k: v for k, v in kw.items() if k in accepted}
    text = tok.apply_chat_template(conversation, tools=tools, tokenize=False, chat_template=template, **kw)
    return text, bool(tokenize)


def compute(tok, fmt, req, max_model_len):
    body = req["body"]
    template = body.get("chat_template")
    if template is not None:
        # A request-supplied template (vLLM with --trust-request-chat-template).
        fmt = content_format(template)
    if req["endpoint"] == "messages":
        return messages_ids(tok, fmt, body, template)
    if req["endpoint"] == "tokenize" and "messages" not in body:
        return tok(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
    if req["endpoint"] == "chat_render" and body.get("truncate_prompt_tokens") is not None:
        # The chat completion applies it; not reproduced here.
        raise Refused("truncate_prompt_tokens is not reproduced by this reference")
    if req["endpoint"] in ("tokenize", "chat_render"):
        conv = [parse_message(m, fmt, True) for m in body["messages"]]
        postprocess(conv)
        tools = chat_tools(body["tools"]) if body.get("tools") is not None else None
        text, tokenized = render(tok, conv, tools, body.get("chat_template_kwargs"),
                                 body.get("add_generation_prompt", True), body.get("continue_final_message", False),
                                 template)
        add = body.get("add_special_tokens", False) and not tokenized
        return tok(text, add_special_tokens=add)["input_ids"]
    msgs, cont = responses_messages(json.loads(json.dumps(body)))
    conv = [parse_message(m, fmt, False) for m in msgs]
    postprocess(conv)
    kwargs = dict(body.get("chat_template_kwargs") or {})
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
    text, tokenized = render(tok, conv, responses_tools(body.get("tools")), kwargs, not cont, cont, template)
    ids = tok(text, add_special_tokens=not tokenized)["input_ids"]
    if len(ids) > max_model_len:
        raise Refused("prompt too long")
    return ids


def main(model_dir, requests, out, template_file=None):
    tok = AutoTokenizer.from_pretrained(model_dir)
    if template_file:  # vLLM's --chat-template
        with open(template_file, encoding="utf-8") as f:
            tok.chat_template = f.read()
    fmt = content_format(tok.chat_template)
    with open(f"{model_dir}/config.json") as f:
        max_model_len = json.load(f)["max_position_embeddings"]
    with open(requests, encoding="utf-8") as f, open(out, "w", encoding="utf-8") as o:
        for line in f:
            req = json.loads(line)
            try:
                rec = {"id": req["id"], "tokens": compute(tok, fmt, req, max_model_len)}
            except Exception as e:  # the request is refused, as vLLM refuses it
                rec = {"id": req["id"], "error": f"{type(e).__name__}: {e}"}
            o.write(json.dumps(rec) + "\n")
    print(f"content format: {fmt}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    main(*sys.argv[1:])
