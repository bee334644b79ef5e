"""The Hugging Face transformers reference model of a checkpoint llmserve serves: the same
files resolved as the engine resolves them, loaded into ``AutoModelForCausalLM`` with
dense weights (GGUF dequantized). The compressed-tensors writer quantizes it; ``llmserve
bench throughput --backend hf`` (``llmserve/benchmarks/hf_backend.py``, which re-exports
these names) and the correctness tests measure and compare against it. Runtime code lives
here so that no runtime module imports a benchmark (``tests/test_layering.py``).
"""
from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch

from llmserve.model_loader.resolve import resolve_model

__all__ = ["resolve_model_files", "load_hf_config", "load_hf_model", "load_hf_tokenizer"]


def resolve_model_files(model: str) -> tuple[str, Optional[str]]:
    """Map a model argument to ``(directory, gguf_file_name_or_None)`` for transformers'
    ``from_pretrained(directory, gguf_file=...)``.

    Any model :func:`~llmserve.model_loader.resolve.resolve_model` accepts (a local HF
    directory, a ``.gguf`` file, a packaged model such as SmolLM2-135M-Instruct). Raises
    ValueError for a model it cannot find.
    """
    r = resolve_model(model)
    path, gguf = str(r.path), getattr(r, "gguf_file", None)
    if path.endswith(".gguf") and os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if gguf:
        if os.path.isabs(gguf) or os.path.isfile(gguf):
            return os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
        return path, gguf
    return path, None


def load_hf_config(model: str) -> Any:
    """The transformers config of ``model`` (``AutoConfig``; read from GGUF metadata for a
    GGUF model)."""
    from transformers import AutoConfig

    path, gguf = resolve_model_files(model)
    return AutoConfig.from_pretrained(path, gguf_file=gguf) if gguf else AutoConfig.from_pretrained(path)


def load_hf_tokenizer(model: str) -> Any:
    """The transformers tokenizer of ``model`` (``AutoTokenizer``, local files only; rebuilt
    from the GGUF metadata for a GGUF model), uncached: for one-off tools such as the
    compressed-tensors writer (the server's cached loading is ``llmserve.tokenizer``).
    Raises ValueError for a model it cannot find."""
    from transformers import AutoTokenizer

    path, gguf = resolve_model_files(model)
    kwargs: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    return AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)


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
