"""Two llmserve instances behind vLLM's router (PyPI ``vllm-router``) vs one instance, on a
multi-turn chat trace (issue 35 item 5):

    python -m llmserve.benchmarks.router_trace [--model SmolLM2-135M-Instruct]
        [--conversations 16] [--turns 4] [--concurrency 4] [--max-tokens 16]
        [--policies cache_aware,round_robin] [--num-threads 1]

Each conversation's turns share their prefix (every turn resends the whole chat so far).
One fresh instance runs the trace with ``--concurrency`` conversations at a time; then,
per policy, two fresh instances behind ``vllm-router --policy P`` run it with twice the
conversations at a time (the same load per instance). Reported: the prefix-cache hit rate
(``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``, summed over the
instances), requests/s and output tokens/s, and how the requests split between the
instances (``vllm:request_success_total``). Each instance gets ``--num-threads`` torch
threads, so the pair uses twice the cores of the single instance when the machine has
them. The trace and the metric scraping are also used by tests/e2e/test_vllm_router.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from typing import Any, Optional

import httpx

_WORDS = ("river stone lamp orbit cedar violet harbor quartz meadow signal copper lantern glacier "
          "ember willow falcon prism canyon thistle marble beacon fern tundra cobalt").split()

ROUTER_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def multi_turn_trace(conversations: int, turns: int, seed: int = 0, context_words: int = 120,
                     turn_words: int = 25) -> list[list[str]]:
    """Per conversation, its user messages: the first carries a long context of its own
    (what prefix caching saves), later ones are short follow-ups."""
    rng = random.Random(seed)
    trace = []
    for c in range(conversations):
        first = f"Conversation {c}. Notes: " + " ".join(rng.choice(_WORDS) for _ in range(context_words))
        follow = [f"Turn {t}: " + " ".join(rng.choice(_WORDS) for _ in range(turn_words)) for t in range(1, turns)]
        trace.append([first] + follow)
    return trace


async def _conversation(client: httpx.AsyncClient, model: str, messages_in: list[str], max_tokens: int,
                        stats: dict) -> None:
    messages: list[dict] = []
    for text in messages_in:
        messages.append({"role": "user", "content": text})
        r = await client.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                             "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        body = r.json()
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""})
        stats["requests"] += 1
        stats["output_tokens"] += body["usage"]["completion_tokens"]


async def _run_trace(base_url: str, model: str, trace: list[list[str]], concurrency: int, max_tokens: int,
                     headers: Optional[dict] = None) -> dict:
    stats = {"requests": 0, "output_tokens": 0}
    sem = asyncio.Semaphore(concurrency)

    async def one(conv: list[str]) -> None:
        async with sem:
            await _conversation(client, model, conv, max_tokens, stats)

    async with httpx.AsyncClient(base_url=base_url, timeout=600, headers=headers) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(c) for c in trace))
        stats["seconds"] = time.perf_counter() - t0
    return stats


def run_trace(base_url: str, model: str, trace: list[list[str]], concurrency: int, max_tokens: int,
              headers: Optional[dict] = None) -> dict:
    """Run every conversation (turns in order, ``concurrency`` conversations at a time)
    against ``base_url``; returns requests, output_tokens and seconds. Raises
    httpx.HTTPStatusError on a failed request."""
    return asyncio.run(_run_trace(base_url, model, trace, concurrency, max_tokens, headers))


def scrape(url: str, headers: Optional[dict] = None) -> dict[str, float]:
    """The server's /metrics as {series name: value summed over its labels}."""
    out: dict[str, float] = {}
    for line in httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=30).text.splitlines():
        m = re.match(r"([a-zA-Z_:]+)(?:\{[^}]*\})? (\S+)$", line)
        if m:
            out[m[1]] = out.get(m[1], 0.0) + float(m[2])
    return out


def prefix_hit_rate(before: list[dict], after: list[dict]) -> float:
    """Prefix-cache hit rate (tokens) over the instances between two scrapes."""
    hits = sum(a.get("vllm:prefix_cache_hits_total", 0) - b.get("vllm:prefix_cache_hits_total", 0)
               for a, b in zip(after, before))
    queries = sum(a.get("vllm:prefix_cache_queries_total", 0) - b.get("vllm:prefix_cache_queries_total", 0)
                  for a, b in zip(after, before))
    return hits / queries if queries else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Wait for GET /health == 200; RuntimeError when the process exits or time runs out."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


def start_router(worker_urls: list[str], policy: str, log_path: str = os.devnull) -> tuple[subprocess.Popen, str]:
    """``vllm-router --policy <policy> --worker-urls ...`` on a free port; (process, url).
    Raises RuntimeError when the executable is missing (pip install vllm-router)."""
    exe = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable), "vllm-router")
    if not os.path.exists(exe):
        raise RuntimeError("vllm-router is not installed: pip install vllm-router")
    port = free_port()
    cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *worker_urls,
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 120)
    return proc, url


def _start_instance(model: str, threads: int, kv: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "serve", model, "--port", str(port), "--host",
           "127.0.0.1", "--served-model-name", "m", "--num-threads", str(threads), "--kv-cache-memory", kv,
           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def _measure(base_url: str, worker_urls: list[str], trace: list[list[str]], concurrency: int,
             max_tokens: int) -> dict[str, Any]:
    before = [scrape(u) for u in worker_urls]
    stats = run_trace(base_url, "m", trace, concurrency, max_tokens)
    after = [scrape(u) for u in worker_urls]
    return {"requests": stats["requests"], "seconds": round(stats["seconds"], 2),
            "requests_per_s": round(stats["requests"] / stats["seconds"], 3),
            "output_tokens_per_s": round(stats["output_tokens"] / stats["seconds"], 2),
            "prefix_cache_hit_rate": round(prefix_hit_rate(before, after), 4),
            "requests_per_instance": [a.get("vllm:request_success_total", 0) - b.get("vllm:request_success_total", 0)
                                      for a, b in zip(after, before)],
            "loadavg": os.getloadavg()}


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4, help="conversations at a time per instance")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--kv-cache-memory", default="256MiB")
    args = p.parse_args(argv)
    trace = multi_turn_trace(args.conversations, args.turns)
    result: dict[str, Any] = {"conversations": args.conversations, "turns": args.turns,
                              "concurrency_per_instance": args.concurrency, "max_tokens": args.max_tokens}
    proc, url = _start_instance(args.model, args.num_threads, args.kv_cache_memory)
    try:
        result["single"] = _measure(url, [url], trace, args.concurrency, args.max_tokens)
    finally:
        _stop([proc])
    print(json.dumps({"single": result["single"]}), flush=True)
    for policy in args.policies.split(","):
        insts = [_start_instance(args.model, args.num_threads, args.kv_cache_memory) for _ in range(2)]
        procs = [p for p, _ in insts]
        try:
            router, rurl = start_router([u for _, u in insts], policy)
            procs.append(router)
            result[f"pair_{policy}"] = _measure(rurl, [u for _, u in insts], trace, 2 * args.concurrency,
                                                args.max_tokens)
        finally:
            _stop(procs)
        print(json.dumps({f"pair_{policy}": result[f"pair_{policy}"]}), flush=True)
    single = result["single"]["prefix_cache_hit_rate"]
    for policy in args.policies.split(","):
        pair = result[f"pair_{policy}"]
        pair["hit_rate_vs_single"] = round(pair["prefix_cache_hit_rate"] / single, 3) if single else None
        pair["throughput_vs_single"] = round(pair["requests_per_s"] / result["single"]["requests_per_s"], 3)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
