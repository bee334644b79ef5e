"""Offline data parallel: N processes, each with its own ``LLM`` (its own engine and
cores / N torch threads), each generating its share of the prompts; the parent gathers the
outputs in prompt order. (``LLM(data_parallel_size=N)`` in one process raises ValueError
and points here, as vLLM's does to its example of the same name.)

    python examples/offline_inference/data_parallel.py --dp-size 2 --num-prompts 16 --max-tokens 32
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os


def run_rank(rank: int, dp_size: int, args: argparse.Namespace, prompts: list[str], results) -> None:
    """One DP rank: prompts[rank::dp_size] through its own LLM; puts (index, text) pairs."""
    from llmserve import LLM, SamplingParams

    threads = max(1, len(os.sched_getaffinity(0)) // dp_size)
    llm = LLM(args.model, num_threads=threads, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
              **({"tokenizer": args.tokenizer} if args.tokenizer else {}))
    mine = list(range(rank, len(prompts), dp_size))
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    outs = llm.generate([prompts[i] for i in mine], sp, use_tqdm=False)
    results.put([(i, o.outputs[0].text) for i, o in zip(mine, outs)])
    llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dp-size", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args()
    prompts = [f"Write one sentence about the number {i}." for i in range(args.num_prompts)]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, args.dp_size, args, prompts, results)) for r in range(args.dp_size)]
    for proc in procs:
        proc.start()
    texts: dict[int, str] = {}
    for _ in procs:
        texts.update(results.get())
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"a DP rank failed (exit code {proc.exitcode})")
    for i in range(len(prompts)):
        print(f"[{i}] {prompts[i]!r} -> {texts[i]!r}")


if __name__ == "__main__":
    main()
