"""Issue 12 "Must show" (cost): run from the repository root, quietly.

``PYTHONPATH=$PWD python benchmarks/structured_outputs_cost.py compile``
    Grammar compile time of the 50 test schemas (tests/structured_output/schemas.py) with the
    engine's backend (SmolLM2 tokenizer, xgrammar, one thread): each cold, then a cache hit.
``PYTHONPATH=$PWD python benchmarks/structured_outputs_cost.py offline [--rounds 5]``
    The engine alone (offline LLM, in-process): 32 requests x 64 tokens (ignore_eos),
    unconstrained vs the bench's builtin JSON schema, alternating rounds; median ratio of
    output tok/s. The online figure is ``llmserve bench serve ... --structured-output-compare
    --structured-output-rounds 3``.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join("tests", "structured_output"))


def compile_times() -> None:
    from schemas import SCHEMAS

    from llmserve.sampling_params import StructuredOutputsParams
    from llmserve.structured_output.backend_xgrammar import XgrammarBackend
    from llmserve.structured_output.grammar import grammar_key
    from llmserve.tokenizer import get_tokenizer

    tok = get_tokenizer("SmolLM2-135M-Instruct")
    t0 = time.perf_counter()
    backend = XgrammarBackend(tok, 49152, [tok.eos_token_id])
    print(f"backend setup (TokenizerInfo): {time.perf_counter() - t0:.3f} s")
    keys = [grammar_key(StructuredOutputsParams(json=s), False) for s in SCHEMAS]
    cold, hit = [], []
    for k in keys:
        t = time.perf_counter()
        backend.compile(k)
        cold.append(time.perf_counter() - t)
    for k in keys:
        t = time.perf_counter()
        backend.compile(k)
        hit.append(time.perf_counter() - t)
    ms = lambda xs: f"total {sum(xs) * 1e3:.1f} ms, median {statistics.median(xs) * 1e3:.2f} ms, max {max(xs) * 1e3:.1f} ms"
    print(f"{len(keys)} schemas, cold compile: {ms(cold)}")
    print(f"{len(keys)} schemas, cache hit:    {ms(hit)}")


def offline(rounds: int) -> None:
    from llmserve import LLM, SamplingParams
    from llmserve.benchmarks.serve import BUILTIN_SCHEMA
    from llmserve.sampling_params import StructuredOutputsParams

    llm = LLM("SmolLM2-135M-Instruct", kv_cache_memory="1GiB")
    prompts = [f"Item {i}: list the rows of table {i} as JSON." for i in range(32)]
    plain = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    so = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True,
                        structured_outputs=StructuredOutputsParams(json=BUILTIN_SCHEMA))
    llm.generate(prompts[:2], so, use_tqdm=False)  # warm up: grammar backend, compile, caches

    def tps(params) -> float:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    ratios = []
    for r in range(rounds):
        if r % 2 == 0:  # ABBA order: a drifting load favours neither side
            a, b = tps(plain), tps(so)
        else:
            b, a = tps(so), tps(plain)
        ratios.append(b / a)
        print(f"round {r + 1}: unconstrained {a:.1f} tok/s, JSON schema {b:.1f} tok/s, ratio {b / a:.3f}  "
              f"(load {os.getloadavg()[0]:.2f})")
    print(f"median ratio over {rounds} alternating rounds: {statistics.median(ratios):.3f}")
    llm.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["compile", "offline"])
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    compile_times() if a.what == "compile" else offline(a.rounds)
