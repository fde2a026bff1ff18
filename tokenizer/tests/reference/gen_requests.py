#!/usr/bin/env python3
"""Writes a JSONL of generated tokenizer requests (deterministic per seed).

Each line: {"id", "endpoint": "tokenize" | "render", "body": {...}} where
"tokenize" bodies are vLLM /tokenize bodies (chat or completions shape) and
"render" bodies are Responses requests for /v1/responses/render. Bodies carry
no "model": the caller adds it. The same file drives the native differential
test (against transformers, see expected.py) and the real-vLLM tier (against
live /tokenize and /v1/responses/render, see tests/vllm/live_ids.py).

    python gen_requests.py OUT.jsonl [--count N] [--long N] [--seed S]
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


if __name__ == "__main__":
    main()
