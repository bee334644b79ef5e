"""``llmserve bench serve --endpoint A --compare-endpoint B``: the same requests on two
endpoints of one server, alternating A, B, A, B... (``--compare-rounds`` each) so that
load from elsewhere on the machine hits both alike; reports each round, the medians and
the output-throughput ratio A / B. The figure of issue 13: 32 concurrent streamed
``/v1/responses`` against the same load on ``/v1/chat/completions``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from typing import Any, Awaitable, Callable


def compare_endpoints(args: argparse.Namespace, base_url: str, model: str, tokenizer: Any,
                      sampled: list[tuple[list[int], int]],
                      benchmark: Callable[..., Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """Run the rounds; returns ``{"rounds": [...], "median_output_throughput": {A: x, B: y},
    "output_throughput_ratio": x / y, "loadavg": [...]}``. Both endpoints get the same
    decoded text prompts and output lengths. ``benchmark``: ``serve.benchmark`` (one run
    of the requests on one endpoint), passed in by ``serve``, which imports this module
    (no import circle)."""
    endpoints = [args.endpoint, args.compare_endpoint]
    rounds: list[dict[str, Any]] = []
    for r in range(args.compare_rounds):
        for endpoint in (endpoints if r % 2 == 0 else endpoints[::-1]):
            chat = "completions" not in endpoint or "chat" in endpoint
            requests = [((tokenizer.decode(ids) if chat else ids), len(ids), olen) for ids, olen in sampled]
            res = asyncio.run(benchmark(args, base_url.rstrip("/") + endpoint, model, requests, chat))
            rounds.append({"endpoint": endpoint, "round": r, "output_throughput": res["output_throughput"],
                           "total_output_tokens": res["total_output_tokens"], "failed": res["failed"],
                           "median_ttft_ms": res["median_ttft_ms"], "median_tpot_ms": res["median_tpot_ms"],
                           "loadavg_1m": os.getloadavg()[0]})
            print(f"round {r} {endpoint:<22} output {res['output_throughput']:8.2f} tok/s  "
                  f"({res['total_output_tokens']} tokens, {res['failed']} failed, median TTFT "
                  f"{res['median_ttft_ms']:.0f} ms, TPOT {res['median_tpot_ms']:.1f} ms, "
                  f"load {os.getloadavg()[0]:.2f})")
    medians = {e: statistics.median(x["output_throughput"] for x in rounds if x["endpoint"] == e)
               for e in endpoints}
    ratio = medians[endpoints[0]] / medians[endpoints[1]] if medians[endpoints[1]] else 0.0
    print(f"median output tok/s: {endpoints[0]} {medians[endpoints[0]]:.2f}, {endpoints[1]} "
          f"{medians[endpoints[1]]:.2f}; ratio {ratio:.3f}x (load average {os.getloadavg()})")
    return {"rounds": rounds, "median_output_throughput": medians, "output_throughput_ratio": ratio,
            "loadavg": list(os.getloadavg())}
