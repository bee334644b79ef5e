"""``llmserve bench embed``: embeddings throughput, offline ``LLM.embed`` against
sentence-transformers' ``encode`` on the same sentences in the same run (and their
agreement, min cosine), and optionally a running server at N concurrent clients (one
sentence per request) against the offline figure.

    llmserve bench embed --num-sentences 2000 --min-words 8 --max-words 128
    llmserve bench embed --server-url http://127.0.0.1:8000 --concurrency 32
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
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--rounds", type=int, default=3,
                        help="Alternating offline / sentence-transformers rounds; the medians are compared.")
    parser.add_argument("--output-json", default=None)


def _timed(fn, sents: list[str]):
    t = time.perf_counter()
    out = fn(sents)
    return len(sents) / (time.perf_counter() - t), out


def _offline_and_st(args: argparse.Namespace, sents: list[str]) -> dict:
    """Offline ``LLM.embed`` and sentence-transformers ``encode`` (batch ``st_batch_size``)
    in alternating rounds in this one run (the machine is shared: a load change hits
    both), medians of sentences/s, their ratio and the agreement (min cosine)."""
    import statistics

    import numpy as np

    from llmserve import LLM

    llm = LLM(args.model, dtype=args.dtype)
    runs = {"offline": lambda s: [o.outputs.embedding for o in llm.embed(s, use_tqdm=False)]}
    if not args.skip_st:
        from sentence_transformers import SentenceTransformer

        from llmserve.model_loader import resolve_model

        st = SentenceTransformer(resolve_model(args.model).path, device="cpu")
        runs["st"] = lambda s: st.encode(s, batch_size=args.st_batch_size, convert_to_numpy=True)
    rates: dict = {k: [] for k in runs}
    outs: dict = {}
    for k, fn in runs.items():
        fn(sents[:64])  # warm-up
    for _ in range(args.rounds):
        for k, fn in runs.items():
            r, outs[k] = _timed(fn, sents)
            rates[k].append(r)
    llm.shutdown()
    res = {"rounds": args.rounds, "offline_rounds": rates["offline"],
           "offline_sentences_per_s": statistics.median(rates["offline"])}
    if "st" in rates:
        got, ref = np.asarray(outs["offline"]), outs["st"]
        res.update(st_rounds=rates["st"], st_sentences_per_s=statistics.median(rates["st"]),
                   min_cosine_vs_st=float(((got * ref).sum(1) / np.linalg.norm(got, axis=1)
                                           / np.linalg.norm(ref, axis=1)).min()))
        res["offline_vs_st"] = res["offline_sentences_per_s"] / res["st_sentences_per_s"]
    return res


async def _server(args: argparse.Namespace, sents: list[str]) -> tuple[float, int]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    queue = list(enumerate(sents))
    errors = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal errors
        while queue:
            _, s = queue.pop()
            r = await http.post("/v1/embeddings", json={"model": args.served_model_name or args.model, "input": s})
            errors += r.status_code != 200
    async with httpx.AsyncClient(base_url=args.server_url, headers=headers, timeout=600) as http:
        await http.post("/v1/embeddings", json={"model": args.served_model_name or args.model, "input": "warm up"})
        t = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(args.concurrency)))
        return len(sents) / (time.perf_counter() - t), errors


def main(args: argparse.Namespace) -> dict:
    sents = make_sentences(args.num_sentences, args.min_words, args.max_words, args.seed)
    res: dict = {"num_sentences": len(sents), "threads": os.cpu_count(), "load_avg_start": os.getloadavg()[0]}
    if not args.skip_offline:
        res.update(_offline_and_st(args, sents))
    if args.server_url:
        res["server_sentences_per_s"], res["server_errors"] = asyncio.run(_server(args, sents))
        if "offline_sentences_per_s" in res:
            res["server_vs_offline"] = res["server_sentences_per_s"] / res["offline_sentences_per_s"]
    res["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(res, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return res
