"""The same-run GEMM ceiling of a decoder model: how fast its linear layers alone can go.

A transformer step over ``T`` tokens is dominated by its linear layers: per decoder layer
the fused q/k/v projection, ``o_proj``, the fused gate/up projection and ``down_proj``,
then the LM head. Timing exactly those GEMMs (``torch.nn.functional.linear`` with the
model's real shapes, read from its Hugging Face config, on random weights of the same
dtype and with the same torch thread count) gives an upper bound on tokens/s that an
engine cannot beat without changing the arithmetic (quantized weights, fewer FLOPs):

    ceiling tokens/s = T / (time of all linear layers at T tokens per step)

At ``T = 1`` the GEMMs are memory-bound (every weight byte is read for one token); at
``T`` of a few hundred they are compute-bound. Each layer gets its own weight tensors, so
the 1-token case streams the full weight set from memory as a real decode step does.

The LM head is timed over all ``T`` tokens (as in a step that produces logits for every
token), which makes the ceiling slightly conservative for prefill-heavy steps where an
engine only computes logits for the last token of each sequence.

This is the llmserve analogue of a roofline bound (Williams et al., "Roofline: an
insightful visual performance model", CACM 2009), measured instead of derived.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Optional, Union

import torch

__all__ = ["LinearShape", "CeilingResult", "linear_shapes", "measure_gemm_ceiling"]


@dataclass(frozen=True)
class LinearShape:
    """One linear layer: ``name``, ``in_features``, ``out_features`` and how many times
    it occurs in the model (``count``: the number of decoder layers, or 1 for the LM head).
    """

    name: str
    in_features: int
    out_features: int
    count: int

    @property
    def flops_per_token(self) -> int:
        """FLOPs for one token through all ``count`` copies: 2 * in * out * count."""
        return 2 * self.in_features * self.out_features * self.count


@dataclass(frozen=True)
class CeilingResult:
    """Timing of all linear layers at ``tokens_per_step`` tokens.

    seconds_per_step: fastest wall time (s) of one pass over every linear layer (the
    minimum over the timed passes: interference from other processes only adds time, so
    the minimum is the best estimate of what the hardware does).
    median_seconds_per_step: the median pass, for judging the noise.
    tokens_per_s: tokens_per_step / seconds_per_step (the ceiling).
    gflops_per_step: GFLOP of one pass (2 * m * n * k summed over all layers).
    gflop_per_s: gflops_per_step / seconds_per_step.
    weight_bytes: bytes of all weight tensors (what a 1-token step must read).
    dtype: torch dtype name; num_threads: torch intra-op threads used.
    """

    tokens_per_step: int
    seconds_per_step: float
    median_seconds_per_step: float
    tokens_per_s: float
    gflops_per_step: float
    gflop_per_s: float
    weight_bytes: int
    dtype: str
    num_threads: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cfg(hf_config: Any, name: str, default: Any = None) -> Any:
    value = getattr(hf_config, name, None)
    if value is None and hasattr(hf_config, "get_text_config"):
        value = getattr(hf_config.get_text_config(), name, None)
    return default if value is None else value


def linear_shapes(hf_config: Any) -> list[LinearShape]:
    """The linear layers of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) from its
    Hugging Face config: fused ``qkv_proj``, ``o_proj``, fused ``gate_up_proj`` and
    ``down_proj`` per layer (``count`` = num_hidden_layers), plus ``lm_head``.

    Reads hidden_size, intermediate_size, num_attention_heads, num_key_value_heads
    (default: num_attention_heads), head_dim (default: hidden_size // heads),
    num_hidden_layers and vocab_size. Raises ValueError when one of the required sizes
    is missing or not positive.
    """
    required = ("hidden_size", "intermediate_size", "num_attention_heads",
                "num_hidden_layers", "vocab_size")
    vals = {}
    for name in required:
        v = _cfg(hf_config, name)
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"hf_config.{name}: expected a positive int, got {v!r}")
        vals[name] = v
    hidden = vals["hidden_size"]
    heads = vals["num_attention_heads"]
    kv_heads = int(_cfg(hf_config, "num_key_value_heads", heads))
    head_dim = int(_cfg(hf_config, "head_dim", hidden // heads))
    layers = vals["num_hidden_layers"]
    inter = vals["intermediate_size"]
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    return [
        LinearShape("qkv_proj", hidden, q_size + 2 * kv_size, layers),
        LinearShape("o_proj", q_size, hidden, layers),
        LinearShape("gate_up_proj", hidden, 2 * inter, layers),
        LinearShape("down_proj", inter, hidden, layers),
        LinearShape("lm_head", hidden, vals["vocab_size"], 1),
    ]


@contextmanager
def _threads(num_threads: Optional[int]) -> Iterator[int]:
    old = torch.get_num_threads()
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads: must be at least 1, got {num_threads}")
        torch.set_num_threads(num_threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(old)


def _to_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating-point dtype, got {dtype!r}")
        return dtype
    name = {"half": "float16", "float": "float32"}.get(dtype, dtype)
    result = getattr(torch, name, None)
    if not isinstance(result, torch.dtype) or not result.is_floating_point:
        raise ValueError(f"dtype: expected a floating-point dtype, got {dtype!r}")
    return result


@torch.inference_mode()
def measure_gemm_ceiling(
    hf_config: Any,
    tokens_per_step: int,
    dtype: Union[str, torch.dtype] = "bfloat16",
    num_threads: Optional[int] = None,
    warmup: int = 2,
    iters: int = 5,
    device: str = "cpu",
    seed: int = 0,
) -> CeilingResult:
    """Time every linear layer of the model described by ``hf_config`` at
    ``tokens_per_step`` tokens: inputs ``[tokens_per_step, in_features]`` and weights
    ``[out_features, in_features]``, both ``dtype``, one separate weight per layer.

    Returns the fastest of ``iters`` passes (after ``warmup`` passes) as a CeilingResult.
    ``num_threads`` None keeps torch's current thread count (the engine's, when called in
    the same process after it started); otherwise it is set for the measurement and
    restored afterwards. Raises ValueError for tokens_per_step < 1, iters < 1,
    warmup < 0, num_threads < 1 or an unknown dtype.
    """
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step: must be at least 1, got {tokens_per_step}")
    if iters < 1:
        raise ValueError(f"iters: must be at least 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup: must be non-negative, got {warmup}")
    tdtype = _to_dtype(dtype)
    shapes = linear_shapes(hf_config)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        # Small normal values: no denormals, no overflow; the values do not matter.
        return (torch.randn(*shape, generator=gen) * 0.02).to(device=device, dtype=tdtype)

    with _threads(num_threads) as threads:
        # Per decoder layer: (qkv, o, gate_up, down); then the LM head.
        num_layers = shapes[0].count
        layer_ws = [[rand(s.out_features, s.in_features) for s in shapes[:4]] for _ in range(num_layers)]
        head = shapes[4]
        lm_head_w = rand(head.out_features, head.in_features)
        inputs = [rand(tokens_per_step, s.in_features) for s in shapes]
        weight_bytes = sum(w.numel() * w.element_size() for ws in layer_ws for w in ws)
        weight_bytes += lm_head_w.numel() * lm_head_w.element_size()

        def one_pass() -> None:
            for ws in layer_ws:
                for x, w in zip(inputs, ws):
                    torch.nn.functional.linear(x, w)
            torch.nn.functional.linear(inputs[4], lm_head_w)
            if device.startswith("cuda"):
                torch.cuda.synchronize()

        for _ in range(warmup):
            one_pass()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            one_pass()
            times.append(time.perf_counter() - t0)
    seconds = min(times)
    gflops = tokens_per_step * sum(s.flops_per_token for s in shapes) / 1e9
    return CeilingResult(
        tokens_per_step=tokens_per_step,
        seconds_per_step=seconds,
        median_seconds_per_step=statistics.median(times),
        tokens_per_s=tokens_per_step / seconds,
        gflops_per_step=gflops,
        gflop_per_s=gflops / seconds,
        weight_bytes=weight_bytes,
        dtype=str(tdtype).removeprefix("torch."),
        num_threads=threads,
    )


def format_ceiling(result: CeilingResult) -> str:
    """One human-readable line for a CeilingResult."""
    return (f"GEMM ceiling @ {result.tokens_per_step} tokens/step ({result.dtype}, "
            f"{result.num_threads} threads): {result.seconds_per_step * 1e3:.2f} ms/step (median "
            f"{result.median_seconds_per_step * 1e3:.2f}), "
            f"{result.tokens_per_s:.1f} tokens/s, {result.gflop_per_s:.1f} GFLOP/s")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``python -m llmserve.benchmarks.ceiling``."""
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="Model whose shapes to use.")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16, float32 or float16.")
    parser.add_argument("--tokens-per-step", type=int, nargs="+", default=[1, 256],
                        help="Tokens per step to time (default: 1 256).")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: current).")
    parser.add_argument("--num-iters", type=int, default=5, help="Timed passes (the fastest is reported).")
    parser.add_argument("--output-json", default=None, help="Write the results to this JSON file.")


def main(args: argparse.Namespace) -> dict:
    """Measure and print the ceiling for each --tokens-per-step; returns the result dict."""
    from llmserve.benchmarks.hf_backend import load_hf_config
    from llmserve.config import resolve_dtype

    dtype = resolve_dtype(args.dtype, "cpu")
    hf_config = load_hf_config(args.model)
    results = []
    for t in args.tokens_per_step:
        r = measure_gemm_ceiling(hf_config, t, dtype, num_threads=args.num_threads, iters=args.num_iters)
        print(format_ceiling(r))
        results.append(r.to_dict())
    out = {"model": args.model, "ceilings": results}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description="Time the model's linear-layer GEMMs (the ceiling).")
    add_cli_args(_parser)
    main(_parser.parse_args())
