"""Disk KV tier loads in C++ (``csrc/tier_io.cpp``): all of a load's block files read
straight into the KV cache's slots and verified in one call, without the GIL, on two
threads. ``llmserve/kv_transfer/disk_store.py`` owns the file format (version 3) and the
pure-Python path, which runs where this module cannot be built (no compiler) or
``LLMSERVE_CPU_OPS=0``, or for payloads of 240 bytes or less.

Why: a 4,000-token SmolLM2 prompt is 249 block files (92 MB, 60 slot pieces each). The
Python loop (per block: ``os.open``, one ``readv``, XXH3, ``os.utime``, ``os.close``, 60
slices built) spent ~2.8 ms in Python on top of the ~8 ms copy out of the page cache, on
the request path of a prompt loaded from disk (issue 32 allows ~8.4 ms over a RAM hit).

Built on first use like :mod:`llmserve.ops.lora_ops` (its own small extension, so the
model kernels are not rebuilt when this source changes) into
``~/.cache/llmserve/torch_extensions/tier_io_<hash>``.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

from llmserve.ops.cpu_ops import load_small_extension

logger = logging.getLogger(__name__)

_SOURCE = "tier_io.cpp"
_NAME = "llmserve_tier_io"

# read_blocks' per-block outcomes (csrc/tier_io.cpp's Status) -> the reason logged when a
# file is removed (the same words as disk_store._invalid_header).
STATUS_REASONS = {
    1: "missing",
    2: "unreadable",
    3: "shorter than its header",
    4: "not a KV block file of this version",
    5: "written by another model, dtype or layout",
    6: "holds another block",
    7: "truncated or of the wrong size",
    8: "checksum mismatch",
    9: "after a bad block",
}
MISSING, SKIPPED = 1, 9
# Payloads this short take the Python path (the C++ XXH3 covers inputs over 240 bytes only).
MIN_PAYLOAD = 241


@functools.lru_cache(maxsize=1)
def get_tier_io() -> Optional[Any]:
    """The compiled module, or None (no compiler, ``LLMSERVE_CPU_OPS=0``; logged once):

    - ``read_blocks(cache, num_regions, slot_bytes, folder, hashes, block_ids, prefix, touch,
      threads, status) -> int``: for each ``i``, file ``folder/{hashes[i]:016x}.kv`` into
      block ``block_ids[i]``'s slot of every region. ``cache``: the KV cache as one
      contiguous 1-d uint8 CPU tensor, ``num_regions`` equal regions (one per layer and
      K/V, in file order), block ``b``'s slot bytes ``[b * slot_bytes, (b + 1) *
      slot_bytes)`` of each; ``hashes``: ints (uint64); ``block_ids`` int64 ``[n]``;
      ``prefix``: the 44 bytes every valid header starts with (magic, version, layout key:
      ``disk_store.header_prefix``); ``touch``: bump valid files' mtimes; ``threads``:
      readers (blocks 4 at a time from a shared counter); ``status`` int8 ``[n]`` gets each
      block's outcome (0 valid, else a key of :data:`STATUS_REASONS`). Returns how many,
      from the first, are valid; none after the first invalid one is read (9, skipped).
      Files are not removed here. The GIL is released while it reads.
    - ``count_chain(folder, hashes, size) -> int``: how many, from the first, have a file
      of ``size`` bytes (one ``fstatat`` each); ``-(i + 1)`` when file ``i`` has another size.
    - ``touch(folder, hashes)``: bump the mtimes of those files that exist (``utimensat``).
    - ``xxh3_64(pieces: list[Tensor]) -> int``: XXH3-64 of the pieces' bytes, concatenated
      (more than 240 bytes), equal to ``xxhash.xxh3_64_intdigest``.
    - ``FORMAT_VERSION``, ``HEADER_SIZE``: the file format it reads (3, 76 bytes).
    Each raises RuntimeError on a shape, dtype or range mismatch.
    """
    return load_small_extension(_NAME, _SOURCE, "tier_io", "KV tier reader", "the Python path", ["-O3", "-march=native"])
