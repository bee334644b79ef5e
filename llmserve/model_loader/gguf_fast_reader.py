"""``gguf.GGUFReader`` with the same fields, parsed ~20x faster (cold start of a GGUF model).

A cold start (no start-up cache entry yet) reads a GGUF file's metadata three times with
``gguf.GGUFReader``: transformers' ``load_gguf_checkpoint`` for the config and again for
the tokenizer's config, and ``gguf_config._Meta``. The reader makes one numpy view per
metadata value: 2 for each of the 49,152 vocabulary strings, 1 for each score, token type
and merge, ~300k in all for SmolLM2, and each view of its ``np.memmap`` runs memmap's
Python ``__getitem__`` and ``__array_finalize__``. That was 2.4-3.7 s a read on 2 cores,
~9 s of the API server's ~15 s cold start (py-spy, SmolLM2 Q4_1).

:class:`FastGGUFReader` builds the same ``fields`` (same names, offsets, ``parts`` of the
same dtypes, shapes and bytes, ``data`` indices and ``types``) and ``tensors``: it views
the file through a plain ndarray over the same mapping (no memmap hooks) and slices an
array's elements out of one view of the whole array in native byte order. Arrays in a
byte-swapped file, other types and any error take ``GGUFReader``'s own code, and a file
that fails to parse is parsed again by it so the error is the one it always raised.
SmolLM2-135M Q4_1 (98 MB): 4.6 -> 0.15 s a read.

:func:`fast_gguf_reads`: a block during which ``gguf.GGUFReader`` (what transformers
imports when it reads a GGUF file) is this class; re-entrant and thread-safe.
"""
from __future__ import annotations

import contextlib
import struct
from typing import Any, Iterator

import numpy as np
from gguf import GGUFReader
from gguf.constants import GGUFValueType

from llmserve.shared_patch import SharedPatch

_U64 = struct.Struct("<Q")
_DTYPES: dict[Any, np.dtype] = {}


class FastGGUFReader(GGUFReader):
    """``gguf.GGUFReader(path)``, the same ``fields`` and ``tensors``, faster (module doc).
    The value views are plain ndarrays over the file's read-only mapping instead of
    ``np.memmap`` instances; anything else is GGUFReader's."""

    _stock = False  # True: every method is GGUFReader's (a mode other than "r", or a retry)

    def __init__(self, path: Any, mode: str = "r"):
        self._stock = mode != "r"  # plain views of a writable mapping would lose memmap.flush
        try:
            super().__init__(path, mode)
        except Exception:
            if self._stock:
                raise
            self._stock = True  # the stock reader names what is wrong with the file
            super().__init__(path, mode)

    @property
    def data(self) -> np.ndarray:  # noqa: D102 - GGUFReader's attribute
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value
        # memmap's Python __getitem__ / __array_finalize__ ran for each of ~300k slices
        self._plain = value if self._stock or not isinstance(value, np.memmap) else value.view(np.ndarray)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if self._stock:
            return super()._get(offset, dtype, count, override_order)
        count = int(count)
        dt = _DTYPES.get(dtype)
        if dt is None:
            dt = _DTYPES[dtype] = np.dtype(dtype)
        arr = self._plain[offset:offset + dt.itemsize * count].view(dt)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        if self._stock or self.byte_order != "I" or raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n, offs = GGUFValueType(raw_itype[0]), int(alen[0]), orig_offs + 12
        types = [GGUFValueType.ARRAY, itype] if n else [GGUFValueType.ARRAY]  # GGUFReader: the first item's
        parts: list[np.ndarray] = [raw_itype, alen]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:  # one 1-element view per item, as GGUFReader
            size = np.dtype(nptype).itemsize
            whole = self._plain[offs:offs + size * n].view(nptype)
            if len(whole) != n:
                raise ValueError("array runs past the end of the file")
            parts += [whole[i:i + 1] for i in range(n)]
            return 12 + size * n, parts, list(range(2, 2 + n)), types
        if itype == GGUFValueType.STRING:  # (length, bytes) per item, as GGUFReader
            plain, unpack = self._plain, _U64.unpack_from
            for _ in range(n):
                (length,) = unpack(plain, offs)
                parts.append(plain[offs:offs + 8].view(np.uint64))
                parts.append(plain[offs + 8:offs + 8 + length])
                offs += 8 + length
            if offs > len(plain):
                raise ValueError("array runs past the end of the file")
            return offs - orig_offs, parts, list(range(3, 3 + 2 * n, 2)), types
        return super()._get_field_parts(orig_offs, raw_type)  # arrays of arrays


_READER = SharedPatch()


@contextlib.contextmanager
def fast_gguf_reads() -> Iterator[None]:
    """During the block ``gguf.GGUFReader`` is :class:`FastGGUFReader` (transformers'
    ``load_gguf_checkpoint`` imports it by that name when it runs). Re-entrant and
    thread-safe (a depth count: the config and the tokenizer load in two threads)."""
    import gguf

    with _READER.applied(gguf, "GGUFReader", FastGGUFReader):
        yield
