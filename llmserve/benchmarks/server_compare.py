"""``llmserve bench serve --base-url A --compare-url B --compare-url-rounds N``: the same
requests on two servers (e.g. one with request timelines and tracing on, one with both
off), alternating A, B, B, A... so that load from elsewhere on a shared machine hits both
alike; reports each round, the medians of output throughput, TPOT and TTFT, and their
ratios A / B. The overhead figure of issue 33.

Each round (and each warm-up round) draws its own prompts (``--seed`` + round); the two
servers of a round get the same ones. With one set of prompts for every round, each
measured round sent prompts the server had already served, so its prefix cache answered
them: SmolLM2 Q4_K_M at 32 streams, 64 requests of 128 + 128 tokens, gave 742-785 output
tok/s with a 0.6 s median TTFT on repeated prompts against 515-532 tok/s and 1.9-2.6 s on
fresh ones (same server, same run), and a change to prefill could not show.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from typing import Any, Awaitable, Callable

from llmserve.benchmarks.proc_stats import tree_cpu_s

FIGURES = ("output_throughput", "median_tpot_ms", "median_ttft_ms")
CPU_FIGURE = "cpu_s_per_1k_output_tokens"


def _pids(args: argparse.Namespace) -> list[int] | None:
    """``--compare-server-pids A,B`` as two ints, or None."""
    raw = getattr(args, "compare_server_pids", None)
    if not raw:
        return None
    pids = [int(x) for x in raw.split(",")]
    if len(pids) != 2:
        raise ValueError("--compare-server-pids takes two process ids: PID_A,PID_B")
    return pids


def _cpu_per_1k(pid: int, cpu0: float, res: dict[str, Any]) -> float:
    """CPU seconds of ``pid``'s tree since ``cpu0`` per 1,000 output tokens of ``res``."""
    return 1000.0 * (tree_cpu_s(pid) - cpu0) / max(res["total_output_tokens"], 1)


def _per_round_ratios(rounds: list[dict[str, Any]], urls: list[str], figures: tuple[str, ...]) -> dict[str, float]:
    """Median over rounds of A's figure / B's figure in the same round: drift between
    rounds (other jobs on a shared machine) cancels within each pair."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rounds:
        by_round.setdefault(row["round"], {})[row["server"]] = row
    pairs = [r for r in by_round.values() if len(r) == 2]
    return {k: statistics.median(r[urls[0]][k] / r[urls[1]][k] for r in pairs if r[urls[1]][k]) for k in figures}


def round_seeds(seed: int, rounds: int, warm_rounds: int) -> tuple[list[int], list[int]]:
    """The prompt seeds of the measured rounds (``seed``, ``seed + 1``, ...: round 0 sends
    the requests the header line describes) and of the warm-up rounds (the next ones), all
    distinct, so no round repeats another's prompts."""
    return [seed + r for r in range(rounds)], [seed + rounds + w for w in range(warm_rounds)]


def compare_servers(args: argparse.Namespace, urls: list[str], models: list[str],
                    draw_requests: Callable[[int], list], chat: bool,
                    benchmark: Callable[..., Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """Run ``args.compare_url_rounds`` rounds per server (``urls``: the two API urls,
    ``models``: each one's model name; ``draw_requests(seed)``: that seed's request list,
    one per round, the same for both servers of the round); returns ``{"rounds": [...],
    "medians": {url: {figure: x}}, "ratios": {figure: A / B}}``. ``benchmark``:
    ``serve.benchmark``."""
    pids = _pids(args)
    figures = FIGURES + ((CPU_FIGURE,) if pids else ())
    seeds, warm_seeds = round_seeds(args.seed, args.compare_url_rounds, getattr(args, "compare_url_warm_rounds", 0))
    for seed in warm_seeds:
        requests = draw_requests(seed)
        for i in (0, 1):
            asyncio.run(benchmark(args, urls[i], models[i], requests, chat))
    rounds: list[dict[str, Any]] = []
    for r in range(args.compare_url_rounds):
        order = [0, 1] if r % 2 == 0 else [1, 0]
        requests = draw_requests(seeds[r])
        for i in order:
            cpu0 = tree_cpu_s(pids[i]) if pids else 0.0
            res = asyncio.run(benchmark(args, urls[i], models[i], requests, chat))
            row = {"server": urls[i], "round": r, "failed": res["failed"], "loadavg_1m": os.getloadavg()[0],
                   **{k: res[k] for k in FIGURES}}
            if pids:
                row[CPU_FIGURE] = _cpu_per_1k(pids[i], cpu0, res)
            rounds.append(row)
            cpu = f"  CPU {row[CPU_FIGURE]:.3f} s/1k tok" if pids else ""
            print(f"round {r} {urls[i]:<40} output {row['output_throughput']:8.2f} tok/s  TPOT "
                  f"{row['median_tpot_ms']:.2f} ms  TTFT {row['median_ttft_ms']:.0f} ms{cpu}  ({row['failed']} "
                  f"failed, load {row['loadavg_1m']:.2f})")
    medians = {u: {k: statistics.median(x[k] for x in rounds if x["server"] == u) for k in figures} for u in urls}
    ratios = {k: medians[urls[0]][k] / medians[urls[1]][k] if medians[urls[1]][k] else 0.0 for k in figures}
    paired = _per_round_ratios(rounds, urls, figures) if rounds else {}
    for k in figures:
        print(f"median {k:<18} {medians[urls[0]][k]:10.2f} {medians[urls[1]][k]:10.2f}  ratio {ratios[k]:.4f}  "
              f"per-round ratio median {paired.get(k, 0.0):.4f}")
    return {"rounds": rounds, "medians": medians, "ratios": ratios, "per_round_ratios": paired,
            "loadavg": list(os.getloadavg())}
