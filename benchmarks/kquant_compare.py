"""K-quant GGUF files against the packaged Q4_1 file (issue 30 item 1): SmolLM2-135M
re-encoded with llmserve's K-quant writer (``llmserve/benchmarks/kquant_writer.py``) as a
Q4_K_M-style mix (the dense weights come from dequantizing the packaged Q4_1 file), then
in ONE process with both models loaded, alternating rounds, medians: decode TPOT at batch
1 and 16, the bytes the model's weight tensors hold against the file size, and the
perplexity on ``benchmarks/data/declaration.txt`` (``benchmarks/perplexity.py``'s packed
figure, one subprocess per file).

    PYTHONPATH=. python benchmarks/kquant_compare.py [--mix q4_k_m|q6_k] [--rounds 3] [--tokens 32]
    PYTHONPATH=. python benchmarks/kquant_compare.py --mix f32 --convert-only   # llama-quantize's input
    PYTHONPATH=. python benchmarks/kquant_compare.py --file /tmp/SmolLM2.Q4_K_M.gguf  # its output
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from packed_decode_ab import _step_ms  # benchmarks/ is on sys.path when run as a script

HERE = os.path.dirname(os.path.abspath(__file__))


def packaged_q4_1() -> str:
    from llmserve.model_loader.resolve import resolve_model
    return resolve_model("SmolLM2-135M-Instruct").model_file


def _q6_k_type(name: str, row: int, n_layers: int):
    from llmserve.benchmarks import kquant_writer as kw
    if not name.endswith(".weight") or "norm" in name:
        return None
    return kw.Q6_K if row % kw.QK_K == 0 else kw.FALLBACK[kw.Q6_K]


def convert(src: str, dst: str, mix: str) -> dict[str, int]:
    """Re-encode GGUF ``src`` as ``mix`` at ``dst``, every metadata field copied (the
    tokenizer with it). Returns type name -> tensor count."""
    import gguf
    from gguf.quants import dequantize
    from llmserve.benchmarks.kquant_writer import q4_k_m_type, write_gguf
    reader = gguf.GGUFReader(src)
    n_layers = int(reader.fields["llama.block_count"].contents())
    pick = {"q4_k_m": q4_k_m_type, "q6_k": _q6_k_type, "f32": lambda *a: None}[mix]

    def fields(w) -> None:
        for f in reader.fields.values():
            if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
                continue
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)

    tensors = ((t.name, np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)) for t in reader.tensors)
    kinds = write_gguf(dst, tensors, lambda n, row: pick(n, row, n_layers), fields=fields)
    counts: dict[str, int] = {}
    for k in kinds.values():
        counts[k] = counts.get(k, 0) + 1
    return counts


def _load(path: str):
    from llmserve import LLM
    return LLM(path, multiprocess_mode=False, kv_cache_memory="256MiB", max_model_len=1024)


def _model(llm):
    return llm.llm_engine.engine_core.engine_core.model_runner.model


def weight_bytes(model) -> int:
    """Bytes of every distinct tensor storage the model holds: parameters, buffers and
    the packed weights (codes, scales) of its linears and head."""
    seen: dict[int, int] = {}

    def add(t) -> None:
        if hasattr(t, "untyped_storage"):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()

    def add_weight(q) -> None:
        for part in getattr(q, "parts", (q,)):
            for v in vars(part).values():
                add(v)

    for t in list(model.parameters()) + list(model.buffers()):
        add(t)
    for m in model.modules():
        if getattr(m, "qweight", None) is not None:
            add_weight(m.qweight)
    if getattr(model, "packed_head", None) is not None:
        add_weight(model.packed_head[0])
    onednn = getattr(model, "onednn_head", None)
    if onednn is not None:
        add(onednn)
    return sum(seen.values())


def _ppl(path: str) -> str:
    out = subprocess.run([sys.executable, os.path.join(HERE, "perplexity.py"), "--model", path, "--one", "packed"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mix", choices=["q4_k_m", "q6_k", "f32"], default="q4_k_m",
                   help="f32: the dense file llama-quantize takes (--convert-only)")
    p.add_argument("--file", default=None, help="compare this GGUF file (e.g. llama-quantize's) instead of "
                                                "converting; its name labels it")
    p.add_argument("--convert-only", action="store_true")
    p.add_argument("--out", default="/tmp/llmserve-kquant")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--no-ppl", action="store_true")
    args = p.parse_args()
    src = packaged_q4_1()
    os.makedirs(args.out, exist_ok=True)
    dst = os.path.join(args.out, f"SmolLM2-135M-Instruct.{args.mix.upper()}.gguf")
    if args.file:
        dst = args.file
    elif not os.path.isfile(dst):
        print(f"converted {dst}: {convert(src, dst, args.mix)}", flush=True)
    if args.convert_only:
        return
    files = {"Q4_1": src, os.path.basename(dst): dst}
    from llmserve.ops import quant_ops
    quant_ops.packed_switch_point = lambda *a, **k: quant_ops.ALL_STEPS  # every step packed, as on this CPU
    llms = {name: _load(path) for name, path in files.items()}
    for name, path in files.items():
        wb = weight_bytes(_model(llms[name]))
        print(f"{name}: file {os.path.getsize(path) / 2**20:.1f} MiB, weight tensors {wb / 2**20:.1f} MiB "
              f"({wb / os.path.getsize(path):.2f}x the file)", flush=True)
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [{"prompt_token_ids": list(range(1000 + i, 1032 + i))} for i in range(batch)]
        res: dict[str, list[float]] = {n: [] for n in files}
        for r in range(args.rounds + 1):
            for name in (list(files) if r % 2 == 0 else list(files)[::-1]):
                ms = _step_ms(llms[name], prompts, args.tokens)
                if r:  # round 0 warms up
                    res[name].append(ms)
        med = {n: statistics.median(v) for n, v in res.items()}
        a, b = list(files)
        print(f"batch {batch}: TPOT {a} {med[a]:.2f} ms, {b} {med[b]:.2f} ms; {b} runs at "
              f"{med[a] / med[b]:.2f}x the speed of {a} (load {os.getloadavg()[0]:.1f})", flush=True)
    if not args.no_ppl:
        for name, path in files.items():
            print(f"perplexity {name}: {_ppl(path)} (load {os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
