#!/usr/bin/env python3
"""Asks a live vLLM for the token ids of every request in a JSONL made by
tokenizer/tests/reference/gen_requests.py, and writes them in the format of
tokenizer/tests/reference/expected.py: {"id", "tokens"} or {"id", "error"}.

"tokenize" requests go to POST /tokenize, "render" ones to
POST /v1/responses/render (needs --enable-scale-out or a render server).

    python live_ids.py BASE_URL MODEL REQUESTS.jsonl OUT.jsonl
"""
import json
import sys
import urllib.error
import urllib.request


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def main(base, model, requests, out):
    with open(requests, encoding="utf-8") as f, open(out, "w", encoding="utf-8") as o:
        for line in f:
            req = json.loads(line)
            body = dict(req["body"], model=model)
            path = "/tokenize" if req["endpoint"] == "tokenize" else "/v1/responses/render"
            status, answer = post(base.rstrip("/") + path, body)
            if status == 200:
                ids = answer.get("tokens") if path == "/tokenize" else answer.get("token_ids")
                rec = {"id": req["id"], "tokens": ids}
            else:
                rec = {"id": req["id"], "error": answer.get("error", {}).get("message", str(status))}
            o.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(*sys.argv[1:])
