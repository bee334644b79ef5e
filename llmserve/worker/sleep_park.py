"""Sleep level 1's weights: parked in a disk file's page cache, not rebuilt on wake.

Level 1 must wake fast (issue 31: the first token after the wake in <= 0.5 s). Rebuilding
the model, as level 2 does, took 0.38-2.9 s of the wake on SmolLM2-135M Q4_1 (2 cores,
load 3-8: ``quant_repack`` 0.20 s, copying the weights into the model 0.12 s, a full GC
0.15 s, and the rest waiting for the CPU). Parking keeps the model object and its tensors
where they are and only takes their memory away:

1. :func:`park` finds the model's tensors (parameters, buffers and the tensors that
   modules hold in other attributes, such as the packed GGUF weights in their 2 MiB-page
   buffer), takes the whole 4 KiB pages inside each tensor's memory that lie in anonymous
   mappings, writes those pages to an unlinked file on disk, starts the file's writeback,
   and frees them with ``madvise(MADV_DONTNEED)`` (anonymous private memory: the pages go
   back to the OS at once; touching them again would read zeros).
2. :func:`unpark` reads the file back into the same addresses (the pages fault in again,
   as 2 MiB pages where the buffer was advised MADV_HUGEPAGE) and closes the file.

What the freed bytes become: the anonymous pages (RssAnon) go back to the OS; the file's
pages are page cache, clean once written back, which the OS drops under memory pressure
(the wake then reads them from disk). The file must therefore be on a disk, not tmpfs
(there its pages would be shared memory, which without swap the OS cannot take back):
:func:`park_dir` picks the start-up cache's directory, or returns None when that is on
tmpfs/ramfs and the caller frees and rebuilds the model instead.

Partial pages at the edges of a tensor stay resident (they may hold other allocations);
nothing reads or writes the parked pages while the engine sleeps (no step runs), and the
parked storages are referenced until the wake, so their memory cannot be reused meanwhile.
Linux only (``/proc/self/maps``, glibc's madvise); elsewhere :func:`park` returns None.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import tempfile
from typing import Any, Iterator, Optional

import torch

logger = logging.getLogger(__name__)

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_DONTNEED = 4
_SYNC_FILE_RANGE_WRITE = 2
_CHUNK = 64 << 20  # bytes per write/read call (os.write may write less than asked)
# Past this share of opaque (unparkable) weight bytes, parking would leave the weights
# mostly resident: the model is freed and rebuilt instead. A GGUF model's packed weights
# have none; a safetensors model's dense linears are nearly all of its weights.
MAX_OPAQUE_SHARE = 0.05


@dataclasses.dataclass
class Parked:
    """A parked model's memory: ``ranges`` (address, length in bytes; page-aligned, in
    file order), the open unlinked ``fd`` holding their bytes, and ``storages`` (kept
    alive until the wake so their memory is not reused)."""

    ranges: list[tuple[int, int]]
    fd: int
    storages: list[Any]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.ranges)


# Where parked files go; None: the start-up cache's root. Tests point it elsewhere.
PARK_DIR: Optional[str] = None


def park_dir() -> Optional[str]:
    """A directory on a disk for the parked file (the start-up cache's root, where the
    converted weights already live), or None when it is on tmpfs/ramfs or cannot be created."""
    from llmserve.model_loader.startup_cache import cache_root

    path = PARK_DIR or cache_root()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        logger.warning("sleep level 1: cannot create %s (%s): the weights are freed and rebuilt", path, e)
        return None
    if _fs_type(path) in ("tmpfs", "ramfs"):
        logger.warning("sleep level 1: %s is on a RAM filesystem: the weights are freed and rebuilt", path)
        return None
    return path


def _fs_type(path: str) -> Optional[str]:
    """The filesystem type of the mount holding ``path`` (``/proc/mounts``; None if unknown)."""
    path = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                        best, fstype = mnt, parts[2]
    except OSError:
        return None
    return fstype


def _anon_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's anonymous mappings (no file; ``[heap]`` included)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 5 or (len(parts) >= 6 and parts[5] == "[heap]"):
                lo, hi = parts[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def _tensors(obj: Any, seen: set[int], depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors reachable from a module's attributes: tensors themselves, and inside
    dataclasses, tuples, lists and dicts (the packed weights are dataclasses of tensors),
    down to a few levels."""
    if id(obj) in seen or depth > 4:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name, None), seen, depth + 1)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x, seen, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, seen, depth + 1)


def model_storages(model: torch.nn.Module) -> tuple[list[Any], int]:
    """(the distinct CPU storages (``UntypedStorage``) of ``model``'s tensors: parameters,
    buffers and tensors held in its modules' other attributes; the bytes of its tensors
    that have no storage of their own: oneDNN's opaque ``mkldnn`` weights, which the dense
    linears of a safetensors model are packed into, and sparse ones)."""
    seen: set[int] = set()
    storages: dict[int, Any] = {}
    opaque = 0
    tensors = (t for mod in model.modules() for v in vars(mod).values() for t in _tensors(v, seen))
    for t in tensors:  # (``seen`` holds ids of live objects only: a temporary's id can be reused)
        if t.device.type != "cpu":
            continue
        try:
            if t.is_sparse or t.is_mkldnn:
                raise NotImplementedError
            s = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # an opaque layout
            opaque += t.numel() * t.element_size()
            continue
        if s.nbytes():
            storages.setdefault(s.data_ptr(), s)
    return list(storages.values()), opaque


def _page_ranges(storages: list[Any]) -> list[tuple[int, int]]:
    """The whole pages inside the storages' memory that lie in anonymous mappings, merged
    and sorted: (address, length)."""
    spans = []
    for s in storages:
        lo = -(-s.data_ptr() // PAGE) * PAGE
        hi = (s.data_ptr() + s.nbytes()) // PAGE * PAGE
        if hi > lo:
            spans.append((lo, hi))
    anon = _anon_mappings()
    clipped = []
    for lo, hi in spans:
        for a, b in anon:
            if a < hi and lo < b:
                clipped.append((max(lo, a), min(hi, b)))
    clipped.sort()
    merged: list[list[int]] = []
    for lo, hi in clipped:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in merged]


def _madvise(addr: int, length: int, advice: int) -> None:
    from llmserve.ops.huge_pages import libc_madvise

    fn = libc_madvise()
    if fn is None or fn(addr, length, advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice}) failed")


def _start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to disk without waiting (``sync_file_range``),
    so they become clean page cache the OS can drop; best effort."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.sync_file_range(ctypes.c_int(fd), ctypes.c_int64(0), ctypes.c_int64(0),
                             ctypes.c_uint(_SYNC_FILE_RANGE_WRITE))
    except (OSError, AttributeError):
        pass


def _view(addr: int, length: int) -> memoryview:
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def park(model: torch.nn.Module, directory: str) -> Optional[Parked]:
    """Write ``model``'s tensor pages to an unlinked file in ``directory`` and free them
    (see the module docstring). Returns the Parked record, or None (nothing freed; the
    file removed) when this is not Linux, when more than MAX_OPAQUE_SHARE of the weight
    bytes are opaque (oneDNN-packed), or when writing fails (OSError logged: a full disk)."""
    if not os.path.exists("/proc/self/maps"):
        return None
    storages, opaque = model_storages(model)
    ranges = _page_ranges(storages)
    parkable = sum(n for _, n in ranges)
    if opaque > MAX_OPAQUE_SHARE * (opaque + parkable):
        logger.info("sleep level 1: %.0f MiB of the weights are oneDNN-packed and cannot be parked: the model "
                    "is freed and rebuilt on wake", opaque / 2**20)
        return None
    fd, path = tempfile.mkstemp(prefix="sleep-park-", dir=directory)
    os.unlink(path)  # the file goes with the fd (also when the process dies)
    try:
        for addr, length in ranges:
            for off in range(0, length, _CHUNK):
                view = _view(addr + off, min(_CHUNK, length - off))
                while len(view):
                    view = view[os.write(fd, view):]
        _start_writeback(fd)
        for addr, length in ranges:
            _madvise(addr, length, _MADV_DONTNEED)
    except OSError as e:
        os.close(fd)
        logger.warning("sleep level 1: could not park the weights in %s (%s): they are freed and rebuilt",
                       directory, e)
        return None
    return Parked(ranges, fd, storages)


def unpark(parked: Parked) -> None:
    """Read the parked pages back into their addresses and close the file. Raises
    OSError when the file cannot be read whole (the model's weights are then lost: the
    caller rebuilds the model)."""
    try:
        pos = 0
        for addr, length in parked.ranges:
            for off in range(0, length, _CHUNK):
                view = _view(addr + off, min(_CHUNK, length - off))
                while len(view):
                    n = os.preadv(parked.fd, [view], pos)
                    if n <= 0:
                        raise OSError(f"sleep level 1: the parked file ended at byte {pos}")
                    view, pos = view[n:], pos + n
    finally:
        os.close(parked.fd)
        parked.storages = []
