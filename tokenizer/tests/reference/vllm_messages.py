#!/usr/bin/env python3
"""Checks expected.py's transcription of vLLM's Messages -> chat conversion
against vLLM's own, offline: every "messages" body of a gen_requests.py file
goes through vLLM 0.32's `AnthropicMessagesRequest` validation and
`AnthropicServingMessages.to_chat_completion_request` (with and without the
inline-system merge, with both disabled-thinking efforts), and through
`expected.messages_chat`; the chat requests must agree field for field
(messages, tools as `model_dump()`, tool_choice, parallel_tool_calls,
chat_template_kwargs, reasoning_effort, thinking_token_budget,
response_format), or both refuse. With model directories, vLLM's
`_detect_merge_inline_system` is also compared on their templates.

Run with the vLLM venv's python:

    python vllm_messages.py REQUESTS.jsonl [MODEL_DIR ...]

With `REQUESTS.jsonl --emit MODEL_DIR OUT.jsonl` it writes instead, for every body, the
`/tokenize` request of the chat vLLM converts it to for that model (the
inline-system merge as vLLM detects it on the model's template), for a live
vLLM to tokenize: {"id", "tokenize"}, or {"id", "error"} where vLLM refuses
the body. Bodies whose conversion sets `reasoning_effort` (output effort,
thinking disabled: the chat completion hands it to the template, which
`/tokenize` does not), or stamps a tool_use id with the clock, are left
out: {"id", "skipped"}.
"""
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import expected  # noqa: E402
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest  # noqa: E402
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages  # noqa: E402
from vllm.entrypoints.generate.base.protocol import ResponseFormat  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402

PARALLEL_DEFAULT = ChatCompletionRequest.model_fields["parallel_tool_calls"].default
# A tool_use block without an id gets call_<unix seconds>: equal up to the clock.
STAMPED = re.compile(r'"call_\d{9,}"')


def dump(v):
    return v.model_dump() if hasattr(v, "model_dump") else v


def vllm_side(body, merge, disabled):
    try:
        req = AnthropicMessagesRequest.model_validate(body)
        chat = AnthropicServingMessages.to_chat_completion_request(
            req, merge_inline_system=merge, disabled_thinking_effort=disabled)
    except Exception as e:  # noqa: BLE001 - vLLM answers these with an error
        return None, f"{type(e).__name__}: {str(e)[:200]}"
    return {
        "messages": chat.messages,
        "tools": [t.model_dump() for t in chat.tools] if chat.tools is not None else None,
        "tool_choice": dump(chat.tool_choice),
        "parallel_tool_calls": chat.parallel_tool_calls,
        "chat_template_kwargs": chat.chat_template_kwargs,
        "reasoning_effort": chat.reasoning_effort,
        "thinking_token_budget": chat.thinking_token_budget,
        "response_format": dump(chat.response_format),
    }, None


def transcription_side(body, merge, disabled):
    try:
        chat = expected.messages_chat(body, merge, disabled)
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"
    rf = chat["response_format"]
    return {
        "messages": chat["messages"],
        "tools": chat.get("tools"),
        "tool_choice": chat["tool_choice"],
        "parallel_tool_calls": chat.get("parallel_tool_calls", PARALLEL_DEFAULT),
        "chat_template_kwargs": chat["chat_template_kwargs"],
        "reasoning_effort": chat["reasoning_effort"],
        "thinking_token_budget": chat["thinking_token_budget"],
        "response_format": ResponseFormat.model_validate(rf).model_dump() if rf else None,
    }, None


def text(v, key=None):
    # pydantic re-orders the keys of messages (TypedDicts) and vLLM's chat
    # parsing rebuilds them in its own order: only their content counts.
    return STAMPED.sub('"call_T"', json.dumps(v, ensure_ascii=False, sort_keys=key == "messages"))


def main(requests, *model_dirs):
    bodies = []
    with open(requests, encoding="utf-8") as f:
        for line in f:
            req = json.loads(line)
            if req["endpoint"] == "messages":
                bodies.append((req["id"], req["body"]))
    checked, refused, wrong = 0, 0, []
    for rid, body in bodies:
        for merge, disabled in ((False, "none"), (True, "low")):
            theirs, their_err = vllm_side(json.loads(json.dumps(body)), merge, disabled)
            ours, our_err = transcription_side(body, merge, disabled)
            checked += 1
            if theirs is None and ours is None:
                refused += 1
            elif theirs is None or ours is None:
                wrong.append(f"#{rid} merge={merge}: vLLM {their_err or 'took it'}, transcription {our_err or 'took it'}")
            else:
                for key in theirs:
                    if text(theirs[key], key) != text(ours[key], key):
                        wrong.append(f"#{rid} merge={merge} {key}:\n  vLLM {text(theirs[key], key)[:400]}\n"
                                     f"  ours {text(ours[key], key)[:400]}")
    for d in model_dirs:
        with open(os.path.join(d, "chat_template.jinja"), encoding="utf-8") as f:
            template = f.read()
        theirs = AnthropicServingMessages._detect_merge_inline_system(template)
        if theirs != expected.detect_merge_inline_system(template):
            wrong.append(f"{d}: merge detection differs (vLLM {theirs})")
    for w in wrong[:20]:
        print(w)
    print(f"{len(bodies)} Messages bodies, {checked} conversions: {checked - len(wrong)} agree "
          f"({refused} refused by both), {len(wrong)} differ")
    sys.exit(1 if wrong or not bodies else 0)


def emit(requests, model_dir, out):
    with open(os.path.join(model_dir, "chat_template.jinja"), encoding="utf-8") as f:
        merge = AnthropicServingMessages._detect_merge_inline_system(f.read())
    with open(requests, encoding="utf-8") as f, open(out, "w", encoding="utf-8") as o:
        for line in f:
            req = json.loads(line)
            if req["endpoint"] != "messages":
                continue
            rec = {"id": req["id"]}
            try:
                body = AnthropicMessagesRequest.model_validate(req["body"])
                chat = AnthropicServingMessages.to_chat_completion_request(
                    body, merge_inline_system=merge, disabled_thinking_effort="none")
            except Exception as e:  # noqa: BLE001 - vLLM answers these with an error
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                o.write(json.dumps(rec) + "\n")
                continue
            if chat.reasoning_effort is not None:
                rec["skipped"] = "reasoning_effort"
            elif STAMPED.search(json.dumps(chat.messages)):
                # A tool_use without an id gets call_<unix seconds>: the
                # clock of the conversion, not the body, decides its ids.
                rec["skipped"] = "stamped tool id"
            else:
                tok = {"model": "test", "messages": chat.messages}
                if chat.tools is not None:
                    tok["tools"] = [t.model_dump() for t in chat.tools]
                if chat.chat_template_kwargs is not None:
                    tok["chat_template_kwargs"] = chat.chat_template_kwargs
                rec["tokenize"] = tok
            o.write(json.dumps(rec, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if len(sys.argv) == 5 and sys.argv[2] == "--emit":
        emit(sys.argv[1], sys.argv[3], sys.argv[4])
    else:
        main(*sys.argv[1:])
