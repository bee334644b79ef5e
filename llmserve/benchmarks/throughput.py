"""``llmserve bench throughput``: offline throughput on random prompts (vLLM's
``vllm bench throughput`` / ``benchmarks/benchmark_throughput.py``, random dataset).

``--num-prompts`` requests are drawn from a fixed seed: random token ids (no special
tokens) with lengths around ``--input-len`` / ``--output-len`` (``--random-range-ratio``
spreads them uniformly over ``[len * (1 - r), len * (1 + r)]``). Each request generates
exactly its own output length (``ignore_eos``). The whole list goes to ``LLM.generate``
at once (``--backend llmserve``) or through transformers' ``generate`` in static batches
(``--backend hf``, see ``hf_backend.py``); ``--compare-hf`` runs both on the same prompts.

Reported: requests/s, output tokens/s and total tokens/s (prompt + output tokens over the
elapsed time of the generation only), and the same-run GEMM ceiling (``ceiling.py``) at
``--ceiling-tokens-per-step`` tokens per step (default: 256, or the engine's
``max_num_batched_tokens`` if smaller, and 1), with the ratio achieved total tokens/s /
ceiling. The ceiling is the fastest of ``--ceiling-iters`` timed passes; its median is
printed beside it to show the noise.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Optional, Sequence

from llmserve.benchmarks.ceiling import format_ceiling, measure_gemm_ceiling
from llmserve.benchmarks.datasets import sample_random_requests
from llmserve.benchmarks.results import TokenRates
from llmserve.engine_args import EngineArgs, UsageContext, default_batching

__all__ = ["add_cli_args", "main", "run_llmserve", "ThroughputResult"]


@dataclasses.dataclass
class ThroughputResult(TokenRates):
    """One backend's run: elapsed_s (wall time of the generation, s), num_requests,
    prompt_tokens and output_tokens (sums over requests; output = requested tokens)."""

    backend: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(self.rates())
        return d

    def line(self) -> str:
        return (f"[{self.backend}] Throughput: {self.requests_per_s:.2f} requests/s, "
                f"{self.total_tokens_per_s:.1f} total tokens/s, {self.output_tokens_per_s:.1f} output "
                f"tokens/s ({self.num_requests} requests, {self.prompt_tokens} prompt + "
                f"{self.output_tokens} output tokens in {self.elapsed_s:.2f} s)")


# --------------------------------------------------------------------------- backends
def run_llmserve(llm: Any, requests: Sequence[tuple[Sequence[int], int]], temperature: float = 1.0,
                 warmup_prompt: Optional[Sequence[int]] = None) -> ThroughputResult:
    """Time one ``llm.generate`` over all ``requests`` (token-id prompts, ignore_eos,
    ``max_tokens`` = each request's output length, top_p 1). ``warmup_prompt``, if given,
    is generated first (4 tokens, untimed) so one-off start-up costs are not measured.

    Raises RuntimeError when an output's token count differs from what was requested.
    """
    from llmserve import SamplingParams

    if warmup_prompt is not None:
        llm.generate([{"prompt_token_ids": list(warmup_prompt)}],
                     SamplingParams(max_tokens=4, ignore_eos=True, temperature=temperature),
                     use_tqdm=False)
    prompts = [{"prompt_token_ids": list(ids)} for ids, _ in requests]
    params = [SamplingParams(n=1, temperature=temperature, top_p=1.0, ignore_eos=True, max_tokens=n)
              for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for i, (out, (_, n)) in enumerate(zip(outputs, requests)):
        got = len(out.outputs[0].token_ids)
        if got != n:
            raise RuntimeError(f"request {i}: asked for {n} tokens with ignore_eos, got {got}")
    return ThroughputResult("llmserve", elapsed, len(requests),
                            sum(len(ids) for ids, _ in requests), sum(n for _, n in requests))


# --------------------------------------------------------------------------- CLI
def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineArgs flag (--model, --dtype, --seed, --max-num-seqs,
    --max-num-batched-tokens, --kv-cache-memory, --enable-prefix-caching/--no-...,
    --num-threads, ...) plus the benchmark's own flags."""
    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("throughput benchmark")
    g.add_argument("--backend", choices=["llmserve", "hf"], default="llmserve",
                   help="Engine to measure (hf: transformers generate, static batches).")
    g.add_argument("--num-prompts", type=int, default=256, help="Number of requests (default 256).")
    g.add_argument("--input-len", type=int, default=128, help="Prompt length in tokens (default 128).")
    g.add_argument("--output-len", type=int, default=128, help="Output length in tokens (default 128).")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths uniform in [len*(1-r), len*(1+r)] (default 0: fixed).")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="Sampling temperature for both backends (0: greedy; default 1.0).")
    g.add_argument("--hf-batch-size", type=int, default=64, help="Static batch size of --backend hf.")
    g.add_argument("--compare-hf", action="store_true",
                   help="Also run transformers on the same prompts and print the ratio.")
    g.add_argument("--ceiling-tokens-per-step", type=int, nargs="*", default=None,
                   help="Tokens per step for the GEMM ceiling (default: 256, or the step budget if smaller, and 1; "
                        "none to skip).")
    g.add_argument("--ceiling-iters", type=int, default=5, help="Timed passes per ceiling (the fastest counts).")
    g.add_argument("--no-warmup", action="store_true", help="Skip the untimed warm-up request.")
    g.add_argument("--output-json", default=None, help="Write the result dict to this JSON file.")


def _validate(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len", "hf_batch_size", "ceiling_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}: must be at least 1, got {getattr(args, name)}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError(f"random_range_ratio: must be in [0, 1), got {args.random_range_ratio}")
    if args.temperature < 0:
        raise ValueError(f"temperature: must be non-negative, got {args.temperature}")
    for t in args.ceiling_tokens_per_step or []:
        if t < 1:
            raise ValueError(f"ceiling_tokens_per_step: must be at least 1, got {t}")


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark described by ``args`` (see ``add_cli_args``), print the figures
    and return them as a dict (also written to ``--output-json``).

    Raises ValueError for invalid flags.
    """
    _validate(args)
    load_start = _warn_if_busy()
    engine_args = EngineArgs.from_cli_args(args)
    run_llm = args.backend == "llmserve" or args.compare_hf
    run_hf_backend = args.backend == "hf" or args.compare_hf
    llm = None
    if run_llm:
        from llmserve import LLM

        llm = LLM(**dataclasses.asdict(engine_args))
        tokenizer = llm.get_tokenizer()
        model_config = llm.llm_engine.model_config
        hf_config, dtype = model_config.hf_config, model_config.dtype
        mnbt = _engine_mnbt(llm, engine_args)
    else:
        from llmserve.benchmarks.hf_backend import load_hf_config
        from llmserve.config import resolve_dtype
        from llmserve.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(args.tokenizer or args.model)  # the engine's: same prompts
        hf_config = load_hf_config(args.model)
        dtype = resolve_dtype(args.dtype, "cpu")
        mnbt = args.max_num_batched_tokens or default_batching("cpu", UsageContext.LLM_CLASS)[0]

    requests = sample_random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len,
                                      args.random_range_ratio, args.seed)
    warmup = None if args.no_warmup else sample_random_requests(
        tokenizer, 1, args.input_len, 4, 0.0, args.seed + 1)[0][0]
    result: dict[str, Any] = {
        "model": args.model, "dtype": dtype, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len,
        "random_range_ratio": args.random_range_ratio, "seed": args.seed,
        "temperature": args.temperature, "max_num_batched_tokens": mnbt,
        "max_num_seqs": args.max_num_seqs, "hf_batch_size": args.hf_batch_size,
        "num_cpus": os.cpu_count(), "loadavg_at_start": load_start,
    }
    runs: list[Any] = []
    if llm is not None:
        r = run_llmserve(llm, requests, args.temperature, warmup)
        print(r.line())
        result["llmserve"] = r.to_dict()
        runs.append(r)
        _shutdown(llm)
        del llm
    if run_hf_backend:
        from llmserve.benchmarks.hf_backend import load_hf_model, run_hf

        hf_model = load_hf_model(args.model, dtype)
        if warmup is not None:
            run_hf(hf_model, [(warmup, 4)], batch_size=1, temperature=args.temperature)
        h = run_hf(hf_model, requests, batch_size=args.hf_batch_size,
                   temperature=args.temperature, seed=args.seed)
        del hf_model
        hr = ThroughputResult("hf", h.elapsed_s, h.num_requests, h.prompt_tokens, h.output_tokens)
        print(hr.line() + f" [generated {h.generated_tokens} tokens incl. static-batch padding]")
        result["hf"] = dict(hr.to_dict(), generated_tokens=h.generated_tokens)
        runs.append(hr)
    if args.compare_hf:
        ratio = result["llmserve"]["output_tokens_per_s"] / result["hf"]["output_tokens_per_s"]
        result["llmserve_vs_hf_output_tokens_ratio"] = ratio
        print(f"llmserve / transformers output tokens/s: {ratio:.2f}x")

    tps_list = args.ceiling_tokens_per_step
    if tps_list is None:
        # GEMM efficiency saturates by ~256 tokens per step (see ceiling.py); timing a
        # 4096-token pass seven times would add ~30 s for the same figure.
        tps_list = [min(mnbt, 256), 1]
    result["ceiling"] = []
    for tps in tps_list:
        c = measure_gemm_ceiling(hf_config, tps, dtype, num_threads=args.num_threads,
                                 iters=args.ceiling_iters)
        entry = c.to_dict()
        ratios = {run.backend: run.total_tokens_per_s / c.tokens_per_s for run in runs}
        entry["achieved_total_tokens_ratio"] = ratios
        result["ceiling"].append(entry)
        print(format_ceiling(c) + "; achieved total tokens/s / ceiling: "
              + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    result["loadavg_at_end"] = list(os.getloadavg())
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _warn_if_busy() -> list[float]:
    """The 1/5/15-minute load averages before the run; prints a warning when other
    processes already keep the CPUs busy (the figures then measure a shared machine)."""
    load = list(os.getloadavg())
    cpus = os.cpu_count() or 1
    if load[0] > 0.5 * cpus:
        print(f"WARNING: load average {load[0]:.1f} on {cpus} CPUs before the run: other processes "
              f"share the CPUs, so timings and ratios are unreliable", file=sys.stderr)
    return load


def _shutdown(llm: Any) -> None:
    """Stop the engine (and its process) so it does not share the CPU with what follows."""
    shutdown = getattr(llm, "shutdown", None)
    if callable(shutdown):
        shutdown()


def _engine_mnbt(llm: Any, engine_args: EngineArgs) -> int:
    """The engine's per-step token budget, wherever the engine keeps its config."""
    eng = llm.llm_engine
    for attr in ("engine_config", "vllm_config", "config"):
        cfg = getattr(eng, attr, None)
        sched = getattr(cfg, "scheduler_config", None)
        if sched is not None:
            return int(sched.max_num_batched_tokens)
    sched = getattr(eng, "scheduler_config", None)
    if sched is not None:
        return int(sched.max_num_batched_tokens)
    return int(engine_args.max_num_batched_tokens or default_batching("cpu", UsageContext.LLM_CLASS)[0])


def _cli(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="llmserve bench throughput", description=__doc__.split("\n")[0])
    add_cli_args(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    _cli(sys.argv[1:])
