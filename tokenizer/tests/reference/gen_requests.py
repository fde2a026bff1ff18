#!/usr/bin/env python3
"""Writes a JSONL of generated tokenizer requests (deterministic per seed).

Each line: {"id", "endpoint": "tokenize" | "render", "body": {...}} where
"tokenize" bodies are vLLM /tokenize bodies (chat or completions shape) and
"render" bodies are Responses requests for /v1/responses/render; with
--messages, "messages" bodies are Anthropic Messages requests for /v1/messages
(they name a model, which vLLM requires). Other bodies carry no "model": the
caller adds it. The same file drives the native differential
test (against transformers, see expected.py) and the real-vLLM tier (against
live /tokenize and /v1/responses/render, see tests/vllm/live_ids.py).

    python gen_requests.py OUT.jsonl [--count N] [--long N] [--seed S] [--messages N]
"""
import argparse
import json
import random

WORDS = (
    "the a routing cache token block replica prefix tool call result error value "
    "kvroute vLLM Envoy model agent plan step file line function return json"
).split()
EDGE_TEXTS = [
    "", " ", "  leading spaces", "trailing spaces   ", "multiple   inner    spaces",
    "tabs\tand\tmore\t\ttabs", "new\nlines\n\n\nmany", "\n starts with newline",
    "emoji 🚀🔥 and 👩‍💻 zwj", "CJK 日本語のテキストと中文文本", "mixed Ωμέγα кириллица",
    "numbers 1234567890 12 123 1234", "punct!!! ??? ... ,,, ;;; --- ___",
    "special-like <s> </s> <unk> text", "deepseek-like <｜User｜> <｜Assistant｜> <think> </think> <dsml:x",
    "<｜end▁of▁sentence｜> inside", "▁ metaspace ▁▁ chars ▁", "  \n  \t mixed whitespace \r\n end",
    "quotes \"double\" and 'single' and `back`", "back\\slash \\n literal", "json {\"a\": [1, 2]}",
    "zero\u200bwidth and nbsp\u00a0here", "combining e\u0301 a\u0308",
]
TOOL_NAMES = ["get_weather", "search", "read_file", "write_file", "run_tests"]


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def text(rng, lo=1, hi=30):
    r = rng.random()
    if r < 0.25:
        return rng.choice(EDGE_TEXTS)
    if r < 0.35:
        return words(rng, rng.randint(lo, hi)) + " " + rng.choice(EDGE_TEXTS)
    if r < 0.45:
        lines = [words(rng, rng.randint(1, 10)) for _ in range(rng.randint(2, 6))]
        return "\n".join(("  " * rng.randint(0, 2)) + l for l in lines)
    return words(rng, rng.randint(lo, hi))


def args_obj(rng):
    obj = {}
    for k in rng.sample(["path", "query", "n", "flag", "x", "unit", "items"], rng.randint(0, 4)):
        obj[k] = rng.choice([text(rng, 1, 4), rng.randint(-5, 500), rng.random() < 0.5,
                             None, 1.5, [1, "two", 3.0], {"nested": "é"}])
    return obj


def tool_schema(rng, responses=False):
    name = rng.choice(TOOL_NAMES)
    params = {"type": "object", "properties": {
        "path": {"type": "string", "description": text(rng, 1, 6)},
        "n": {"type": "integer"}}, "required": ["path"]}
    fn = {"name": name}
    if rng.random() < 0.8:
        fn["description"] = text(rng, 2, 12)
    if rng.random() < 0.8:
        fn["parameters"] = params
    if rng.random() < 0.2:
        fn["strict"] = rng.random() < 0.5
    if responses:
        return {"type": "function", **fn}
    return {"type": "function", "function": fn}


def content(rng, parts_ok=True):
    if parts_ok and rng.random() < 0.3:
        return [{"type": "text", "text": text(rng)} for _ in range(rng.randint(1, 3))]
    return text(rng)


def tool_call(rng, i):
    r = rng.random()
    if r < 0.8:
        arguments = json.dumps(args_obj(rng), ensure_ascii=rng.random() < 0.5)
    elif r < 0.9:
        arguments = ""
    else:
        arguments = rng.choice(["not json", "[1, 2]", "42"])
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": rng.choice(TOOL_NAMES), "arguments": arguments}}


def chat_messages(rng, turns, roles_extra=True):
    msgs = []
    if rng.random() < 0.6:
        msgs.append({"role": "system", "content": content(rng)})
    if roles_extra and rng.random() < 0.1:
        msgs.append({"role": "developer", "content": text(rng)})
    call = 0
    for _ in range(turns):
        msgs.append({"role": "user", "content": content(rng)})
        r = rng.random()
        if r < 0.3:
            calls = [tool_call(rng, call + k) for k in range(rng.randint(1, 2))]
            m = {"role": "assistant", "content": rng.choice([None, "", text(rng, 1, 8)]), "tool_calls": calls}
            if rng.random() < 0.3:
                m["reasoning"] = text(rng, 2, 10)
            msgs.append(m)
            for c in calls:
                msgs.append({"role": "tool", "tool_call_id": c["id"], "content": content(rng)})
            call += len(calls)
        elif r < 0.9:
            m = {"role": "assistant", "content": content(rng)}
            if rng.random() < 0.2:
                m["reasoning"] = text(rng, 2, 10)
            if rng.random() < 0.05:
                m["tool_calls"] = []
            msgs.append(m)
    return msgs


def chat_body(rng):
    msgs = chat_messages(rng, rng.randint(1, 5))
    body = {"messages": msgs}
    if rng.random() < 0.3:
        body["tools"] = [tool_schema(rng) for _ in range(rng.randint(1, 3))]
    if msgs[-1]["role"] == "assistant" and isinstance(msgs[-1].get("content"), str) \
            and msgs[-1]["content"].strip() and "tool_calls" not in msgs[-1] and rng.random() < 0.5:
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    elif rng.random() < 0.2:
        body["add_generation_prompt"] = False
    if rng.random() < 0.2:
        body["add_special_tokens"] = True
    if rng.random() < 0.1:
        body["chat_template_kwargs"] = {"foo": "bar", "enable_thinking": rng.random() < 0.5}
    if rng.random() < 0.05:
        body["return_token_strs"] = True
    return body


def completion_body(rng):
    body = {"prompt": text(rng, 1, 60)}
    if rng.random() < 0.3:
        body["add_special_tokens"] = rng.random() < 0.5
    return body


def responses_body(rng):
    body = {}
    if rng.random() < 0.5:
        body["instructions"] = text(rng, 2, 20)
    if rng.random() < 0.25:
        body["input"] = text(rng, 1, 30)
    else:
        items = []
        call = 0
        for _ in range(rng.randint(1, 4)):
            r = rng.random()
            if r < 0.15:
                items.append({"role": "user", "content": text(rng)})
            else:
                items.append({"type": "message", "role": "user",
                              "content": [{"type": "input_text", "text": text(rng)} for _ in range(rng.randint(1, 2))]})
            r = rng.random()
            if r < 0.3:
                if rng.random() < 0.4:
                    items.append({"type": "reasoning", "id": f"rs_{call}", "summary": [],
                                  "content": [{"type": "reasoning_text", "text": text(rng, 2, 10)}]})
                for _ in range(rng.randint(1, 2)):
                    items.append({"type": "function_call", "call_id": f"fc_{call}", "name": rng.choice(TOOL_NAMES),
                                  "arguments": json.dumps(args_obj(rng))})
                    items.append({"type": "function_call_output", "call_id": f"fc_{call}", "output": text(rng)})
                    call += 1
            elif r < 0.8:
                items.append({"type": "message", "role": "assistant", "id": f"msg_{call}", "status": "completed",
                              "content": [{"type": "output_text", "text": text(rng), "annotations": []}]})
        if rng.random() < 0.1:
            items.insert(0, {"role": "developer", "content": text(rng)})
        if rng.random() < 0.1:
            items.append({"type": "message", "role": "assistant", "id": "msg_partial", "status": "incomplete",
                          "content": [{"type": "output_text", "text": words(rng, 5), "annotations": []}]})
        body["input"] = items
    if rng.random() < 0.3:
        body["tools"] = [tool_schema(rng, responses=True) for _ in range(rng.randint(1, 2))]
    if rng.random() < 0.1:
        body["reasoning"] = {"effort": rng.choice(["low", "high"])}
    return body


def anthropic_tool(rng):
    schema = {"properties": {"path": {"type": "string", "description": text(rng, 1, 6)}}, "required": ["path"]}
    if rng.random() < 0.6:
        schema = {"type": "object", **schema}
    t = {"name": rng.choice(TOOL_NAMES), "input_schema": schema}
    if rng.random() < 0.7:
        t["description"] = text(rng, 2, 12)
    for k in ("strict", "defer_loading"):
        if rng.random() < 0.15:
            t[k] = rng.random() < 0.5
    return t


def image_block(rng):
    if rng.random() < 0.5:
        return {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


def text_blocks(rng, lo=1, hi=3):
    out = []
    for _ in range(rng.randint(lo, hi)):
        out.append({"type": "text", "text": text(rng)})
        if rng.random() < 0.05:
            out.append({"type": "text", "text": "x-anthropic-billing-header: cch=1234;\n" + text(rng, 1, 4)})
    return out


def tool_result(rng, call_id):
    block = {"type": "tool_result", "tool_use_id": call_id}
    r = rng.random()
    if r < 0.4:
        block["content"] = text(rng)
    elif r < 0.8:
        block["content"] = [{"type": "text", "text": text(rng)} for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.15:
            block["content"].append({"type": "tool_reference", "tool_name": rng.choice(TOOL_NAMES)})
        if rng.random() < 0.01:
            block["content"].append(image_block(rng))
    elif r < 0.9:
        block["content"] = rng.choice(["", [], None])
    if rng.random() < 0.2:
        block["is_error"] = rng.random() < 0.7
    return block


def assistant_turn(rng, call, tools):
    blocks = []
    if rng.random() < 0.3:
        blocks.append({"type": "thinking", "thinking": text(rng, 2, 10), "signature": "sig"})
    if rng.random() < 0.05:
        blocks.append({"type": "redacted_thinking", "data": "b64=="})
    if rng.random() < 0.7:
        blocks.append({"type": "text", "text": text(rng, 1, 8)})
    ids = []
    if tools and rng.random() < 0.5:
        for _ in range(rng.randint(1, 2)):
            use = {"type": "tool_use", "name": rng.choice(TOOL_NAMES), "input": args_obj(rng)}
            if rng.random() < 0.95:
                use["id"] = f"toolu_{call + len(ids)}"
            blocks.append(use)
            ids.append(use.get("id", ""))
    if rng.random() < 0.03:
        blocks.append({"type": "tool_result", "tool_use_id": "x", "content": rng.choice(["done", [{"type": "text", "text": "ok"}]])})
    content = blocks if blocks or rng.random() < 0.5 else text(rng)
    if not ids and rng.random() < 0.3:
        content = text(rng)
    return {"role": "assistant", "content": content}, ids


def user_turn(rng, pending):
    blocks = [tool_result(rng, i) for i in pending]
    if not pending or rng.random() < 0.4:
        if not blocks and rng.random() < 0.5:
            return {"role": "user", "content": text(rng)}
        blocks += text_blocks(rng)
        if rng.random() < 0.01:
            blocks.append(image_block(rng))
    return {"role": "user", "content": blocks}


def messages_body(rng):
    body = {"model": "m", "max_tokens": rng.choice([1, 4096, 8192, 32000, 32000, 64000])}
    r = rng.random()
    if r < 0.3:
        body["system"] = text(rng, 2, 20)
    elif r < 0.55:
        body["system"] = text_blocks(rng)
    tools = rng.random() < 0.5
    if tools:
        body["tools"] = [anthropic_tool(rng) for _ in range(rng.randint(1, 3))]
    msgs, call, pending = [], 0, []
    for _ in range(rng.randint(1, 5)):
        msgs.append(user_turn(rng, pending))
        if rng.random() < 0.08:
            msgs.append({"role": "system", "content": rng.choice([text(rng, 1, 8), text_blocks(rng, 1, 2)])})
        if rng.random() < 0.85:
            m, pending = assistant_turn(rng, call, tools)
            call += len(pending)
            msgs.append(m)
        else:
            pending = []
    if pending or rng.random() < 0.7:
        msgs.append(user_turn(rng, pending))
    if tools and rng.random() < 0.08:
        change = rng.choice([
            {"type": "tool_addition", "tool": {"type": "tool_reference", "name": body["tools"][0]["name"]}},
            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": body["tools"][-1]["name"]}},
            {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": anthropic_tool(rng)}},
            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "undeclared"}}])
        msgs.insert(rng.randint(0, len(msgs)), {"role": "system", "content": [change]})
    body["messages"] = msgs
    if rng.random() < 0.3:
        tc = {"type": rng.choice(["auto", "any", "none", "tool"])}
        if tc["type"] == "tool" and rng.random() < 0.9:
            tc["name"] = rng.choice(TOOL_NAMES)
        if rng.random() < 0.3:
            tc["disable_parallel_tool_use"] = rng.random() < 0.5
        body["tool_choice"] = tc
    r = rng.random()
    if r < 0.1:
        body["thinking"] = {"type": "enabled", "budget_tokens": rng.choice([1024, 2048, 2048, 100000])}
    elif r < 0.2:
        body["thinking"] = {"type": rng.choice(["disabled", "adaptive"])}
    if rng.random() < 0.15:
        oc = {}
        if rng.random() < 0.7:
            oc["effort"] = rng.choice(["low", "medium", "high", "xhigh", "max"])
        if rng.random() < 0.3:
            oc["format"] = {"type": "json_schema", "schema": {"type": "object"}}
        body["output_config"] = oc
    if rng.random() < 0.08:
        body["chat_template_kwargs"] = rng.choice([{"enable_thinking": False}, {"reasoning_effort": "high", "foo": 1}])
    if rng.random() < 0.05:
        body["stop_sequences"] = ["a", "b", "c", "d", "e"][: rng.randint(1, 5)]
    if rng.random() < 0.1:
        body["stream"] = True
    return body


def long_chat(rng, target_words):
    msgs = [{"role": "system", "content": text(rng, 20, 60)}]
    total = 0
    call = 0
    while total < target_words:
        u = "\n".join(words(rng, rng.randint(5, 30)) for _ in range(rng.randint(1, 20)))
        msgs.append({"role": "user", "content": u + " " + rng.choice(EDGE_TEXTS)})
        if rng.random() < 0.3:
            c = tool_call(rng, call)
            call += 1
            msgs.append({"role": "assistant", "content": None, "tool_calls": [c]})
            msgs.append({"role": "tool", "tool_call_id": c["id"],
                         "content": "\n".join(words(rng, 12) for _ in range(rng.randint(5, 60)))})
        a = "\n".join(words(rng, rng.randint(5, 30)) for _ in range(rng.randint(1, 15)))
        msgs.append({"role": "assistant", "content": a})
        total += len(u.split()) + len(a.split())
    return {"messages": msgs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--count", type=int, default=1200)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--messages", type=int, default=0, help="Messages (/v1/messages) bodies, after the others")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    with open(a.out, "w", encoding="utf-8") as f:
        def put(i, endpoint, body):
            f.write(json.dumps({"id": i, "endpoint": endpoint, "body": body}, ensure_ascii=False) + "\n")
        n = 0
        for _ in range(a.count):
            r = rng.random()
            if r < 0.55:
                put(n, "tokenize", chat_body(rng))
            elif r < 0.7:
                put(n, "tokenize", completion_body(rng))
            else:
                put(n, "render", responses_body(rng))
            n += 1
        for k in range(a.long):
            put(n, "tokenize", long_chat(rng, 6000 + 7000 * k))
            n += 1
        for _ in range(a.messages):
            put(n, "messages", messages_body(rng))
            n += 1


if __name__ == "__main__":
    main()
