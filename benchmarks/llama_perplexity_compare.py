"""Perplexity of GGUF files under llmserve's packed kernels against llama.cpp's
``llama-perplexity`` on the same file and text (issue 30's K-quant figure: within 1%).

Both sides score the text the way ``llama-perplexity`` does: the tokens are cut into
chunks of ``--ctx`` tokens, each chunk is evaluated on its own (a fresh context; the first
token replaced by BOS only when the file's ``tokenizer.ggml.add_bos_token`` says so), and
only the second half of each chunk is scored (positions ctx/2+1 .. ctx-1, each given the
tokens before it in its chunk). ``benchmarks/data/declaration.txt`` is 323 SmolLM2
tokens, so the default ``--ctx 160`` gives 2 chunks and 158 scored tokens.

llmserve runs every step on the packed kernels (int8 activations, as llama.cpp's
``ggml_vec_dot_*_q8_K``), one subprocess per file; beside it, llmserve in float32 on the
file's exact dequantized values (dense), the reference both quantized paths round from:

    PYTHONPATH=. python benchmarks/llama_perplexity_compare.py FILE.gguf [FILE.gguf ...] \\
        [--llama-perplexity PATH] [--ctx 160] [--threads 2]
"""
from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "data", "declaration.txt")
LLAMA_BIN = "/work/llama-build/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-perplexity"


def chunks(ids: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """The whole ``ctx``-token chunks of ``ids`` (the tail that does not fill one is
    dropped, as llama-perplexity drops it), BOS first when the file adds one."""
    out = [list(ids[i:i + ctx]) for i in range(0, len(ids) - ctx + 1, ctx)]
    if bos is not None:
        for c in out:
            c[0] = bos
    return out


def scored_nll(prompt_logprobs: list, chunk: list[int]) -> list[float]:
    """Negative logprobs of the chunk's second half (positions ctx/2+1 .. ctx-1)."""
    first = len(chunk) // 2
    return [-prompt_logprobs[k][chunk[k]].logprob for k in range(first + 1, len(chunk))]


def llmserve_ppl(path: str, ctx: int, dtype: str, text: str = TEXT) -> tuple[float, int]:
    """(perplexity, scored tokens) of ``path`` under llmserve, every step packed (or dense
    when the environment says ``LLMSERVE_PACKED_WEIGHTS=0``)."""
    import gguf
    from llmserve import LLM, SamplingParams
    from llmserve.ops import quant_ops
    quant_ops.packed_switch_point = lambda *a, **k: quant_ops.ALL_STEPS
    llm = LLM(path, dtype=dtype, max_num_seqs=1, kv_cache_memory="64MiB", max_model_len=max(1024, ctx),
              enable_prefix_caching=False, multiprocess_mode=False)
    fields = gguf.GGUFReader(path).fields
    add_bos = "tokenizer.ggml.add_bos_token" in fields and bool(fields["tokenizer.ggml.add_bos_token"].contents())
    bos = int(fields["tokenizer.ggml.bos_token_id"].contents()) if add_bos else None
    ids = llm.get_tokenizer()(open(text).read(), add_special_tokens=False).input_ids
    ids = ([bos] if add_bos else []) + ids  # llama.cpp tokenizes with the file's BOS rule
    nll: list[float] = []
    for chunk in chunks(ids, ctx, bos):
        out = llm.generate([{"prompt_token_ids": chunk}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        nll += scored_nll(out.prompt_logprobs, chunk)
    return math.exp(sum(nll) / len(nll)), len(nll)


def llama_ppl(binary: str, path: str, ctx: int, threads: int, text: str = TEXT) -> float:
    """llama-perplexity's final estimate for ``path`` on the text."""
    out = subprocess.run([binary, "-m", path, "-f", text, "-c", str(ctx), "-b", str(ctx), "-t", str(threads)],
                         capture_output=True, text=True, check=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not m:
        raise RuntimeError(f"no final estimate in llama-perplexity's output:\n{out.stderr[-2000:]}")
    return float(m.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("gguf", nargs="+")
    p.add_argument("--llama-perplexity", default=LLAMA_BIN)
    p.add_argument("--ctx", type=int, default=160)
    p.add_argument("--text", default=TEXT, help="the text to score (declaration.txt scores only 158 tokens: "
                                                  "one standard error of the ratio is ~2%%; GPL-3 at --ctx 512 ~0.25%%)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:  # one file per process: the packed switch is read at load time
        ppl, n = llmserve_ppl(args.gguf[0], args.ctx, args.one, args.text)
        print(f"{ppl:.4f} {n}")
        return
    # dtype auto is what `llmserve serve` runs: bfloat16 activations on CPUs with bfloat16 dot
    # products, float32 on the others (AVX2, AVX512 without BF16), packed either way.
    print("| file | llmserve PPL (packed, bf16) | llmserve PPL (packed, dtype auto) | llama-perplexity PPL "
          "| ratio (auto) | exact weights in fp32 (dense) | scored tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path in args.gguf:
        ours, n = _ours(path, args.ctx, "bfloat16", {}, args.text)
        auto, _ = _ours(path, args.ctx, "auto", {}, args.text)
        exact, _ = _ours(path, args.ctx, "float32", {"LLMSERVE_PACKED_WEIGHTS": "0"}, args.text)
        theirs = llama_ppl(args.llama_perplexity, path, args.ctx, args.threads, args.text)
        print(f"| {os.path.basename(path)} | {ours:.4f} | {auto:.4f} | {theirs:.4f} | {auto / theirs:.4f} "
              f"| {exact:.4f} | {n} |", flush=True)


def _ours(path: str, ctx: int, dtype: str, env: dict, text: str = TEXT) -> tuple[float, str]:
    out = subprocess.run([sys.executable, __file__, path, "--ctx", str(ctx), "--one", dtype, "--text", text],
                         capture_output=True, text=True, check=True, env={**os.environ, **env})
    ppl, n = out.stdout.split()[-2:]
    return float(ppl), n


if __name__ == "__main__":
    main()
