"""Time one decode forward (model + logits) of a model over a paged KV cache.

    python -m llmserve.benchmarks.bench_decode [--model SmolLM2-135M-Instruct]
        [--dtype bfloat16] [--num-seqs 1 64] [--context 256] [--threads N]

Prints, per batch size, wall-clock min/median and process CPU time per step with the C++
decode kernel and with the pure-torch path. Timing only: never asserted in tests.
"""
from __future__ import annotations

import argparse
import time

import torch


def bench_decode(model, num_seqs: int, context: int, block_size: int = 16, iters: int = 8,
                 use_kernel: bool = True) -> dict:
    """Run ``iters`` decode steps of ``num_seqs`` requests at ``context`` tokens each (random
    K/V); returns ``{"wall_min_ms", "wall_median_ms", "cpu_min_ms"}``."""
    from llmserve.attention import build_attn_metadata, get_kv_cache_shape

    cfg = model.config
    nkv = cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    per_seq = (context + block_size - 1) // block_size
    kv = [torch.randn(get_kv_cache_shape(num_seqs * per_seq + 1, block_size, nkv, hd), dtype=dtype)
          for _ in range(cfg.num_hidden_layers)]
    blocks = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(num_seqs)]
    for layer in model.model.layers:
        layer.self_attn.attn.use_kernel = use_kernel
    ids = torch.randint(0, cfg.vocab_size, (num_seqs,))
    pos = torch.full((num_seqs,), context - 1)
    walls, cpus = [], []
    with torch.inference_mode():
        for i in range(iters + 2):
            md = build_attn_metadata([1] * num_seqs, [context] * num_seqs, blocks, block_size)
            w, c = time.perf_counter(), time.process_time()
            model.compute_logits(model(ids, pos, kv, md))
            if i >= 2:  # warm-up steps excluded
                walls.append(time.perf_counter() - w)
                cpus.append(time.process_time() - c)
    for layer in model.model.layers:
        layer.self_attn.attn.use_kernel = True
    walls.sort()
    return {"wall_min_ms": 1e3 * walls[0], "wall_median_ms": 1e3 * walls[len(walls) // 2],
            "cpu_min_ms": 1e3 * min(cpus)}


def main() -> None:
    from llmserve.config import ModelConfig
    from llmserve.model_loader import get_model, load_hf_config, resolve_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num-seqs", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    resolved = resolve_model(args.model)
    hf_config = load_hf_config(resolved)
    mc = ModelConfig(model=args.model, tokenizer=args.model, served_model_name=(args.model,),
                     dtype=args.dtype, max_model_len=args.context, seed=0, hf_config=hf_config,
                     model_path=resolved.path, gguf_file=resolved.gguf_file)
    model = get_model(mc)
    for n in args.num_seqs:
        for use_kernel in (True, False):
            r = bench_decode(model, n, args.context, use_kernel=use_kernel)
            print(f"{args.dtype} decode {n} seqs x {args.context} ctx, "
                  f"{'kernel' if use_kernel else 'torch '}: wall min {r['wall_min_ms']:.1f} ms, "
                  f"median {r['wall_median_ms']:.1f} ms, cpu {r['cpu_min_ms']:.1f} ms "
                  f"({torch.get_num_threads()} threads)", flush=True)


if __name__ == "__main__":
    main()
