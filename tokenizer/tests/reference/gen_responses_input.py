#!/usr/bin/env python3
"""Writes Responses bodies with well-formed and malformed `input` items, each
with vLLM 0.32's verdict on it (deterministic per seed): the fixture
`tests/fixtures/responses_input.jsonl`, against which the native conversion's
accept/refuse verdict is checked (the normal test run has no vLLM).

vLLM's verdict is what `/v1/responses/render` does with the body before the
chat template: `ResponsesRequest` validation (pydantic, against the openai
SDK's input and output item types, after vLLM's own before-validators),
`construct_input_messages` (the Responses -> chat conversion), and
`parse_chat_messages` (the chat parser) with the "string" content format,
its media parsers stubbed (they would fetch images; "media" says whether
one ran). A body fails at one of these stages, or is valid.

Runs in vLLM 0.32's venv, offline; MODEL_DIR is any local text model (the
chat parser reads its config only):

    python gen_responses_input.py MODEL_DIR tests/fixtures/responses_input.jsonl [--count N] [--seed S]

Each line: {"id", "status": 200 | 400 | 500 (what vLLM answers), "stage":
null | "pydantic" | "convert" | "chat", "error": null | "...", "media":
bool, "body": {...}} with "body" last. A 500 is vLLM's conversion or chat
parser failing on a body pydantic took.
"""
import argparse
import copy
import json
import os
import random
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROLES = ["user", "assistant", "system", "developer"]
BAD_ROLES = ["tool", "critic", "function", "", "USER", 5, None]
STATUSES = ["in_progress", "completed", "incomplete"]
BAD_VALUES = [None, 5, 1.5, True, "text", [], {}, ["x"], [{"type": "bogus"}]]
UNKNOWN_TYPES = ["bogus", "Message", "function", "tool_call", "output_text", "", 5, None]
OTHER_KINDS = ["item_reference", "file_search_call", "computer_call", "web_search_call",
               "mcp_call", "image_generation_call", "local_shell_call", "compaction"]
EXTRA_KEYS = ["extra", "metadata", "annotations", "name", "phase", "id", "status", "namespace"]
WORDS = "the cache routes a prefix to the replica that holds it warm".split()


def text(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))


def input_text(rng):
    return {"type": "input_text", "text": text(rng)}


def input_image(rng):
    part = {"type": "input_image", "image_url": "https://example.com/a.png"}
    if rng.random() < 0.6:
        part["detail"] = rng.choice(["auto", "low", "high", "original"])
    return part


def input_file(rng):
    return {"type": "input_file", "file_id": "file-1"}


def input_parts(rng):
    parts = [input_text(rng) for _ in range(rng.randint(1, 2))]
    r = rng.random()
    if r < 0.1:
        parts.append(input_image(rng))
    elif r < 0.15:
        parts.append(input_file(rng))
    return parts


def output_text(rng, annotations=True):
    part = {"type": "output_text", "text": text(rng)}
    if annotations:
        part["annotations"] = []
    return part


def easy_message(rng):
    m = {"role": rng.choice(ROLES)}
    m["content"] = text(rng) if rng.random() < 0.6 else input_parts(rng)
    if rng.random() < 0.4:
        m["type"] = "message"
    return m


def input_message(rng):
    m = {"type": "message", "role": rng.choice(["user", "system", "developer"]),
         "content": input_parts(rng)}
    if rng.random() < 0.7:
        m["status"] = rng.choice(STATUSES)
    return m


def output_message(rng):
    m = {"type": "message", "role": "assistant",
         "content": [output_text(rng, rng.random() < 0.5)]}
    if rng.random() < 0.2:
        m["content"].append({"type": "refusal", "refusal": "no"})
    if rng.random() < 0.5:
        m["id"] = "msg_1"
    if rng.random() < 0.5:
        m["status"] = rng.choice(STATUSES)
    return m


def function_call(rng):
    m = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": rng.choice(["{}", "{\"city\": \"Paris\"}", ""])}
    for k, v in [("id", "fc_1"), ("status", rng.choice(STATUSES)), ("namespace", "ns")]:
        if rng.random() < 0.2:
            m[k] = v
    return m


def function_call_output(rng):
    m = {"type": "function_call_output", "call_id": "call_1"}
    m["output"] = text(rng) if rng.random() < 0.7 else [input_text(rng)]
    for k, v in [("id", "fco_1"), ("status", rng.choice(STATUSES))]:
        if rng.random() < 0.2:
            m[k] = v
    return m


def reasoning(rng):
    m = {"type": "reasoning", "summary": []}
    r = rng.random()
    if r < 0.4:
        m["summary"] = [{"type": "summary_text", "text": text(rng)}]
    elif r < 0.8:
        m["content"] = [{"type": "reasoning_text", "text": text(rng)}]
    for k, v in [("id", "rs_1"), ("status", rng.choice(STATUSES)), ("encrypted_content", "")]:
        if rng.random() < 0.2:
            m[k] = v
    return m


def custom_tool_call(rng):
    m = {"type": "custom_tool_call", "call_id": "call_2", "name": "shell", "input": text(rng)}
    if rng.random() < 0.2:
        m["id"] = "ctc_1"
    return m


def custom_tool_call_output(rng):
    return {"type": "custom_tool_call_output", "call_id": "call_2",
            "output": text(rng) if rng.random() < 0.7 else [input_text(rng)]}


def other_kind(rng):
    kind = rng.choice(OTHER_KINDS)
    m = {"type": kind, "id": "x_1"}
    if kind == "file_search_call":
        m.update(queries=["q"], status="completed")
    return m


def output_message_oddity(rng):
    """Assistant output messages at the edges of vLLM's fill-in, its output
    message TypedDict (whose content pydantic reads late) and its
    conversion (which reads the first part's text)."""
    m = {"type": "message", "role": "assistant"}
    if rng.random() < 0.5:
        m.update(id="msg_1", status="completed")
    m["content"] = copy.deepcopy(rng.choice([
        [], [{"type": "refusal", "refusal": "no"}], "", "abc", {}, {"a": 1},
        [{"type": "output_text", "text": "x", "annotations": "s"}],
        [{"type": "output_text", "text": "x", "annotations": {}}],
        [{"type": "output_text", "text": "x", "annotations": [
            {"type": "file_citation", "file_id": "f", "filename": "a", "index": rng.choice([3, "3", 1.5, True, "x"])}]}],
        [{"type": "output_text", "text": "x", "annotations": [], "logprobs": rng.choice(
            [None, [], [{"token": "x", "bytes": [1], "logprob": rng.choice([-1, "-0.5", "x"]), "top_logprobs": []}]])}],
        [{"type": "output_text", "text": "x"}, {"type": "input_text", "text": "y"}],
        [{"type": "input_text", "text": "y"}],
    ]))
    return m


def reference(rng):
    """Item references, which pydantic takes without a type; with a role
    the conversion passes them on as chat messages."""
    m = {"id": "ref_1"}
    r = rng.random()
    if r < 0.3:
        m["type"] = rng.choice(["item_reference", None])
    if rng.random() < 0.6:
        m["role"] = rng.choice(ROLES + ["critic"])
        m["content"] = copy.deepcopy(rng.choice(["hi", [5], [{"type": "input_text", "text": "x"}], [], None]))
    return m


def additional_tools(rng):
    m = {"type": "additional_tools", "role": rng.choice(["developer", "user", "critic"]), "tools": []}
    if rng.random() < 0.5:
        m["id"] = "at_1"
    return m


def lax_call(rng):
    """Calls with the optional fields pydantic reads in lax mode."""
    m = function_call(rng) if rng.random() < 0.6 else custom_tool_call(rng)
    r = rng.random()
    if r < 0.5:
        m["async"] = copy.deepcopy(rng.choice([True, "yes", "Off", 1, 0.0, 2, "maybe", None, []]))
    else:
        m["caller"] = copy.deepcopy(rng.choice([{"type": "direct"}, {"type": "program"},
                                                {"type": "program", "caller_id": "p"}, None, "x", {}]))
    return m


def part_oddity(rng):
    """Message parts with optional fields set oddly."""
    part = rng.choice([input_text, input_image, input_file])(rng)
    key, value = rng.choice([
        ("detail", rng.choice([None, "auto", "ultra", "low"])),
        ("prompt_cache_breakpoint", rng.choice([None, {"mode": "explicit"}, {"mode": "explicit", "ttl": "1h"},
                                                {"mode": "explicit", "ttl": "12h"}, {}])),
        ("file_id", rng.choice([None, 5, "f"])),
        ("filename", rng.choice([None, "a.txt"])),
        ("image_url", rng.choice([None, 5])),
    ])
    part[key] = copy.deepcopy(value)
    m = {"role": rng.choice(ROLES), "content": [input_text(rng), part]}
    if rng.random() < 0.3:
        m["type"] = "message"
    return m


def tool_output_oddity(rng):
    """Tool outputs with list outputs: the function output's parts are
    checked at once, the custom tool output's when the chat parser reads
    them (or at once, by the output model, given an id and a status)."""
    m = rng.choice([function_call_output, custom_tool_call_output])(rng)
    m["output"] = [copy.deepcopy(rng.choice([
        {"type": "input_text", "text": "x"}, {"type": "input_text", "text": "x", "prompt_cache_breakpoint": None},
        {"type": "input_image", "image_url": "https://example.com/a.png"},
        {"type": "input_image", "detail": None, "file_id": "f"}, {"type": "input_file", "detail": None},
        {"type": "input_text"}, {"type": "output_text", "text": "x"}, "x",
    ]))]
    if rng.random() < 0.4:
        m.update(id="out_1", status="completed")
    return m


def reasoning_oddity(rng):
    m = reasoning(rng)
    key, value = rng.choice([("id", None), ("encrypted_content", rng.choice(["x", None, 5])),
                             ("content", None), ("summary", None), ("status", None)])
    m[key] = value
    return m


BUILDERS = [easy_message] * 4 + [input_message, output_message, output_message, function_call,
                                  function_call, function_call_output, function_call_output,
                                  reasoning, reasoning, custom_tool_call, custom_tool_call_output,
                                  other_kind]
ODDITIES = [output_message_oddity, reference, additional_tools, lax_call, part_oddity,
            tool_output_oddity, reasoning_oddity]


def parts_of(item):
    for key in ("content", "output", "summary"):
        v = item.get(key)
        if isinstance(v, list) and v and all(isinstance(p, dict) for p in v):
            return v
    return None


def mutate(rng, item):
    """One change to `item`, of a kind a client gets wrong."""
    keys = [k for k in item]
    r = rng.random()
    if r < 0.2 and keys:
        del item[rng.choice(keys)]
    elif r < 0.4 and keys:
        item[rng.choice(keys)] = copy.deepcopy(rng.choice(BAD_VALUES))
    elif r < 0.5:
        item["type"] = rng.choice(UNKNOWN_TYPES + OTHER_KINDS)
    elif r < 0.6:
        item["role"] = rng.choice(BAD_ROLES + ROLES)
    elif r < 0.8 and parts_of(item):
        part = rng.choice(parts_of(item))
        s = rng.random()
        if s < 0.4:
            part["type"] = rng.choice(["text", "input_text", "output_text", "refusal", "input_audio",
                                       "summary_text", "reasoning_text", "bogus", None, 3])
        elif s < 0.7 and part:
            del part[rng.choice(list(part))]
        else:
            part[rng.choice(list(part) + ["detail", "annotations", "logprobs"])] = \
                copy.deepcopy(rng.choice(BAD_VALUES))
    elif r < 0.9:
        item[rng.choice(EXTRA_KEYS)] = copy.deepcopy(rng.choice(BAD_VALUES + ["x", STATUSES[0]]))
    else:
        item["content"] = copy.deepcopy(rng.choice(BAD_VALUES))


def body(rng):
    items = []
    if rng.random() < 0.5:
        items.append({"role": "user", "content": text(rng)})
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.25:
            items.append(rng.choice(ODDITIES)(rng))
            continue
        item = rng.choice(BUILDERS)(rng)
        if rng.random() < 0.55:
            mutate(rng, item)
            if rng.random() < 0.2:
                mutate(rng, item)
        items.append(item)
    b = {"model": "m", "input": items}
    if rng.random() < 0.03:
        b["input"] = copy.deepcopy(rng.choice([5, None, {}, [], "", {"role": "user", "content": "x"}]))
    if rng.random() < 0.1:
        b["instructions"] = text(rng)
    return b


MEDIA = []


def stub_media():
    """vLLM's media parsers, which would fetch: they note that they ran."""
    from vllm.renderers import chat_utils
    for name in dir(chat_utils.MultiModalContentParser):
        if name.startswith("parse_"):
            setattr(chat_utils.MultiModalContentParser, name, lambda self, *a, **k: MEDIA.append(1))


def short(e):
    """An error's gist: for pydantic, the first item it refuses (pydantic
    lists every union member's complaint) and one complaint."""
    from pydantic import ValidationError
    if isinstance(e, ValidationError):
        errors = e.errors()
        at = [er for er in errors if len(er["loc"]) > 2 and isinstance(er["loc"][2], int)]
        first = at[0] if at else errors[0]
        loc = ".".join(str(p) for p in first["loc"] if not re.search(r"[\[\]()]", str(p)))
        return f"{loc}: {first['msg']}"
    line = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {line}"[:160]


def verdict(b, model_config):
    """(HTTP status vLLM answers, stage, error, whether media was parsed)."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.renderers.chat_utils import parse_chat_messages
    MEDIA.clear()
    try:
        req = ResponsesRequest.model_validate(copy.deepcopy(b))
    except Exception as e:
        return 400, "pydantic", short(e), False
    stage = "convert"
    try:
        messages = construct_input_messages(request_instructions=req.instructions,
                                            request_input=req.input)
        stage = "chat"
        parse_chat_messages(messages, model_config, "string")
    except Exception as e:
        return create_error_response(e).error.code, stage, short(e), bool(MEDIA)
    return 200, None, None, bool(MEDIA)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--count", type=int, default=480)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    from vllm.config import ModelConfig
    model_config = ModelConfig(model=a.model_dir)
    stub_media()
    rng = random.Random(a.seed)
    with open(a.out, "w", encoding="utf-8") as f:
        for i in range(a.count):
            b = body(rng)
            status, stage, error, media = verdict(b, model_config)
            head = json.dumps({"id": i, "status": status, "stage": stage, "error": error,
                               "media": media}, ensure_ascii=False)
            f.write(head[:-1] + ", \"body\": " + json.dumps(b, ensure_ascii=False) + "}\n")


if __name__ == "__main__":
    main()
