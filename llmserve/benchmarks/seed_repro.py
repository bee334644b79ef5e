"""Seeded reproducibility under scheduling (issue 18): the same seeded requests run
alone, all at once, under forced preemption (a tiny KV cache), with a warm prefix cache
and with a small token budget per step must give identical text for every choice.

    python -m llmserve.benchmarks.seed_repro --num-prompts 32 --n 3 --output-len 200 \\
        --dtype float32           # and --dtype bfloat16
    llmserve bench seed-repro ...

Greedy batch invariance (issue 10.6): ``--greedy`` sends temperature-0 requests instead
(no seed, one choice each) and compares their token ids:

    llmserve bench seed-repro --greedy --dtype bfloat16 --num-prompts 64 --output-len 64 \
        --max-num-batched-tokens 64 --ab-rounds 3

Prints one JSON line: per scenario, how many choices differ from "alone" (0 expected)
and the seconds it took. ``--ab-rounds K`` adds the cost of batch invariance: the same
requests all at once (and the first ``--ab-alone`` of them one at a time) on two engines,
``batch_invariant=True`` and ``False``, alternating K times; medians of output tokens/s
and their ratio.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
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
              max_model_len=args.max_model_len, seed=0, batch_invariant=args.batch_invariant)
    kw.update(over)
    return kw


def _texts(llm, prompts, sp, one_at_a_time: bool) -> list[list[tuple]]:
    """Per prompt, per choice: (text, token ids)."""
    if one_at_a_time:
        sps = sp if isinstance(sp, list) else [sp] * len(prompts)
        outs = [llm.generate([p], s, use_tqdm=False)[0] for p, s in zip(prompts, sps)]
    else:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    return [[(c.text, tuple(c.token_ids)) for c in o.outputs] for o in outs]


def _sampling_params(args: argparse.Namespace, num_prompts: int) -> list:
    from llmserve import SamplingParams

    if args.greedy:
        return [SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)] * num_prompts
    return [SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, seed=1000 + i,
                           max_tokens=args.output_len, ignore_eos=True) for i in range(num_prompts)]


def run_scenarios(args: argparse.Namespace) -> dict:
    """Run every scenario; returns {"dtype", "choices", scenario: {"mismatches", "seconds"}}."""
    from llmserve import LLM

    prompts = seeded_prompts(args.num_prompts)
    sps = _sampling_params(args, len(prompts))
    result: dict = {"mode": "greedy" if args.greedy else "seeded", "dtype": args.dtype,
                    "choices": len(prompts) * (1 if args.greedy else args.n)}
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
    if args.ab_rounds:
        result["ab"] = measure_invariance_cost(args, prompts, sps)
    return result


def measure_invariance_cost(args: argparse.Namespace, prompts, sps) -> dict:
    """Output tokens/s with ``batch_invariant`` on and off, same run, alternating
    ``args.ab_rounds`` times: all requests at once ("batched") and the first
    ``args.ab_alone`` one at a time ("alone"). Medians and on/off ratios."""
    from llmserve import LLM

    llms = {flag: LLM(**_engine_kwargs(args, batch_invariant=flag, enable_prefix_caching=False))
            for flag in (True, False)}
    choices = 1 if args.greedy else args.n
    rates: dict = {(k, f): [] for k in ("batched", "alone") for f in (True, False)}
    for r in range(args.ab_rounds):
        for flag in ((True, False) if r % 2 == 0 else (False, True)):
            for kind, ps, one in (("batched", prompts, False), ("alone", prompts[:args.ab_alone], True)):
                if not ps:
                    continue
                t = time.perf_counter()
                _texts(llms[flag], ps, sps[:len(ps)], one)
                rates[(kind, flag)].append(len(ps) * choices * args.output_len / (time.perf_counter() - t))
    out: dict = {"rounds": args.ab_rounds}
    for kind in ("batched", "alone"):
        if rates[(kind, True)]:
            on, off = statistics.median(rates[(kind, True)]), statistics.median(rates[(kind, False)])
            out[kind] = {"tok_s_invariant": round(on, 1), "tok_s_plain": round(off, 1),
                         "ratio": round(on / off, 4)}
    del llms
    gc.collect()
    return out


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
    g.add_argument("--greedy", action="store_true",
                   help="Greedy requests (temperature 0, one choice, no seed) instead of seeded ones (issue 10.6).")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                   help="The scenarios' engines' batch_invariant (--no-batch-invariant shows what it fixes).")
    g.add_argument("--ab-rounds", type=int, default=0,
                   help="Also measure batch_invariant on vs off, alternating this many rounds (0: skip).")
    g.add_argument("--ab-alone", type=int, default=8,
                   help="Requests run one at a time in each A/B round.")


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
