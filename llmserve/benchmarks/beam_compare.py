"""Beam search vs n-way sampling in one engine, same prompts, same run (issue 29).

Offline, one in-process engine: ``--num-prompts`` random prompts of ``--input-len`` tokens,
``--output-len`` new tokens each (ignore_eos), as (a) ``SamplingParams(n=W,
temperature=1)`` (the W samples share the prompt through the prefix cache) and (b)
``BeamSearchParams(beam_width=W)`` in the engine; rounds alternate. Reported per side:
output tokens/s counting every returned sequence's tokens (W per prompt on both sides),
and the KV blocks in use at the peak (sampled after every engine step). Medians over
``--rounds``, with the load average (the machine may be shared).

Run: ``python -m llmserve.benchmarks.beam_compare [--model SmolLM2-135M-Instruct]
[--num-prompts 32] [--input-len 128] [--output-len 128] [--beam-width 4] [--rounds 2]``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time


def _run(llm, prompts: list[list[int]], sp, beam) -> tuple[int, float, int]:
    """(output tokens, seconds, peak KV blocks) of one pass over the prompts."""
    eng = llm.llm_engine
    sched = eng.engine_core.engine_core.scheduler
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, sp, beam_search_params=beam)
    tokens = peak = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                tokens += sum(len(c.token_ids) for c in out.outputs)
        peak = max(peak, sched.kv_cache_manager.num_used_blocks)
    return tokens, time.perf_counter() - t0, peak


def main(argv=None) -> dict:
    """Parse ``argv``, run the comparison, print and return the result dict."""
    from llmserve import LLM, SamplingParams
    from llmserve.beam_search import BeamSearchParams
    from llmserve.sampling_params import RequestOutputKind

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    w = args.beam_width
    llm = LLM(args.model, dtype=args.dtype, multiprocess_mode=False, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=max(256, args.num_prompts * w), enable_prefix_caching=True)
    rng = random.Random(args.seed)
    vocab = llm.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    sample = SamplingParams(n=w, temperature=1.0, max_tokens=args.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    beam = BeamSearchParams(beam_width=w, max_tokens=args.output_len, ignore_eos=True)
    _run(llm, prompts[:2], sample, None)  # warm-up
    _run(llm, prompts[:2], greedy, beam)
    res = {"sample": [], "beam": []}
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        for name, sp, bp in (("sample", sample, None), ("beam", greedy, beam)):
            llm.reset_prefix_cache()
            tokens, dt, peak = _run(llm, prompts, sp, bp)
            res[name].append((tokens / dt, peak, tokens))
            print(f"round {r} {name}: {tokens} tokens in {dt:.1f} s = {tokens / dt:.1f} tok/s, "
                  f"peak KV blocks {peak}, load avg {load:.1f}", flush=True)
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v), v[0][2])
           for k, v in res.items()}
    out = {"model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
           "output_len": args.output_len, "width": w, "rounds": args.rounds,
           "sample_n_tok_s": round(med["sample"][0], 1), "beam_tok_s": round(med["beam"][0], 1),
           "tok_s_ratio_beam_over_sample": round(med["beam"][0] / med["sample"][0], 3),
           "sample_peak_blocks": med["sample"][1], "beam_peak_blocks": med["beam"][1],
           "peak_blocks_ratio_beam_over_sample": round(med["beam"][1] / med["sample"][1], 3),
           "tokens": {k: v[2] for k, v in med.items()}, "load_avg_1m_end": round(os.getloadavg()[0], 1)}
    print(json.dumps(out))
    llm.shutdown()
    return out


if __name__ == "__main__":
    main()
