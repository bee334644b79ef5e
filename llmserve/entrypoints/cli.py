"""The ``llmserve`` command (vLLM's ``vllm`` CLI).

    llmserve serve [MODEL] [flags]        OpenAI-compatible server (see ``llmserve serve --help``)
    llmserve bench serve|throughput|latency [flags]

Each ``bench`` subcommand lives in ``llmserve.benchmarks.<name>``, which exposes
``add_cli_args(parser)`` and ``main(args)``; only the chosen one is imported, so
``llmserve --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

BENCHMARKS = {
    "serve": "Load-test a running OpenAI-compatible server (TTFT, TPOT, ITL, throughput).",
    "throughput": "Offline throughput of the engine on a batch of prompts.",
    "latency": "Offline latency of one batch, end to end.",
    "engine-split": "AsyncLLM over the process split vs an in-process engine, same workload.",
    "embed": "Embeddings: offline LLM.embed vs sentence-transformers, and a server at N clients.",
    "seed-repro": "Seeded requests alone, batched, preempted, prefix-cached, chunked: same text.",
    "tenants": "Tenants: a flooder vs a quiet tenant and weights 1:3, FIFO vs fair share, same run.",
    "spec-decode": "n-gram speculative decoding: TPOT with and without, same run, c=1 (edit/chat workloads).",
}


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    from llmserve.entrypoints.openai.cli_args import make_arg_parser

    from llmserve.entrypoints.openai.cli_args import HelpFormatter

    p = subparsers.add_parser("serve", help="Start the OpenAI-compatible HTTP server.",
                              description="Start the OpenAI-compatible HTTP server "
                                          "(defaults: model SmolLM2-135M-Instruct, port 8000).",
                              formatter_class=HelpFormatter)
    make_arg_parser(p)
    p.set_defaults(dispatch=_run_serve)


def _run_serve(args: argparse.Namespace) -> None:
    if (getattr(args, "data_parallel_size", 1) or 1) == 1 and (getattr(args, "api_server_count", 1) or 1) == 1:
        from llmserve.engine.core_process import prestart_engine_process
        prestart_engine_process()  # its imports overlap the server's (~2 s of start-up)
    # This process serves HTTP and never runs a model: its transformers runs without torch
    # (issue 31: 3 s less to start on 2 cores, ~150 MiB less at rest; torch_hiding.py).
    from llmserve.torch_hiding import import_transformers_without_torch

    import_transformers_without_torch()
    from llmserve.engine.exceptions import EngineInitError
    from llmserve.entrypoints.openai.cli_args import flag_message, validate_parsed_serve_args
    from llmserve.entrypoints.openai.api_server import run_server
    from llmserve.entrypoints.openai.multi_api_server import run_api_servers
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        validate_parsed_serve_args(args)
        if getattr(args, "headless", False):  # engines only: multi-node data parallel
            from llmserve.entrypoints.headless import run_headless
            sys.exit(run_headless(args))
        code = run_api_servers(args, run_server)
    except ValueError as e:  # a bad flag or model: one line naming the flag typed, not a traceback
        print(f"llmserve serve: error: {flag_message(str(e))}", file=sys.stderr)
        sys.exit(2)
    except EngineInitError as e:  # the engine's log above has the details
        print(f"llmserve serve: error: {flag_message(str(e))}", file=sys.stderr)
        sys.exit(1)
    if code:  # the engine died: exit non-zero so that a supervisor restarts the server
        sys.exit(code)


def _add_bench(subparsers: argparse._SubParsersAction, chosen: Optional[str]) -> None:
    bench = subparsers.add_parser("bench", help="Benchmarks: serve, throughput, latency.",
                                  description="Benchmarks.")
    bench_sub = bench.add_subparsers(dest="bench_type", metavar="{" + ",".join(BENCHMARKS) + "}")
    for name, doc in BENCHMARKS.items():
        p = bench_sub.add_parser(name, help=doc, description=doc)
        if name == chosen:  # import only the benchmark that runs (its flags need its module)
            module = importlib.import_module(f"llmserve.benchmarks.{name.replace('-', '_')}")
            module.add_cli_args(p)
            p.set_defaults(dispatch=module.main)
    bench.set_defaults(dispatch=lambda _args: (bench.print_help(), sys.exit(2)))


class _ShortErrorParser(argparse.ArgumentParser):
    """argparse, except that a bad command line prints the error and where the options
    are, not the whole usage first (``serve``'s usage is ~200 lines, which pushed the
    one line that matters off the screen). Exit code 2, as argparse."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}\n(see '{self.prog} --help' for the options)\n")


def make_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The top-level parser; ``argv`` decides which bench module gets imported."""
    parser = _ShortErrorParser(
        prog="llmserve", description="llmserve: LLM inference and serving engine (vLLM-compatible CLI).")
    from llmserve import __version__

    parser.add_argument("--version", action="version", version=f"llmserve {__version__}")
    sub = parser.add_subparsers(dest="subcommand", metavar="{serve,bench,disagg-proxy}")
    _add_serve(sub)
    from llmserve.entrypoints.disagg_proxy import add_parser as add_disagg_proxy

    add_disagg_proxy(sub)
    chosen = None
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        chosen = argv[1]
    _add_bench(sub, chosen)
    return parser


# Flags after which the engine may be started otherwise (data parallel, several API
# servers, engines only) or that may set those (--config), or that start nothing.
_NOT_PLAIN_SERVE = ("-h", "--help", "--config", "--headless", "-dp", "--data-parallel", "-asc", "--api-server-count")


def _plain_serve(argv: list[str]) -> bool:
    """Whether ``argv`` is ``serve`` with one engine for sure, whose interpreter can then
    start before the flags are even parsed: the engine's imports (torch, transformers,
    ~2 s on 2 cores) are the longest part of a warm start. Any other case starts it in
    ``_run_serve`` as before; an interpreter left unused exits with the server."""
    return bool(argv) and argv[0] == "serve" and not any(a.startswith(_NOT_PLAIN_SERVE) for a in argv[1:])


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point of the ``llmserve`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if _plain_serve(argv):
        from llmserve.engine.core_process import prestart_engine_process

        prestart_engine_process()  # before the parser: its imports (fastapi) take ~0.5 s
    parser = make_parser(argv)
    if argv and argv[0] == "serve":  # --config FILE: its flags first, the command line's win
        from llmserve.entrypoints.openai.vllm_compat_args import expand_config_file

        argv = expand_config_file(argv, parser)
    args = parser.parse_args(argv)
    dispatch = getattr(args, "dispatch", None)
    if dispatch is None:
        parser.print_help()
        sys.exit(2)
    dispatch(args)


if __name__ == "__main__":
    main()
