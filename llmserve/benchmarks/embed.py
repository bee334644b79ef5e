"""``llmserve bench embed``: embeddings throughput, offline ``LLM.embed`` against
sentence-transformers' ``encode`` on the same sentences in the same run (and their
agreement, min cosine), and optionally a running server at N concurrent clients (one
sentence per request) against the offline figure.

    llmserve bench embed --num-sentences 2000 --min-words 8 --max-words 128
    llmserve bench embed --server-url http://127.0.0.1:8000 --concurrency 32
    llmserve bench embed --start-server --skip-st --rounds 3   # server vs offline, same run

Every part runs in alternating rounds in this one run (a shared machine's load hits all
parts alike); medians of sentences per second, their ratios, and sentences per CPU second
(this process and its children: the offline EngineCore, or the started server and its
engine plus the HTTP clients), which other load on the machine does not skew.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

WORDS = ("the quick brown fox jumps over a lazy dog while engineers measure embeddings of sentences about "
         "rivers mountains cities music science history coffee trains rain Paris Tokyo 42 don't e-mail café "
         "GPU CPU kernel batch").split()


def make_sentences(n: int, lo: int, hi: int, seed: int) -> list[str]:
    """``n`` sentences of lo..hi words from a fixed vocabulary (deterministic)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "." for _ in range(n)]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-sentences", type=int, default=2000)
    parser.add_argument("--min-words", type=int, default=8)
    parser.add_argument("--max-words", type=int, default=128)
    parser.add_argument("--st-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-st", action="store_true", help="Do not run sentence-transformers.")
    parser.add_argument("--skip-offline", action="store_true", help="Only the server part.")
    parser.add_argument("--server-url", default=None, help="Also load-test this server's /v1/embeddings.")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--start-server", action="store_true",
                        help="Start `llmserve serve --model MODEL` on a free port for the server part.")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--rounds", type=int, default=3,
                        help="Alternating offline / sentence-transformers / server rounds; the medians are compared.")
    parser.add_argument("--output-json", default=None)


def _cpu_s() -> float:
    """CPU seconds used so far by this process and its children (the EngineCore)."""
    import os

    from llmserve.benchmarks.proc_stats import tree_cpu_s

    return tree_cpu_s(os.getpid())


def _timed(fn, sents: list[str]):
    """(sentences per wall second, sentences per CPU second, output). CPU seconds are
    robust to other load on a shared machine, where wall time measures its scheduler."""
    c, t = _cpu_s(), time.perf_counter()
    out = fn(sents)
    wall, cpu = time.perf_counter() - t, _cpu_s() - c
    return len(sents) / wall, len(sents) / max(cpu, 1e-9), out


def _rounds(args: argparse.Namespace, sents: list[str]) -> dict:
    """Offline ``LLM.embed``, sentence-transformers ``encode`` (batch ``st_batch_size``)
    and the server at ``concurrency`` clients, in alternating rounds in this one run (the
    machine is shared: a load change hits all), medians of sentences/s, the ratios and
    the agreement with sentence-transformers (min cosine)."""
    import statistics

    import numpy as np

    runs: dict = {}
    llm = None
    if not args.skip_offline:
        from llmserve import LLM

        llm = LLM(args.model, dtype=args.dtype)
        runs["offline"] = lambda s: [o.outputs.embedding for o in llm.embed(s, use_tqdm=False)]
    if args.server_url:
        runs["server"] = lambda s: asyncio.run(_server(args, s))
    if not args.skip_offline and not args.skip_st:
        from sentence_transformers import SentenceTransformer

        from llmserve.model_loader import resolve_model

        st = SentenceTransformer(resolve_model(args.model).path, device="cpu")
        runs["st"] = lambda s: st.encode(s, batch_size=args.st_batch_size, convert_to_numpy=True)
    rates: dict = {k: [] for k in runs}
    per_cpu: dict = {k: [] for k in runs}
    outs: dict = {}
    server_errors = 0
    for k, fn in runs.items():
        fn(sents[:64])  # warm-up
    for _ in range(args.rounds):
        for k, fn in runs.items():
            r, rc, outs[k] = _timed(fn, sents)
            rates[k].append(r)
            per_cpu[k].append(rc)
            server_errors += sum(outs[k]) if k == "server" else 0
    if llm is not None:
        llm.shutdown()
    res: dict = {"rounds": args.rounds}
    for k in runs:
        res.update({f"{k}_rounds": rates[k], f"{k}_sentences_per_s": statistics.median(rates[k]),
                    f"{k}_sentences_per_cpu_s": statistics.median(per_cpu[k])})
    if "server" in runs:
        res["server_errors"] = server_errors
        if "offline" in runs:
            res["server_vs_offline"] = res["server_sentences_per_s"] / res["offline_sentences_per_s"]
            res["server_vs_offline_per_cpu_s"] = (res["server_sentences_per_cpu_s"]
                                                  / res["offline_sentences_per_cpu_s"])
    if "st" in rates:
        got, ref = np.asarray(outs["offline"]), outs["st"]
        res.update(min_cosine_vs_st=float(((got * ref).sum(1) / np.linalg.norm(got, axis=1)
                                           / np.linalg.norm(ref, axis=1)).min()))
        res["offline_vs_st"] = res["offline_sentences_per_s"] / res["st_sentences_per_s"]
        res["offline_vs_st_per_cpu_s"] = res["offline_sentences_per_cpu_s"] / res["st_sentences_per_cpu_s"]
    return res


async def _server(args: argparse.Namespace, sents: list[str]) -> list[int]:
    """Embed ``sents`` one per request from ``concurrency`` clients; a 0/1 error flag each.

    The clients use aiohttp with one keep-alive connection each: on a 2-core machine the
    load generator shares the CPUs with the server, and httpx spent 2.8 ms of client CPU
    per request against aiohttp's 0.43 ms (c=32, /v1/embeddings, same run), which the
    figure would otherwise charge to the server."""
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    queue = list(enumerate(sents))
    errors = [0]
    url = args.server_url.rstrip("/") + "/v1/embeddings"
    model = args.served_model_name or args.model

    async def client(http: aiohttp.ClientSession) -> None:
        while queue:
            _, s = queue.pop()
            async with http.post(url, json={"model": model, "input": s}) as r:
                await r.read()
                errors[0] += r.status != 200
    conn = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(headers=headers, connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=600)) as http:
        await asyncio.gather(*(client(http) for _ in range(args.concurrency)))
    return errors


def _start_server(args: argparse.Namespace):
    """``llmserve serve --model MODEL`` on a free port (logs to a temp file); sets
    ``args.server_url`` and returns the process once /health answers 200."""
    import socket
    import subprocess
    import sys
    import tempfile

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tempfile.NamedTemporaryFile(prefix="llmserve-bench-embed-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "llmserve.entrypoints.openai.api_server", "--model", args.model,
                             "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port),
                             "--disable-uvicorn-access-log"], stdout=log, stderr=subprocess.STDOUT)
    args.server_url = f"http://127.0.0.1:{port}"
    while proc.poll() is None:
        try:
            if httpx.get(args.server_url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server exited with {proc.returncode}; log: {log.name}")


def main(args: argparse.Namespace) -> dict:
    sents = make_sentences(args.num_sentences, args.min_words, args.max_words, args.seed)
    res: dict = {"num_sentences": len(sents), "threads": os.cpu_count(), "load_avg_start": os.getloadavg()[0]}
    server = _start_server(args) if args.start_server else None
    try:
        res.update(_rounds(args, sents))
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
    res["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(res, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return res
