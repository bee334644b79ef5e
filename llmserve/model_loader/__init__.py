"""Model id -> local files -> a torch model with loaded weights (vLLM's ``model_loader``)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

from llmserve.model_loader.resolve import (DEFAULT_MODEL, ResolvedModel, diff_sampling_param,
                                           generation_eos_token_ids, load_generation_config,
                                           load_hf_config, read_generation_config, resolve_model)

if TYPE_CHECKING:  # torch is imported where a model is built: the API server resolves the
    # model and reads its configs through this package without importing torch (issue 31)
    import torch
    from torch import nn

__all__ = ["DEFAULT_MODEL", "ResolvedModel", "diff_sampling_param", "generation_eos_token_ids",
           "get_model", "load_generation_config", "load_hf_config", "read_generation_config",
           "resolve_model", "torch_dtype"]

_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str) -> "torch.dtype":
    """"float32" / "bfloat16" / "float16" -> torch dtype; ValueError (field ``dtype``)
    otherwise."""
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES)}, got {name!r}")
    import torch

    return getattr(torch, name)


def get_model(model_config: Any, pack_weights: bool = True) -> nn.Module:
    """Build the model of ``model_config.hf_config`` and load its weights.

    model_config: ``llmserve.config.ModelConfig``; its ``model_path`` (directory or .gguf
    file) and ``gguf_file`` say where the weights are; ``dtype`` ("float32", "bfloat16",
    "float16") the parameter dtype; ``device`` where the model goes. Returns the model in
    eval mode, parameters without grad. Raises ValueError for an unsupported architecture
    or a checkpoint that does not fit the config. On CPU the linears' weights end packed
    for oneDNN (``ops/onednn_linear.py``) unless ``pack_weights`` is False.
    """
    import torch

    from llmserve.models.registry import get_model_class

    hf_config = model_config.hf_config
    dtype = torch_dtype(model_config.dtype)
    model_cls = get_model_class(hf_config)
    path = model_config.model_path
    gguf_file = model_config.gguf_file
    if path.lower().endswith(".gguf") and os.path.isfile(path):
        path, gguf_file = os.path.split(path)
    with torch.no_grad():
        model = model_cls(hf_config, dtype)
        if gguf_file is not None:
            from llmserve.model_loader.gguf_loader import iterate_gguf_weights
            gguf_path = gguf_file if os.path.isabs(gguf_file) else os.path.join(path, gguf_file)
            packed = _packed_sink(model, dtype)
            from llmserve.model_loader.startup_cache import cached_gguf_weights
            model.load_weights(cached_gguf_weights(
                gguf_path, dtype, packed, lambda: iterate_gguf_weights(gguf_path, hf_config, dtype, packed)))
            _attach_packed(model, packed, pack_weights)
        else:
            from llmserve.model_loader.compressed_tensors_loader import (iterate_compressed_tensors_weights,
                                                                         weight_scheme)
            from llmserve.model_loader.ct2_loader import iterate_ct2_weights, manifest_parts
            from llmserve.model_loader.safetensors_loader import iterate_safetensors_weights
            ct2_parts = manifest_parts(path)  # a CTranslate2 checkpoint seen as an HF dir
            weights = iterate_ct2_weights(ct2_parts) if ct2_parts else iterate_safetensors_weights(path)
            scheme = weight_scheme(hf_config)
            if scheme is None:
                model.load_weights(weights)
            else:  # int4/int8 weight-only: the same packed path as GGUF blocks
                packed = _packed_sink(model, dtype)
                model.load_weights(iterate_compressed_tensors_weights(weights, scheme, dtype, packed))
                _attach_packed(model, packed, pack_weights)
    device = getattr(model_config, "device", "cpu") or "cpu"
    if device != "cpu":
        return model.to(device).eval()
    if getattr(model, "is_causal", True):  # build (or load the cached) C++ decode kernel now, not at the first request
        from llmserve.ops.cpu_ops import get_decode_kernel
        get_decode_kernel()
    if pack_weights:
        from llmserve.ops.onednn_linear import pack_model
        pack_model(model)  # last: the loaders above read the dense weights
    return model.eval()


def _packed_sink(model: Any, dtype: torch.dtype) -> Optional[dict]:
    """The dict the loaders fill with quantized blocks (issue 16), or None: float32 models
    keep exact dense GEMMs only, and models without the packed path take none."""
    import torch

    return {} if dtype != torch.float32 and hasattr(model, "packed_head") else None


def _attach_packed(model: Any, packed: Optional[dict], drop_dense: bool) -> None:
    """Give the model its packed blocks; ``drop_dense`` False for tensor-parallel workers,
    which shard the dense weights first."""
    if packed:
        from llmserve.models.packed import attach_packed_weights
        attach_packed_weights(model, packed, drop_dense=drop_dense)
