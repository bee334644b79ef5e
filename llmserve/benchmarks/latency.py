"""``llmserve bench latency``: end-to-end latency of one batch (vLLM's ``vllm bench latency``
/ ``benchmarks/benchmark_latency.py``).

One batch of ``--batch-size`` random prompts of ``--input-len`` tokens is generated to
``--output-len`` tokens (``ignore_eos``) with ``LLM.generate``, ``--num-iters-warmup``
times untimed and ``--num-iters`` times timed; each iteration uses fresh random prompts
so the prefix cache never turns the prefill into a lookup. The same is timed with one
output token, which isolates the prefill, and

    decode time per token = (median latency(output_len) - median latency(1)) / (output_len - 1)

is the time of one decode step of the batch. It is compared with the GEMM ceiling
(``ceiling.py``) at ``batch_size`` tokens per step: the time the model's linear layers
alone take for one step of that many tokens, on the same dtype and threads.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np

from llmserve.benchmarks.ceiling import format_ceiling, measure_gemm_ceiling
from llmserve.benchmarks.datasets import sample_random_requests
from llmserve.benchmarks.throughput import _warn_if_busy
from llmserve.engine_args import EngineArgs

__all__ = ["add_cli_args", "main", "latency_stats", "decode_time_per_token"]


def latency_stats(latencies_s: Sequence[float]) -> dict[str, float]:
    """mean, median, p99 (linear interpolation, as numpy.percentile) and min/max of a
    list of latencies in seconds. Raises ValueError on an empty list."""
    if len(latencies_s) == 0:
        raise ValueError("latencies_s: empty")
    a = np.asarray(latencies_s, dtype=np.float64)
    return {"mean_s": float(a.mean()), "median_s": float(np.median(a)),
            "p99_s": float(np.percentile(a, 99)), "min_s": float(a.min()), "max_s": float(a.max())}


def decode_time_per_token(latency_full_s: float, latency_one_s: float, output_len: int) -> float:
    """Per-decode-step time in seconds: (latency(output_len) - latency(1)) / (output_len - 1).

    Raises ValueError when output_len < 2 (there is no decode step to time).
    """
    if output_len < 2:
        raise ValueError(f"output_len: must be at least 2 to time decode steps, got {output_len}")
    return (latency_full_s - latency_one_s) / (output_len - 1)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineArgs flag plus --batch-size, --input-len, --output-len,
    --num-iters-warmup, --num-iters, --temperature, --ceiling-iters, --output-json."""
    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("latency benchmark")
    g.add_argument("--batch-size", type=int, default=1, help="Requests in the batch (default 1).")
    g.add_argument("--input-len", type=int, default=32, help="Prompt length in tokens (default 32).")
    g.add_argument("--output-len", type=int, default=128, help="Output length in tokens (default 128).")
    g.add_argument("--num-iters-warmup", type=int, default=2, help="Untimed iterations (default 2).")
    g.add_argument("--num-iters", type=int, default=5, help="Timed iterations (default 5).")
    g.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature (0: greedy).")
    g.add_argument("--ceiling-iters", type=int, default=10, help="Timed passes of the ceiling (the fastest counts).")
    g.add_argument("--output-json", default=None, help="Write the result dict to this JSON file.")


def _validate(args: argparse.Namespace) -> None:
    for name in ("batch_size", "input_len", "num_iters", "ceiling_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}: must be at least 1, got {getattr(args, name)}")
    if args.output_len < 2:
        raise ValueError(f"output_len: must be at least 2, got {args.output_len}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"num_iters_warmup: must be non-negative, got {args.num_iters_warmup}")
    if args.temperature < 0:
        raise ValueError(f"temperature: must be non-negative, got {args.temperature}")


def main(args: argparse.Namespace) -> dict:
    """Run the latency benchmark described by ``args``, print it and return the figures
    (latencies in seconds). Raises ValueError for invalid flags."""
    _validate(args)
    load_start = _warn_if_busy()
    from llmserve import LLM, SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**dataclasses.asdict(engine_args))
    model_config = llm.llm_engine.model_config
    n_batches = args.num_iters_warmup + 2 * args.num_iters
    pool = sample_random_requests(llm.get_tokenizer(), n_batches * args.batch_size, args.input_len,
                           1, 0.0, args.seed)
    batches = [[{"prompt_token_ids": ids} for ids, _ in pool[i * args.batch_size:(i + 1) * args.batch_size]]
               for i in range(n_batches)]

    def run(prompts: list[dict], max_tokens: int) -> float:
        sp = SamplingParams(temperature=args.temperature, top_p=1.0, ignore_eos=True, max_tokens=max_tokens)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        for o in outs:
            if len(o.outputs[0].token_ids) != max_tokens:
                raise RuntimeError(f"asked for {max_tokens} tokens with ignore_eos, got "
                                   f"{len(o.outputs[0].token_ids)}")
        return elapsed

    it = iter(batches)
    for _ in range(args.num_iters_warmup):
        run(next(it), args.output_len)
    full, one = [], []
    for _ in range(args.num_iters):  # interleaved, so drift affects both alike
        full.append(run(next(it), args.output_len))
        one.append(run(next(it), 1))
    full_stats, one_stats = latency_stats(full), latency_stats(one)
    decode_s = decode_time_per_token(full_stats["median_s"], one_stats["median_s"], args.output_len)
    shutdown = getattr(llm, "shutdown", None)
    if callable(shutdown):  # the ceiling must not share the CPU with an engine process
        shutdown()
    ceiling = measure_gemm_ceiling(model_config.hf_config, args.batch_size, model_config.dtype,
                                   num_threads=args.num_threads, iters=args.ceiling_iters)
    ratio = decode_s / ceiling.seconds_per_step
    result = {
        "model": args.model, "dtype": model_config.dtype, "batch_size": args.batch_size,
        "input_len": args.input_len, "output_len": args.output_len, "num_iters": args.num_iters,
        "latency": full_stats, "latency_1_token": one_stats, "latencies_s": full,
        "decode_time_per_token_s": decode_s,
        "decode_tokens_per_s": args.batch_size / decode_s if decode_s > 0 else float("inf"),
        "ceiling": ceiling.to_dict(), "decode_vs_ceiling_time_ratio": ratio,
        "loadavg_at_start": load_start,
    }
    print(f"Latency ({args.batch_size} x {args.input_len} in / {args.output_len} out, "
          f"{args.num_iters} iters): mean {full_stats['mean_s']:.3f} s, median "
          f"{full_stats['median_s']:.3f} s, p99 {full_stats['p99_s']:.3f} s")
    print(f"Latency with 1 output token (prefill): median {one_stats['median_s'] * 1e3:.1f} ms")
    print(f"Decode time per token: {decode_s * 1e3:.2f} ms/step "
          f"({result['decode_tokens_per_s']:.1f} tokens/s)")
    print(format_ceiling(ceiling))
    print(f"Decode step / ceiling step time: {ratio:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _cli(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="llmserve bench latency", description=__doc__.split("\n")[0])
    add_cli_args(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    _cli(sys.argv[1:])
