"""Perplexity of a fixed English text (``benchmarks/data/declaration.txt``, public domain)
under llmserve's packed GGUF weights, the bfloat16-dequantized weights and transformers in
float32 (issue 16, numerics of the low-bit path).

    PYTHONPATH=. python benchmarks/perplexity.py [--model SmolLM2-135M-Instruct]

llmserve's figures come from prompt logprobs, the prompt prefilled in chunks of 4 tokens
(``max_num_batched_tokens=4``, decode-sized steps). ``packed``: the file's Q4_1/Q8_0 blocks
(or a compressed-tensors checkpoint's int4/int8 weights) with int8 activations per
32-block (llama.cpp's scheme), every step, whatever the start-up probe would pick; ``bf16``: the
same chunks with ``LLMSERVE_PACKED_WEIGHTS=0`` (dense bfloat16 GEMMs); ``fp32``: llmserve in
float32 (dense, the file's exact values); ``hf-fp32``: transformers.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "declaration.txt")


def _llmserve_ppl(model: str, dtype: str, chunk: int, packed: bool = False) -> float:
    from llmserve import LLM, SamplingParams
    if packed:  # numerics of the packed path whatever the start-up probe measures here
        from llmserve.ops import quant_ops
        quant_ops.packed_switch_point = lambda *a, **k: quant_ops.ALL_STEPS
    llm = LLM(model, dtype=dtype, max_num_batched_tokens=chunk, max_num_seqs=1, kv_cache_memory="64MiB",
              max_model_len=1024, enable_prefix_caching=False, multiprocess_mode=False)
    ids = llm.get_tokenizer()(open(TEXT).read()).input_ids
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    lps = [d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(lps) / len(lps))


def _hf_ppl(model: str) -> float:
    import torch
    from llmserve.benchmarks.hf_backend import load_hf_model
    from llmserve.tokenizer import get_tokenizer
    from llmserve.benchmarks.hf_backend import resolve_model_files
    hf = load_hf_model(model, "float32")
    path, gguf = resolve_model_files(model)
    ids = get_tokenizer(path, gguf)(open(TEXT).read()).input_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])
    return math.exp(-float(lp.mean()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--one", choices=["packed", "bf16", "fp32", "hf-fp32"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:  # one figure per process (the packed switch is read at load time)
        ppl = (_hf_ppl(args.model) if args.one == "hf-fp32" else
               _llmserve_ppl(args.model, "float32" if args.one == "fp32" else "bfloat16", 4, args.one == "packed"))
        print(f"{ppl:.4f}")
        return
    for name, env in (("packed", {}), ("bf16", {"LLMSERVE_PACKED_WEIGHTS": "0"}), ("fp32", {}), ("hf-fp32", {})):
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--one", name],
                             env={**os.environ, **env}, capture_output=True, text=True, check=True)
        print(f"perplexity {name:8s} {out.stdout.strip().splitlines()[-1]}", flush=True)


if __name__ == "__main__":
    main()
