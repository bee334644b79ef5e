"""On-disk start-up cache for GGUF models (issue 16: "ready to serve in a few seconds from
a warm cache").

Reading a GGUF file is slow in Python: transformers converts its metadata into a config
(seconds) and its 49k-entry vocabulary into a fast tokenizer (seconds, in the API server
and again in the engine), and ``gguf.quants.dequantize`` turns the blocks into floats in
numpy (seconds). The first start saves what those steps produce under
``~/.cache/llmserve/models/<sha256 of the file>/``, keyed by the file's content (and the
transformers version, which does the conversion):

- ``hf/``: ``config.json`` and the tokenizer files (``save_pretrained``), so later starts
  load them as from a Hugging Face directory;
- ``weights-<dtype>[-packed|-blocks].safetensors``: the dequantized tensors under their HF
  names (``w.<name>``) and, when packed small-step weights were kept, the file's raw blocks
  (``p.<name>``, ggml type ids in the metadata), what ``gguf_loader.iterate_gguf_weights``
  yields. ``-blocks`` (issue 31: the model runs its packed layers on the blocks at every
  step and frees their dense copies) holds neither the dense copies of those layers nor
  their raw blocks, but the packed weights in the kernels' layout by module
  (``k.<module>#<part>.<field>``, descriptions in the metadata under ``k.<module>``; see
  ``models/packed.py``), read straight onto huge pages: a warm start neither dequantizes,
  copies nor repacks them. SmolLM2-135M Q4_1's entry: ~365 MB with the dense copies, ~97
  MB without.

The content hash is computed once per (path, size, mtime, inode) and remembered in
``stat/``. Each entry names its file's hash in ``source``; a cold start that writes a new
entry of a file removes that file's older entries (another FORMAT_VERSION or transformers
version), so upgrades do not pile up dead copies. Every entry is written to a temporary name and renamed into place, so
concurrent starts never read half a file. Any failure to read or write the cache is
logged and the engine loads from the GGUF file as before. vLLM has no GGUF cache; its
closest relative is the torch.compile cache under ``VLLM_CACHE_ROOT``.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

if TYPE_CHECKING:  # the API server reads configs and tokenizers from here without torch
    import torch

logger = logging.getLogger(__name__)

# Bump when what the loader yields for the same file changes (names, permutations, dtypes).
# 2: Q5_0 / Q5_1 / K-quant blocks kept packed too (issue 30); 3: ``-blocks`` entries (issue
# 31); 4: ``-blocks`` entries hold the kernels' layout (``k.*``), not the raw blocks; 5:
# quantized MoE expert stacks kept packed, one entry per expert (an older entry would leave a
# Mixtral file's experts dense); 6: a Gemma 3 file without ``attention.sliding_window`` has no
# sliding layers (an older entry's config.json slides 5 of 6 layers); 7: RoPE scaling of
# llama / qwen files (rope.scaling.*, rope_freqs) in config.json; 8: YaRN's betas and attention
# factor (rope.scaling.yarn_*) in config.json
FORMAT_VERSION = "8"


def cache_root() -> str:
    """``~/.cache/llmserve/models`` (next to the C++ kernels' build cache)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "llmserve", "models")


def _transformers_version() -> str:
    try:
        import transformers
        return transformers.__version__
    except ImportError:  # pragma: no cover
        return "none"


def file_hash(path: str) -> str:
    """sha256 (hex) of the file's bytes, remembered per (real path, size, mtime, inode) so
    a warm start does not read the file."""
    st = os.stat(path)
    stat_key = hashlib.sha256(f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
                              .encode()).hexdigest()[:32]
    memo = os.path.join(cache_root(), "stat", stat_key)
    try:
        with open(memo, encoding="ascii") as f:
            value = f.read().strip()
        if len(value) == 64:
            return value
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    value = h.hexdigest()
    try:
        _write_atomic(memo, value.encode("ascii"))
    except OSError as e:
        logger.debug("cannot remember the hash of %s: %s", path, e)
    return value


def entry_dir(gguf_path: str) -> str:
    """The cache directory of a GGUF file (it need not exist yet)."""
    key = hashlib.sha256(f"{file_hash(gguf_path)}|{_transformers_version()}|{FORMAT_VERSION}"
                         .encode()).hexdigest()[:32]
    return os.path.join(cache_root(), key)


def _write_atomic(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _hf_dir(gguf_path: str) -> Optional[str]:
    try:
        return os.path.join(entry_dir(gguf_path), "hf")
    except OSError as e:
        logger.warning("start-up cache unavailable for %s: %s", gguf_path, e)
        return None


def load_hf_object(gguf_path: str, marker: str, load_cached: Callable[[str], Any],
                   load_fresh: Callable[[], Any]) -> Any:
    """A config or tokenizer of a GGUF file: ``load_cached(hf_dir)`` when the cache's
    ``hf/`` directory holds ``marker`` (e.g. ``config.json``), else ``load_fresh()``, whose
    result is then saved there with ``save_pretrained``. Errors of ``load_fresh``
    propagate; cache errors only fall back to it."""
    hf_dir = _hf_dir(gguf_path)
    if hf_dir is not None and os.path.isfile(os.path.join(hf_dir, marker)):
        try:
            return load_cached(hf_dir)
        except Exception as e:  # a damaged entry: rebuild it below
            logger.warning("start-up cache %s unreadable (%s); reading the GGUF file", hf_dir, e)
    if hf_dir is not None and _fill_in_child(gguf_path, os.path.join(hf_dir, marker)):
        try:
            return load_cached(hf_dir)
        except Exception as e:
            logger.warning("start-up cache %s unreadable (%s); reading the GGUF file", hf_dir, e)
    obj = load_fresh()
    if hf_dir is not None:
        try:
            os.makedirs(hf_dir, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=hf_dir, prefix=".tmp-")
            try:
                obj.save_pretrained(tmp)
                for name in os.listdir(tmp):
                    os.replace(os.path.join(tmp, name), os.path.join(hf_dir, name))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            retire_stale_entries(gguf_path, os.path.dirname(hf_dir))
        except Exception as e:
            logger.warning("cannot write the start-up cache %s: %s", hf_dir, e)
    return obj


def _fill_in_child(gguf_path: str, marker_path: str) -> bool:
    """In a process whose transformers runs without torch (the API server), fill the
    entry's ``hf/`` in a child (``startup_cache_fill``: transformers' GGUF reader imports
    torch); True when ``marker_path`` then exists. Elsewhere False at once: the caller
    converts in process. A failed child is logged and leaves the in-process conversion."""
    import subprocess
    import sys

    from llmserve.torch_hiding import transformers_without_torch
    if not transformers_without_torch():
        return False
    cmd = [sys.executable, "-m", "llmserve.model_loader.startup_cache_fill", gguf_path]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("start-up cache: converting %s in a child failed (%s); converting here", gguf_path, e)
        return False
    if proc.returncode != 0:
        logger.warning("start-up cache: converting %s in a child failed (exit %d): %s; converting here",
                       gguf_path, proc.returncode, proc.stderr.strip()[-2000:])
    return os.path.isfile(marker_path)


def retire_stale_entries(gguf_path: str, entry: str) -> list[str]:
    """Mark ``entry`` as the GGUF file's entry (a ``source`` file holding its content
    hash) and remove the other entries of the same file, which an older FORMAT_VERSION or
    transformers version wrote: their key can never be asked for again, and each holds
    ~100-400 MB for a 135M model. Entries without a mark (written before marks) and
    entries of other files are left. Returns the removed directories. Called once per
    entry, when a cold start writes its config (``load_hf_object``)."""
    digest = file_hash(gguf_path)
    _write_atomic(os.path.join(entry, "source"), digest.encode("ascii"))
    removed = []
    for name in os.listdir(cache_root()):
        other = os.path.join(cache_root(), name)
        if other == entry or not os.path.isfile(os.path.join(other, "source")):
            continue
        with open(os.path.join(other, "source"), encoding="ascii", errors="replace") as f:
            if f.read().strip() != digest:
                continue
        shutil.rmtree(other, ignore_errors=True)  # a server still mapping its weights keeps them
        removed.append(other)
        logger.info("start-up cache: removed %s, an older version's entry of %s", other, gguf_path)
    return removed


def weights_path(gguf_path: str, dtype: torch.dtype, packed: bool, blocks_only: bool = False
                 ) -> Optional[str]:
    """The cache file of the GGUF file's weights in ``dtype``: with the raw blocks when
    ``packed``; ``blocks_only``: without the dense copies of the layers that run on the
    blocks at every step (each kind its own file, so a tensor-parallel worker, which needs
    every dense weight, never reads a file that lacks some). None (logged) when the cache
    directory cannot be found (e.g. the GGUF file cannot be hashed)."""
    suffix = "-blocks" if packed and blocks_only else "-packed" if packed else ""
    try:
        return os.path.join(entry_dir(gguf_path),
                            f"weights-{str(dtype).removeprefix('torch.')}{suffix}.safetensors")
    except OSError as e:
        logger.warning("start-up cache unavailable for %s: %s", gguf_path, e)
        return None


def read_weights(path: Optional[str], packed: Optional[dict], repacked: Optional[dict] = None
                 ) -> Optional[list[tuple[str, torch.Tensor]]]:
    """The ``(hf_name, tensor)`` pairs saved in the cache file ``path`` (filling ``packed``
    with its blocks, ``hf_name -> (ggml type id, uint8 [rows, row_bytes])``, and
    ``repacked`` with its weights in the kernels' layout, ``module -> (description,
    {"<part>.<field>": tensor})`` read straight onto 2 MiB pages, when given), or None when
    there is no such file or it cannot be read (logged; ``packed`` / ``repacked`` may then
    hold part of the file's entries: the caller clears them)."""
    if path is None or not os.path.isfile(path):
        return None
    try:
        items = _read_weights(path, packed, repacked)
    except Exception as e:
        logger.warning("start-up cache %s unreadable (%s); reading the GGUF file", path, e)
        return None
    logger.info("weights from the start-up cache %s", path)
    return items


def cached_gguf_weights(gguf_path: str, dtype: torch.dtype, packed: Optional[dict],
                        load_fresh: Callable[[], Iterator[tuple[str, torch.Tensor]]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """``iterate_gguf_weights``' ``(hf_name, tensor)`` pairs (and its ``packed`` entries,
    filled in as it would), from the cache when present, else from ``load_fresh()`` while
    saving them for the next start (every dense weight: ``-packed`` / plain entries)."""
    path = weights_path(gguf_path, dtype, packed is not None)
    items = read_weights(path, packed)
    if items is not None:
        yield from items
        return
    saved: dict[str, torch.Tensor] = {}
    for name, tensor in load_fresh():
        saved[name] = tensor
        yield name, tensor
    if path is not None:
        save_weights(path, saved, packed)


def _read_weights(path: str, packed: Optional[dict], repacked: Optional[dict] = None
                  ) -> list[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    items, k_keys = [], []
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        for key in f.keys():
            kind, _, name = key.partition(".")
            if kind == "w":
                items.append((name, f.get_tensor(key)))
            elif kind == "p" and packed is not None:
                packed[name] = (int(meta[key]), f.get_tensor(key))
            elif kind == "k" and repacked is not None:
                k_keys.append(key)
    if k_keys:
        tensors = _read_onto_huge_pages(path, k_keys)
        for key, desc in meta.items():
            if key.startswith("k."):
                prefix = f"{key}#"
                repacked[key[2:]] = (desc, {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)})
    return items


# safetensors dtype names of the tensors stored in the kernels' layout (uint8 codes, int8
# scales, int16 float16 bits) and a few more.
_ST_DTYPES = {"U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
              "F16": "float16", "BF16": "bfloat16", "F32": "float32"}


def _read_onto_huge_pages(path: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """The safetensors file's tensors ``keys``, read (``preadv``) straight into one buffer
    on 2 MiB pages (``ops/huge_pages.py``, each tensor 64-byte aligned as
    ``to_huge_pages`` places them): one copy from the page cache, where ``get_tensor`` and
    ``to_huge_pages`` made two. OSError for a short read, KeyError / ValueError for a
    header that does not list a key or names an unknown dtype."""
    import json
    import struct

    import torch

    from llmserve.ops.huge_pages import huge_page_buffer

    with open(path, "rb", buffering=0) as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        spans, total = [], 0
        for key in keys:
            entry = header[key]
            start, end = entry["data_offsets"]
            if entry["dtype"] not in _ST_DTYPES:
                raise ValueError(f"{key}: unknown dtype {entry['dtype']!r}")
            spans.append((key, entry, 8 + n + start, end - start, total))
            total += -(-(end - start) // 64) * 64
        arena = huge_page_buffer(total)
        for key, _, at, nbytes, off in spans:
            view, done = memoryview(arena[off:off + nbytes]), 0
            while done < nbytes:
                got = os.preadv(f.fileno(), [view[done:]], at + done)
                if got <= 0:
                    raise OSError(f"{path}: short read of {key}")
                done += got
    flat = torch.from_numpy(arena)
    return {key: flat[off:off + nbytes].view(getattr(torch, _ST_DTYPES[e["dtype"]])).view(e["shape"])
            for key, e, _, nbytes, off in spans}


def save_weights(path: str, dense: dict[str, torch.Tensor], packed: Optional[dict],
                 omit: frozenset = frozenset(), repacked: Optional[dict] = None) -> None:
    """Write ``dense`` (``hf_name -> tensor``) but the names in ``omit``, the blocks in
    ``packed`` and the weights in ``repacked`` (``module -> (description, {"<part>.<field>":
    tensor})``, see ``read_weights``) to the cache file ``path`` (a temporary name renamed
    into place). Failures are logged, not raised: the next start reads the GGUF file again."""
    from safetensors.torch import save_file

    saved = {f"w.{name}": t for name, t in dense.items() if name not in omit}
    meta = {}
    for name, (qtype, raw) in (packed or {}).items():
        saved[f"p.{name}"] = raw
        meta[f"p.{name}"] = str(int(qtype))
    for module, (desc, tensors) in (repacked or {}).items():
        meta[f"k.{module}"] = desc
        for suffix, t in tensors.items():  # views of one huge-page buffer: safetensors refuses shared memory
            saved[f"k.{module}#{suffix}"] = t.clone()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        os.close(fd)
        try:
            save_file({k: v.contiguous() for k, v in saved.items()}, tmp, metadata=meta)
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
    except Exception as e:
        logger.warning("cannot write the start-up cache %s: %s", path, e)
