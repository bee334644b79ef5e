"""Model id -> local files -> a torch model with loaded weights (vLLM's ``model_loader``)."""
from __future__ import annotations

import logging
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

logger = logging.getLogger(__name__)

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
        device = getattr(model_config, "device", "cpu") or "cpu"
        packed_f32 = bool(getattr(model_config, "packed_float32", False))
        if gguf_file is not None:
            gguf_path = gguf_file if os.path.isabs(gguf_file) else os.path.join(path, gguf_file)
            _load_gguf(model, gguf_path, hf_config, dtype, pack_weights and device == "cpu", packed_f32)
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
                packed = _packed_sink(model, dtype, packed_f32)
                model.load_weights(iterate_compressed_tensors_weights(weights, scheme, dtype, packed))
                _attach_packed(model, packed, pack_weights)
    if device != "cpu":
        return model.to(device).eval()
    if getattr(model, "is_causal", True):  # build (or load the cached) C++ decode kernel now, not at the first request
        from llmserve.ops.cpu_ops import get_decode_kernel
        get_decode_kernel()
    if pack_weights:
        from llmserve.ops.onednn_linear import pack_model
        pack_model(model)  # last: the loaders above read the dense weights
    return model.eval()


def _packed_sink(model: Any, dtype: torch.dtype, packed_f32: bool = False) -> Optional[dict]:
    """The dict the loaders fill with quantized blocks (issue 16), or None: float32 models
    keep exact dense GEMMs only unless ``packed_f32`` (``ModelConfig.packed_float32``: dtype
    "auto" resolved to float32), and models without the packed path take none."""
    import torch

    return {} if (dtype != torch.float32 or packed_f32) and hasattr(model, "packed_head") else None


def _attach_packed(model: Any, packed: Optional[dict], drop_dense: bool,
                   max_rows: Optional[int] = None) -> None:
    """Give the model its packed blocks; ``drop_dense`` False for tensor-parallel workers,
    which shard the dense weights first. ``max_rows``: as ``attach_packed_weights``."""
    if packed:
        from llmserve.models.packed import attach_packed_weights
        attach_packed_weights(model, packed, max_rows=max_rows, drop_dense=drop_dense)


def _load_gguf(model: Any, gguf_path: str, hf_config: Any, dtype: torch.dtype, blocks_may_run: bool,
               packed_f32: bool = False) -> None:
    """Load a GGUF file's weights into ``model`` through the start-up cache.

    ``blocks_may_run``: the model will run on CPU with its dense copies of packed layers
    freed (one worker, ``pack_weights``). Then, when this CPU runs the blocks at every step
    (``packed_switch_point`` = ``ALL_STEPS``), the cache's ``-blocks`` entry holds no dense
    copy of those layers (nor of a tied embedding, whose rows the blocks give:
    ``pack_tied_head``) but their packed weights in the kernels' layout: a warm start
    attaches those first (read onto huge pages, not repacked) and loads the other weights.
    Measured on SmolLM2-135M Q4_1: the entry 365 -> ~97 MB, and ~270 MB of dense copies
    are neither read nor copied nor freed at start (see the issue 31 commits).
    Otherwise (tensor-parallel workers, probed switch points, exact float32) the entry holds
    every dense weight, as before. Raises ValueError as ``load_weights``."""
    from llmserve.model_loader import startup_cache
    from llmserve.model_loader.gguf_loader import iterate_gguf_weights, read_gguf_blocks
    from llmserve.models.packed import (attach_repacked, blocks_only_names, drop_tied_embedding,
                                        packed_max_rows, repacked_weights, weight_from_tensors,
                                        weight_tensors)
    from llmserve.ops.quant_ops import ALL_STEPS

    packed = _packed_sink(model, dtype, packed_f32)
    max_rows = packed_max_rows(model) if packed is not None and blocks_may_run else None
    if max_rows is None or max_rows < ALL_STEPS:  # dense copies may run: the entry keeps them all
        model.load_weights(startup_cache.cached_gguf_weights(
            gguf_path, dtype, packed, lambda: iterate_gguf_weights(gguf_path, hf_config, dtype, packed)))
        _attach_packed(model, packed, blocks_may_run, max_rows)
        return
    path = startup_cache.weights_path(gguf_path, dtype, True, blocks_only=True)
    stored: dict = {}
    cached = startup_cache.read_weights(path, None, stored)
    if cached is not None:
        try:
            attach_repacked(model, {m: weight_from_tensors(d, t) for m, (d, t) in stored.items()}, max_rows)
        except (ValueError, KeyError, TypeError) as e:  # a damaged description: the model is unchanged
            logger.warning("start-up cache %s unusable (%s); reading the GGUF file", path, e)
            cached = None
    if cached is not None:
        drop_tied_embedding(model)
        model.load_weights(cached)  # the rest; load_weights skips the freed (0-row) weights
        return
    # A first start takes the warm start's order: the packed layers from the file's blocks
    # (their dense weights freed before anything is written to them), then the other weights,
    # the packed ones neither dequantized nor copied. Dequantizing every weight first and
    # keeping the dense tensors for the cache entry held the model about three times over
    # (SmolLM2-135M Q4_K_M: peak RSS 1,157 MB, 994 MB after the load, 427 MB warm).
    read_gguf_blocks(gguf_path, hf_config, packed)
    _attach_packed(model, packed, True, max_rows)
    packed.clear()  # the raw blocks: the packed weights are copies in the kernels' layout
    drop_tied_embedding(model)
    skip = blocks_only_names(model)
    dense: dict[str, torch.Tensor] = {}

    def fresh():
        for name, tensor in iterate_gguf_weights(gguf_path, hf_config, dtype, None, skip=skip):
            dense[name] = tensor
            yield name, tensor

    model.load_weights(fresh())
    if path is not None:
        startup_cache.save_weights(path, dense, None, omit=skip,
                                   repacked={m: weight_tensors(w) for m, w in repacked_weights(model).items()})
    dense.clear()
    _return_freed_memory()


def _return_freed_memory() -> None:
    """Give the heap memory a first start freed (the file's raw blocks, dequantized tensors
    of MBs each, below glibc's mmap threshold) back to the system: glibc keeps it for later
    allocations, and the engine's RSS stayed ~250 MB above a warm start's for its whole life
    (SmolLM2-135M Q4_K_M: 683 -> 434 MB, warm 425). Best effort: a no-op without glibc."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
