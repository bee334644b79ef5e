"""Sparse MoE decode speed: experts grouped by expert vs one (token, expert) pair at a time
(issue 30's MoE measurement).

One in-process engine on a tiny random Mixtral checkpoint (written with transformers'
``MixtralForCausalLM.save_pretrained`` into a temp dir, the shape of tests/models/test_moe.py
unless the size flags say otherwise; or ``--model`` a HF MoE directory). For each
concurrency (``--concurrency``, default 1 and 16): that many random prompts of
``--input-len`` tokens submitted together, ``--output-len`` greedy tokens each (ignore_eos);
output tokens/s of the whole pass. Rounds alternate ``models.moe.MOE_IMPL`` between
"grouped" (the engine's path) and "token_loop" (the baseline) in the same process;
medians over ``--rounds``, their ratio and the median of the per-round ratios, with the load average (the machine may be shared).

Run: ``python -m llmserve.benchmarks.moe [--rounds 3] [--output-len 64] [--hidden-size 64]``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time


def write_tiny_mixtral(path: str, hidden: int, intermediate: int, layers: int, experts: int, top_k: int) -> None:
    """A random ``MixtralForCausalLM`` checkpoint (config.json + safetensors) in ``path``;
    router weights scaled 20x as in the tests, so tokens spread over the experts."""
    import torch
    import transformers as tf
    cfg = tf.MixtralConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=intermediate,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=2048,
                           tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20.0)
    model.save_pretrained(path)


def _pass(llm, prompts: list[list[int]], sp) -> float:
    """Output tokens/s of generating ``sp.max_tokens`` for all ``prompts`` at once."""
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main(argv=None) -> dict:
    """Parse ``argv``, run the comparison, print and return the result dict."""
    from llmserve import LLM, SamplingParams
    from llmserve.models import moe

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a HF MoE directory (default: a tiny random Mixtral)")
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--intermediate-size", type=int, default=96)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory()
        write_tiny_mixtral(tmp.name, args.hidden_size, args.intermediate_size, args.num_layers,
                           args.num_experts, args.top_k)
    llm = LLM(args.model or tmp.name, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              kv_cache_memory="256MiB", max_num_seqs=max(args.concurrency))
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rng = random.Random(0)
    result: dict = {"load_before": os.getloadavg()}
    try:
        for c in args.concurrency:
            prompts = [[rng.randrange(3, 49152) for _ in range(args.input_len)] for _ in range(c)]
            rates: dict = {"grouped": [], "token_loop": []}
            _pass(llm, prompts, sp)  # warm-up
            for _ in range(args.rounds):
                for impl in ("grouped", "token_loop"):
                    moe.MOE_IMPL = impl
                    rates[impl].append(_pass(llm, prompts, sp))
            moe.MOE_IMPL = "grouped"
            g, t = statistics.median(rates["grouped"]), statistics.median(rates["token_loop"])
            pair = statistics.median(a / b for a, b in zip(rates["grouped"], rates["token_loop"]))
            result[f"c={c}"] = {"grouped_tok_s": round(g, 1), "token_loop_tok_s": round(t, 1),
                                "ratio_of_medians": round(g / t, 2), "median_pair_ratio": round(pair, 2),
                                "rounds": {k: [round(x, 1) for x in v] for k, v in rates.items()}}
    finally:
        llm.shutdown()
        if tmp is not None:
            tmp.cleanup()
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
