"""Decode steps with and without the packed GGUF weights, in ONE process on two loaded
copies of the model (the second with the packed weights left out: dense bfloat16 oneDNN
GEMMs), alternating rounds, medians, so machine load affects both alike (issue 16).

    PYTHONPATH=. python benchmarks/packed_decode_ab.py [--rounds 3] [--tokens 64] [--batch 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def _load(packed: bool):
    from llmserve import LLM
    from llmserve.models import packed as packed_mod
    orig = packed_mod.attach_packed_weights
    if not packed:
        packed_mod.attach_packed_weights = lambda *a, **k: 0
    try:
        return LLM("SmolLM2-135M-Instruct", multiprocess_mode=False, kv_cache_memory="256MiB", max_model_len=1024)
    finally:
        packed_mod.attach_packed_weights = orig


def _step_ms(llm, prompts, tokens: int) -> float:
    """Milliseconds per decode step: a ``tokens``-token generation minus a 1-token one."""
    from llmserve import SamplingParams
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / (tokens - 1) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args()
    from llmserve.models.llama import Linear

    llms = {"packed": _load(True), "dense": _load(False)}
    model = llms["packed"].llm_engine.engine_core.engine_core.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.qweight is not None]
    print(f"packed layers: {len(layers)}, every step: {all(m.packed_only for m in layers)}, "
          f"switch point: {layers[0].packed_max_rows if layers else 0}")
    prompts = [{"prompt_token_ids": list(range(1000 + i, 1032 + i))} for i in range(args.batch)]
    res = {"packed": [], "dense": []}
    for r in range(args.rounds + 1):
        for name in (("packed", "dense") if r % 2 == 0 else ("dense", "packed")):
            ms = _step_ms(llms[name], prompts, args.tokens)
            if r > 0:  # round 0 warms up
                res[name].append(ms)
                print(f"round {r} {name}: {ms:.2f} ms/step (load {os.getloadavg()[0]:.1f})", flush=True)
    a, b = statistics.median(res["packed"]), statistics.median(res["dense"])
    print(f"median decode step, batch {args.batch}: packed {a:.2f} ms, dense bf16 {b:.2f} ms, "
          f"dense/packed {b / a:.2f}x (load {os.getloadavg()})")


if __name__ == "__main__":
    main()
