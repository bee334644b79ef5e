"""Scale-out figures (issue 14), one subcommand each, for re-running quietly:

    python -m llmserve.benchmarks.scaleout tp-equal [--backends mp,ray] [--prompts 16] [--tokens 32]
        greedy tokens with TP=2 (each backend) vs TP=1, float32, on SmolLM2-135M-Instruct
    python -m llmserve.benchmarks.scaleout dp-equal
        DP=2 returns the same text per prompt as DP=1 (through the server)
"""
from __future__ import annotations

import argparse
import json
import os
import time


def _prompts(n: int) -> list[str]:
    topics = ["the sea", "a robot", "winter", "coffee", "the moon", "rivers", "a library", "trains",
              "music", "bees", "mountains", "a city at night", "bread", "the wind", "chess", "clocks"]
    return [f"Write one sentence about {topics[i % len(topics)]} (#{i}):" for i in range(n)]


def tp_equal(args) -> dict:
    """Greedy token ids of TP=1 (uni) and TP=2 per backend; returns the comparison."""
    from llmserve import LLM, SamplingParams

    prompts = _prompts(args.prompts)
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    runs = [("uni", 1)] + [(b, 2) for b in args.backends.split(",") if b]
    tokens, secs = {}, {}
    for backend, tp in runs:
        t0 = time.perf_counter()
        llm = LLM(args.model, dtype="float32", tensor_parallel_size=tp, distributed_executor_backend=backend,
                  kv_cache_memory="256MiB", max_model_len=512)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        secs[f"{backend}_tp{tp}"] = round(time.perf_counter() - t1, 2)
        tokens[f"{backend}_tp{tp}"] = [list(o.outputs[0].token_ids) for o in outs]
        llm.shutdown()
        print(f"{backend} tp={tp}: start {t1 - t0:.1f} s, generate {secs[f'{backend}_tp{tp}']} s", flush=True)
    ref = tokens["uni_tp1"]
    result = {"prompts": len(prompts), "tokens": args.tokens, "generate_s": secs, "loadavg": os.getloadavg()}
    for k, v in tokens.items():
        if k != "uni_tp1":
            result[f"{k}_equal_prompts"] = sum(a == b for a, b in zip(ref, v))
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m llmserve.benchmarks.scaleout")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tp-equal", help="greedy tokens TP=2 == TP=1 (float32)")
    t.add_argument("--model", default="SmolLM2-135M-Instruct")
    t.add_argument("--backends", default="mp")
    t.add_argument("--prompts", type=int, default=16)
    t.add_argument("--tokens", type=int, default=32)
    args = p.parse_args(argv)
    result = {"tp-equal": tp_equal}[args.cmd](args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
