"""``llmserve bench engine-split``: the cost of the process split.

Runs the same workload (random prompts from a fixed seed, ignore_eos) through AsyncLLM
(EngineCore in its own process, ZMQ + msgspec, asyncio output handler) with
``--concurrency`` requests in flight, and through an in-process engine (LLMEngine over
InprocClient) stepping the same number of requests, in the same run, and prints output
tokens/s of each and their ratio (the AsyncLLM issue asks for >= 0.90).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any, Optional

from llmserve.benchmarks.datasets import sample_random_requests
from llmserve.engine_args import AsyncEngineArgs, EngineArgs
from llmserve.sampling_params import RequestOutputKind, SamplingParams


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each mode; medians reported")
    parser.add_argument("--output-json", default=None)


def _engine_kwargs(args) -> dict:
    return dict(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
                enable_prefix_caching=False, disable_log_stats=True)


def _params(n_out: int, kind: RequestOutputKind) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=n_out, ignore_eos=True, output_kind=kind, seed=None)


def run_inproc(engine, requests) -> float:
    """Step an in-process LLMEngine over all requests; returns elapsed seconds."""
    t0 = time.perf_counter()
    for i, (ids, n_out) in enumerate(requests):
        engine.add_request(f"inproc-{time.perf_counter_ns()}-{i}", {"prompt_token_ids": ids},
                           _params(n_out, RequestOutputKind.FINAL_ONLY))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


async def run_async(engine, requests, concurrency: int) -> float:
    """Stream every request through AsyncLLM.generate (DELTA), at most ``concurrency`` at once."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i, ids, n_out):
        async with sem:
            n = 0
            async for out in engine.generate({"prompt_token_ids": ids}, _params(n_out, RequestOutputKind.DELTA),
                                             f"async-{time.perf_counter_ns()}-{i}"):
                n += len(out.outputs[0].token_ids)
            if n != n_out:
                raise RuntimeError(f"request {i}: got {n} tokens, wanted {n_out}")

    t0 = time.perf_counter()
    await asyncio.gather(*[one(i, ids, n) for i, (ids, n) in enumerate(requests)])
    return time.perf_counter() - t0


def main(args: argparse.Namespace) -> dict:
    from llmserve.engine.async_llm import AsyncLLM
    from llmserve.engine.llm_engine import LLMEngine

    kw = _engine_kwargs(args)
    inproc = LLMEngine.from_engine_args(EngineArgs(**kw), multiprocess_mode=False)
    requests = sample_random_requests(inproc.tokenizer, args.num_prompts, args.input_len, args.output_len,
                                      0.0, args.seed)
    n_out = sum(n for _, n in requests)
    aengine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
    loop = asyncio.new_event_loop()
    t_in: list[float] = []
    t_as: list[float] = []
    try:
        run_inproc(inproc, requests[:8])  # warm-up
        loop.run_until_complete(run_async(aengine, requests[:8], args.concurrency))
        for _ in range(args.repeats):
            t_in.append(run_inproc(inproc, requests))
            t_as.append(loop.run_until_complete(run_async(aengine, requests, args.concurrency)))
    finally:
        async def _shutdown() -> None:  # inside the loop, so its tasks see their cancellation
            aengine.shutdown()
            await asyncio.sleep(0.05)
        loop.run_until_complete(_shutdown())
        inproc.shutdown()
        loop.close()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    res = {
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "concurrency": args.concurrency, "repeats": args.repeats,
        "inproc_output_tokens_per_s": n_out / med(t_in), "async_output_tokens_per_s": n_out / med(t_as),
        "inproc_runs_s": t_in, "async_runs_s": t_as,
    }
    res["ratio_async_over_inproc"] = res["async_output_tokens_per_s"] / res["inproc_output_tokens_per_s"]
    print(f"In-process engine : {res['inproc_output_tokens_per_s']:.1f} output tokens/s (median of {args.repeats})")
    print(f"AsyncLLM (2 procs): {res['async_output_tokens_per_s']:.1f} output tokens/s (median of {args.repeats})")
    print(f"Ratio async / in-process: {res['ratio_async_over_inproc']:.3f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    add_cli_args(p)
    main(p.parse_args())
