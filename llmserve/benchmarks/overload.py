"""Overload check of admission control (issue 17): ``python -m llmserve.benchmarks.overload``.

``--concurrency`` clients (closed loop, for ``--duration`` seconds) each stream completions
back to back; a 429/503 must carry ``Retry-After``, which the client then honours (as
the official ``openai`` client does). Reports the status counts, refusals without
Retry-After, timeouts, other errors, and the median/p90 time to first token of accepted
requests.

``--ab-rounds N`` measures the "within 2x of an unloaded server" figure side by side: it
alternates N rounds of ``--baseline-concurrency`` clients (default 128, the server's
``max_num_seqs``: the concurrency the server accepts and runs, without overload traffic)
and of ``--concurrency`` clients (the overload) against the same server, and reports the
medians of each round's median TTFT, their ratio and the load average.

    python -m llmserve.benchmarks.overload --concurrency 256 --ab-rounds 2 --duration 45
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import time
from typing import Any

import aiohttp


async def _one(session: aiohttp.ClientSession, url: str, body: dict, headers: dict, timeout: float,
               stats: dict[str, Any]) -> float:
    """One streamed request; returns the seconds the client should wait before the next."""
    start = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            stats["status"][resp.status] += 1
            if resp.status != 200:
                retry = resp.headers.get("Retry-After")
                if resp.status in (429, 503):
                    if retry is None:
                        stats["no_retry_after"] += 1
                    await resp.read()
                    return float(retry or 1)
                stats["errors"].append((resp.status, (await resp.text())[:200]))
                return 1.0
            first = None
            async for line in resp.content:
                if first is None and line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if any(c.get("text") for c in chunk.get("choices", [])):
                        first = time.perf_counter() - start
            if first is not None:
                stats["ttft"].append(first)
            return 0.0
    except asyncio.TimeoutError:
        stats["timeouts"] += 1
    except aiohttp.ClientError as e:
        stats["errors"].append(("client", str(e)[:200]))
    return 1.0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Drive the server; returns the summary dict."""
    url = args.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    body = {"model": args.model, "prompt": args.prompt, "max_tokens": args.max_tokens, "ignore_eos": True,
            "stream": True}
    stats: dict[str, Any] = {"status": collections.Counter(), "no_retry_after": 0, "timeouts": 0, "errors": [],
                             "ttft": []}
    end = time.monotonic() + args.duration

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < end:
            wait = await _one(session, url, body, headers, args.timeout, stats)
            if wait:
                await asyncio.sleep(min(wait, max(0.0, end - time.monotonic())))

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        await asyncio.gather(*(client(session) for _ in range(args.concurrency)))
    ttft = sorted(stats["ttft"])
    return {"concurrency": args.concurrency, "duration_s": args.duration,
            "status": dict(stats["status"]), "refusals_without_retry_after": stats["no_retry_after"],
            "refusals_not_429": sum(n for code, n in stats["status"].items() if code not in (200, 429)),
            "timeouts": stats["timeouts"], "other_errors": stats["errors"][:5], "n_errors": len(stats["errors"]),
            "ttft_median_s": statistics.median(ttft) if ttft else None,
            "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))] if ttft else None}


async def run_ab(args: argparse.Namespace) -> dict[str, Any]:
    """Alternate baseline and overload rounds (see the module docstring)."""
    import os

    rounds: dict[str, list] = {"baseline": [], "overload": []}
    load = [os.getloadavg()[0]]
    for _ in range(args.ab_rounds):
        for kind, c in (("baseline", args.baseline_concurrency), ("overload", args.concurrency)):
            res = await run(argparse.Namespace(**{**vars(args), "concurrency": c}))
            rounds[kind].append(res)
            load.append(os.getloadavg()[0])
            await asyncio.sleep(args.pause)  # the queue drains: each round starts alike
    med = {k: statistics.median(r["ttft_median_s"] for r in v if r["ttft_median_s"] is not None)
           for k, v in rounds.items()}
    return {"rounds": rounds, "baseline_ttft_median_s": med["baseline"], "overload_ttft_median_s": med["overload"],
            "ttft_ratio": med["overload"] / med["baseline"], "load_avg": load,
            "timeouts": sum(r["timeouts"] for v in rounds.values() for r in v),
            "refusals_without_retry_after": sum(r["refusals_without_retry_after"] for v in rounds.values() for r in v),
            "refusals_not_429": sum(r["refusals_not_429"] for v in rounds.values() for r in v),
            "other_errors": sum(r["n_errors"] for v in rounds.values() for r in v)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--duration", type=float, default=60.0, help="Seconds of load.")
    parser.add_argument("--prompt", default="Write a short story about a robot learning to paint.")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=300.0, help="Client timeout per request (s).")
    parser.add_argument("--ab-rounds", type=int, default=0,
                        help="Alternate this many baseline/overload rounds and report the TTFT ratio.")
    parser.add_argument("--baseline-concurrency", type=int, default=128,
                        help="Clients of the unloaded rounds (default: the server's max_num_seqs, 128).")
    parser.add_argument("--pause", type=float, default=5.0, help="Seconds between A/B rounds.")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run_ab(args) if args.ab_rounds else run(args)), indent=1))


if __name__ == "__main__":
    main()
