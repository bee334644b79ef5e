"""LoRA throughput and latency, same run, side by side with the base model (issue 28):

    python -m llmserve.benchmarks.lora [--model M] [--num-adapters 8] [--rank 16]
        [--targets q_proj,v_proj] [--max-lora-rank 64]
        [--concurrency 16] [--input-len 32] [--output-len 64] [--repeats 3]

Random rank-``r`` adapters on ``--targets`` (default: all seven projections; PEFT's
default for Llama is q_proj,v_proj) are written as PEFT directories and loaded
(``add_lora``) into slots sized for ``--max-lora-rank`` (default: ``--rank``). Then,
``--repeats`` times, alternating so both see the same machine load: ``--concurrency`` prompts of fresh random tokens (no prefix-cache hits)
generated to ``--output-len`` tokens (``ignore_eos``) on the base model and spread
round-robin over the adapters (output tok/s each), and one prompt at c=1 (TPOT =
(latency(output_len + 1) - latency(1)) / output_len, base and one adapter). Prints the
medians and the ratios as JSON."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any, Optional, Sequence

import torch


def write_random_adapter(hf_config: Any, path: str, rank: int, seed: int, alpha: Optional[int] = None,
                         targets: Optional[Sequence[str]] = None) -> str:
    """A random PEFT LoRA directory for a model of ``hf_config`` on ``targets`` (HF
    projection names, e.g. ``("q_proj", "v_proj")``, PEFT's default for Llama; None: all
    seven) of every layer; returns ``path``."""
    from safetensors.torch import save_file

    from llmserve.lora.layers import target_shapes

    shapes = target_shapes(hf_config)
    targets = list(shapes) if targets is None else list(targets)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for target in targets:
            out, inp = shapes[target]
            part = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp ** 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank, "bias": "none",
                   "target_modules": targets}, f)
    return path


def _prompts(n: int, length: int, rng: torch.Generator, vocab: int) -> list[dict]:
    return [{"prompt_token_ids": torch.randint(100, vocab - 1, (length,), generator=rng).tolist()} for _ in range(n)]


def _timed(llm, prompts, max_tokens: int, loras) -> float:
    from llmserve import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict:
    from llmserve import LLM
    from llmserve.lora.request import LoRARequest

    llm = LLM(args.model, enable_lora=True, max_loras=args.num_adapters,
              max_lora_rank=args.max_lora_rank or args.rank,
              kv_cache_memory="1GiB", dtype=args.dtype, multiprocess_mode=not args.in_process,
              num_threads=args.num_threads)
    cfg = llm.llm_engine.model_config.hf_config
    tmp = tempfile.mkdtemp(prefix="lora_bench_")
    targets = args.targets.split(",") if args.targets else None
    loras = [LoRARequest(f"a{i}", i, write_random_adapter(cfg, os.path.join(tmp, f"a{i}"), args.rank, seed=i,
                                                          targets=targets))
             for i in range(1, args.num_adapters + 1)]
    for lr in loras:
        llm.llm_engine.add_lora(lr)
    rng = torch.Generator().manual_seed(0)
    vocab = cfg.vocab_size
    c, n_out = args.concurrency, args.output_len
    spread = [loras[i % len(loras)] for i in range(c)]
    _timed(llm, _prompts(c, args.input_len, rng, vocab), 4, spread)  # warm-up: slots, kernels
    res: dict[str, list[float]] = {k: [] for k in ("base_tok_s", "lora_tok_s", "base_tpot_ms", "lora_tpot_ms")}
    for _ in range(args.repeats):
        for key, which in (("base_tok_s", None), ("lora_tok_s", spread)):
            res[key].append(c * n_out / _timed(llm, _prompts(c, args.input_len, rng, vocab), n_out, which))
        for key, which in (("base_tpot_ms", None), ("lora_tpot_ms", loras[0])):
            p = _prompts(1, args.input_len, rng, vocab)
            t1 = _timed(llm, p, 1, which)
            p = _prompts(1, args.input_len, rng, vocab)
            tn = _timed(llm, p, n_out + 1, which)
            res[key].append(1000 * (tn - t1) / n_out)
    llm.shutdown()
    med = {k: statistics.median(v) for k, v in res.items()}
    return {"model": args.model, "adapters": args.num_adapters, "rank": args.rank, "targets": targets or "all",
            "max_lora_rank": args.max_lora_rank or args.rank, "concurrency": c,
            "output_len": n_out, "repeats": args.repeats, "runs": res, "median": med,
            "throughput_ratio": med["lora_tok_s"] / med["base_tok_s"],
            "tpot_overhead": med["lora_tpot_ms"] / med["base_tpot_ms"] - 1}


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default=None, help="comma-separated HF projections (default: all seven)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="slot size (default: --rank)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--in-process", action="store_true", help="engine in this process (profiling)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    print(json.dumps(run(p.parse_args(argv)), indent=1))


if __name__ == "__main__":
    main()
