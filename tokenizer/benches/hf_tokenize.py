#!/usr/bin/env python3
"""Times what vLLM's /tokenize does for a chat body in Python: its message
parsing, transformers' apply_chat_template(tokenize=False) and the fast
tokenizer's encode (tests/reference/expected.py's path, which matches vLLM's
ids), on the bodies the Rust benchmark writes. Prints p50s in ms.

    python hf_tokenize.py MODEL_DIR PREFIX [URL]

reads PREFIX-cold.json and PREFIX-continuation.json; with URL (a vLLM server
of that model directory, e.g. http://localhost:8000), also times its
POST /tokenize on the same bodies.
"""
import json
import os
import statistics
import sys
import time
import urllib.request

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "reference"))
import expected  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402


def time_server(url, model_dir, body):
    data = json.dumps(dict(body, model=model_dir)).encode()
    took, count = [], 0
    for _ in range(15):
        req = urllib.request.Request(url.rstrip("/") + "/tokenize", data=data,
                                     headers={"content-type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req) as r:
            count = json.loads(r.read())["count"]
        took.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(took), count


def main(model_dir, prefix, url=None):
    tok = AutoTokenizer.from_pretrained(model_dir)
    fmt = expected.content_format(tok.chat_template)
    for name in ("cold", "continuation"):
        with open(f"{prefix}-{name}.json", encoding="utf-8") as f:
            req = {"endpoint": "tokenize", "body": json.load(f)}
        total, render, encode = [], [], []
        for _ in range(15):
            t0 = time.perf_counter()
            conv = [expected.parse_message(m, fmt, True) for m in req["body"]["messages"]]
            expected.postprocess(conv)
            text, _ = expected.render(tok, conv, None, None, True, False)
            t1 = time.perf_counter()
            ids = tok(text, add_special_tokens=False)["input_ids"]
            t2 = time.perf_counter()
            total.append((t2 - t0) * 1e3)
            render.append((t1 - t0) * 1e3)
            encode.append((t2 - t1) * 1e3)
        p = statistics.median
        print(f"{os.path.basename(model_dir)}\t{name}\t{len(ids)} tokens\tp50 {p(total):.2f} ms"
              f"\t(template {p(render):.2f} ms, encode {p(encode):.2f} ms)")
        if url:
            ms, count = time_server(url, model_dir, req["body"])
            print(f"{os.path.basename(model_dir)}\t{name}\tvLLM /tokenize\t{count} tokens\tp50 {ms:.2f} ms")


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    main(*sys.argv[1:])
