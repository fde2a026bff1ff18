#!/usr/bin/env python3
"""Token ids for the requests of gen_requests.py, computed the way vLLM 0.32
computes them, on transformers alone (no vLLM install): vLLM's chat
preprocessing (content format detection, message parsing, tool-call argument
parsing, developer roles, kwargs merging), its Responses -> chat conversion,
then `apply_chat_template(tokenize=False)` and the tokenizer's encode with
vLLM's `add_special_tokens` (false for /tokenize chat unless asked, true for
completions and for Responses render: hence Responses' second BOS).

Checked against live vLLM with tests/vllm/live_ids.py on the same requests.

    python expected.py MODEL_DIR REQUESTS.jsonl OUT.jsonl
"""
import inspect
import json
import sys
from collections import deque

import jinja2
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
PART_TEXT = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}


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
        if isinstance(out["content"], list):
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
        out.append({"type": "function", "function": fn})
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


# --- apply_chat_template as vLLM calls it ---

HF_BASE_PARAMS = frozenset(inspect.signature(PythonBackend.apply_chat_template).parameters)


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
                                                       extensions=[jinja2.ext.loopcontrols])
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


def main(model_dir, requests, out):
    tok = AutoTokenizer.from_pretrained(model_dir)
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
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
