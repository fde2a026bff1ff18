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


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(*sys.argv[1:])
