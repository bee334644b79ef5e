"""``llmserve bench serve --base-url A --compare-url B --compare-url-rounds N``: the same
requests on two servers (e.g. one with request timelines and tracing on, one with both
off), alternating A, B, B, A... so that load from elsewhere on a shared machine hits both
alike; reports each round, the medians of output throughput, TPOT and TTFT, and their
ratios A / B. The overhead figure of issue 33.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from typing import Any, Awaitable, Callable

FIGURES = ("output_throughput", "median_tpot_ms", "median_ttft_ms")


def compare_servers(args: argparse.Namespace, urls: list[str], models: list[str], requests: list, chat: bool,
                    benchmark: Callable[..., Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """Run ``args.compare_url_rounds`` rounds per server (``urls``: the two API urls,
    ``models``: each one's model name); returns ``{"rounds": [...], "medians": {url:
    {figure: x}}, "ratios": {figure: A / B}}``. ``benchmark``: ``serve.benchmark``."""
    rounds: list[dict[str, Any]] = []
    for r in range(args.compare_url_rounds):
        order = [0, 1] if r % 2 == 0 else [1, 0]
        for i in order:
            res = asyncio.run(benchmark(args, urls[i], models[i], requests, chat))
            row = {"server": urls[i], "round": r, "failed": res["failed"], "loadavg_1m": os.getloadavg()[0],
                   **{k: res[k] for k in FIGURES}}
            rounds.append(row)
            print(f"round {r} {urls[i]:<40} output {row['output_throughput']:8.2f} tok/s  TPOT "
                  f"{row['median_tpot_ms']:.2f} ms  TTFT {row['median_ttft_ms']:.0f} ms  ({row['failed']} failed, "
                  f"load {row['loadavg_1m']:.2f})")
    medians = {u: {k: statistics.median(x[k] for x in rounds if x["server"] == u) for k in FIGURES} for u in urls}
    ratios = {k: medians[urls[0]][k] / medians[urls[1]][k] if medians[urls[1]][k] else 0.0 for k in FIGURES}
    for k in FIGURES:
        print(f"median {k:<18} {medians[urls[0]][k]:10.2f} {medians[urls[1]][k]:10.2f}  ratio {ratios[k]:.4f}")
    return {"rounds": rounds, "medians": medians, "ratios": ratios, "loadavg": list(os.getloadavg())}
