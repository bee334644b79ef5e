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
    parser.add_argument("--output-json", default=None)


def _offline(args: argparse.Namespace, sents: list[str]) -> tuple[float, list[list[float]]]:
    from llmserve import LLM

    llm = LLM(args.model, dtype=args.dtype)
    llm.embed(sents[:32], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.embed(sents, use_tqdm=False)
    dt = time.perf_counter() - t
    llm.shutdown()
    return len(sents) / dt, [o.outputs.embedding for o in outs]


def _st(args: argparse.Namespace, sents: list[str]):
    from sentence_transformers import SentenceTransformer

    from llmserve.model_loader import resolve_model

    st = SentenceTransformer(resolve_model(args.model).path, device="cpu")
    st.encode(sents[:64], batch_size=args.st_batch_size)
    t = time.perf_counter()
    ref = st.encode(sents, batch_size=args.st_batch_size, convert_to_numpy=True)
    return len(sents) / (time.perf_counter() - t), ref


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
    import numpy as np

    sents = make_sentences(args.num_sentences, args.min_words, args.max_words, args.seed)
    res: dict = {"num_sentences": len(sents), "threads": os.cpu_count()}
    if not args.skip_offline:
        res["offline_sentences_per_s"], vecs = _offline(args, sents)
        if not args.skip_st:
            res["st_sentences_per_s"], ref = _st(args, sents)
            got = np.asarray(vecs)
            res["min_cosine_vs_st"] = float(((got * ref).sum(1) / np.linalg.norm(got, axis=1)
                                             / np.linalg.norm(ref, axis=1)).min())
            res["offline_vs_st"] = res["offline_sentences_per_s"] / res["st_sentences_per_s"]
    if args.server_url:
        res["server_sentences_per_s"], res["server_errors"] = asyncio.run(_server(args, sents))
        if "offline_sentences_per_s" in res:
            res["server_vs_offline"] = res["server_sentences_per_s"] / res["offline_sentences_per_s"]
    print(json.dumps(res, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return res
