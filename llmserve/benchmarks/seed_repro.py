"""Seeded reproducibility under scheduling (issue 18): the same seeded requests run
alone, all at once, under forced preemption (a tiny KV cache), with a warm prefix cache
and with a small token budget per step must give identical text for every choice.

    python -m llmserve.benchmarks.seed_repro --num-prompts 32 --n 3 --output-len 200 \\
        --dtype float32           # and --dtype bfloat16
    llmserve bench seed-repro ...

Prints one JSON line: per scenario, how many choices differ from "alone" (0 expected)
and the seconds it took.
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Optional

_TOPICS = ["the history of the bicycle", "how tides work", "a recipe for bread", "the life of bees",
           "why the sky is blue", "the rules of chess", "a trip to the mountains", "how rain forms"]


def seeded_prompts(num_prompts: int) -> list[str]:
    """``num_prompts`` distinct prompts sharing a prefix (so the prefix cache is used)."""
    return [f"Write a short essay about {_TOPICS[i % len(_TOPICS)]} (part {i // len(_TOPICS) + 1})."
            for i in range(num_prompts)]


def _engine_kwargs(args: argparse.Namespace, **over) -> dict:
    kw = dict(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
              max_model_len=args.max_model_len, seed=0)
    kw.update(over)
    return kw


def _texts(llm, prompts, sp, one_at_a_time: bool) -> list[list[str]]:
    if one_at_a_time:
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    return [[c.text for c in o.outputs] for o in outs]


def run_scenarios(args: argparse.Namespace) -> dict:
    """Run every scenario; returns {"dtype", "choices", scenario: {"mismatches", "seconds"}}."""
    from llmserve import LLM, SamplingParams

    prompts = seeded_prompts(args.num_prompts)
    sps = [SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, seed=1000 + i,
                          max_tokens=args.output_len, ignore_eos=True) for i in range(len(prompts))]
    result: dict = {"dtype": args.dtype, "choices": len(prompts) * args.n}
    ref = None

    def record(name, fn):
        nonlocal ref
        t = time.perf_counter()
        texts = fn()
        if ref is None:
            ref = texts
        bad = sum(a != b for ra, rb in zip(ref, texts) for a, b in zip(ra, rb))
        result[name] = {"mismatches": bad, "seconds": round(time.perf_counter() - t, 2)}

    llm = LLM(**_engine_kwargs(args))
    record("alone", lambda: [_texts(llm, [p], sp, True)[0] for p, sp in zip(prompts, sps)])
    llm.reset_prefix_cache()
    record("all_at_once", lambda: _texts(llm, prompts, sps, False))
    record("warm_prefix_cache", lambda: _texts(llm, prompts, sps, False))  # same prompts again
    del llm
    gc.collect()
    small = LLM(**_engine_kwargs(args, num_gpu_blocks_override=args.preempt_blocks, block_size=16,
                                 max_num_seqs=16, enable_prefix_caching=False,
                                 max_model_len=min(args.max_model_len, 16 * (args.preempt_blocks - 1))))
    record("forced_preemption", lambda: _texts(small, prompts, sps, False))
    del small
    gc.collect()
    chunked = LLM(**_engine_kwargs(args, max_num_batched_tokens=args.max_num_batched_tokens,
                                   enable_prefix_caching=False))
    record(f"max_num_batched_tokens_{args.max_num_batched_tokens}", lambda: _texts(chunked, prompts, sps, False))
    del chunked
    gc.collect()
    return result


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("seeded reproducibility")
    g.add_argument("--model", default="SmolLM2-135M-Instruct")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--n", type=int, default=3)
    g.add_argument("--output-len", type=int, default=200)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=0.9)
    g.add_argument("--kv-cache-memory", default="512MiB")
    g.add_argument("--max-model-len", type=int, default=512)
    g.add_argument("--preempt-blocks", type=int, default=48,
                   help="KV blocks of the forced-preemption run (issue 18: 48 x 16 tokens).")
    g.add_argument("--max-num-batched-tokens", type=int, default=32)


def main(args: argparse.Namespace) -> dict:
    result = run_scenarios(args)
    print(json.dumps(result))
    return result


def _cli(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    _cli()
