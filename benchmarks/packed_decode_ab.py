"""Batch-1 decode with and without the packed GGUF weights, in ONE process on one loaded
model (alternating rounds, medians), so machine load affects both alike (issue 16).

    PYTHONPATH=. python benchmarks/packed_decode_ab.py [--rounds 3] [--tokens 64] [--batch 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args()
    from llmserve import LLM, SamplingParams
    from llmserve.models.llama import Linear

    llm = LLM("SmolLM2-135M-Instruct", multiprocess_mode=False, kv_cache_memory="256MiB", max_model_len=1024)
    model = llm.llm_engine.engine_core.engine_core.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.qweight is not None]
    probed = layers[0].packed_max_rows if layers else 0
    print(f"packed layers: {len(layers)}, probed switch point: steps of <= {probed} tokens")

    def set_rows(rows: int) -> None:
        for m in layers:
            m.packed_max_rows = rows
        if model.packed_head is not None:
            model.packed_head = (model.packed_head[0], rows)

    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(1000 + i, 1032 + i))} for i in range(args.batch)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    res = {"packed": [], "dense": []}
    for r in range(args.rounds + 1):
        for name, rows in ((("packed", probed), ("dense", 0)) if r % 2 == 0 else (("dense", 0), ("packed", probed))):
            set_rows(rows)
            t0 = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            t1 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            t2 = time.perf_counter()
            ms = ((t2 - t1) - (t1 - t0)) / (args.tokens - 1) * 1e3  # per decode step, prefill removed
            if r > 0:  # round 0 warms up
                res[name].append(ms)
                print(f"round {r} {name}: {ms:.2f} ms/step (load {os.getloadavg()[0]:.1f})", flush=True)
    a, b = statistics.median(res["packed"]), statistics.median(res["dense"])
    print(f"median decode step, batch {args.batch}: packed {a:.2f} ms, dense bf16 {b:.2f} ms, "
          f"dense/packed {b / a:.2f}x (load {os.getloadavg()})")


if __name__ == "__main__":
    main()
