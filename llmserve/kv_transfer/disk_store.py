"""The on-disk KV block store behind ``SharedStorageConnector`` / ``OffloadingConnector``.

One file per full KV block, named by the block's prefix-cache hash (the chain hash of
``core/kv_cache_manager.py``: it identifies the whole prefix up to and including the
block), in a folder named after the *layout key* (model identity, dtype, quantization,
block size, layer/head shapes), so another model or dtype never even looks at them. Each
file: a fixed header (magic, version, the full 32-byte key digest, the block hash, its
parent block's hash (0 for a prompt's first block), the payload length, the payload's
XXH3-64) then the payload (the block's K and V of every layer). The parent hash lets a
restarted engine rebuild whole chains from the files alone (``recent_chains``). A file whose header or checksum does not match is never loaded: ``read_block``
returns None and removes it (so the block is written again later).

Beside each block file, ``<hash>.tok`` holds the block's token ids (``block_size``
little-endian uint32, written before the block file): a restarted engine that publishes
KV cache events announces the blocks it restores with their tokens, as every other
BlockStored carries them (``read_tokens`` checks them against the chain hash). The block
file's own format is unchanged; a block file without its tokens (written before them) is
still loaded on request, but not restored where events are on.

Writes go to a temporary file in the same folder, then ``os.replace`` (atomic on POSIX):
a crash leaves either the old state or a whole file, and a torn temporary file is never
read (it does not end in ``.kv``). ``BlockWriter`` writes on its own thread, off the
engine's step loop, and keeps the folder under a byte bound by evicting the least
recently used files (a load bumps a file's mtime, so the order survives restarts).

No torch here: payloads are bytes-like objects (the worker's connector turns tensors into
them). The same format serves vLLM's two names for this (``SharedStorageConnector``:
``kv_connector_extra_config.shared_storage_path``; ``OffloadingConnector`` /
``--kv-offloading-backend native --kv-offloading-size``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import secrets
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import xxhash

logger = logging.getLogger(__name__)

MAGIC = b"LLMSKV\x00\x01"
# 1: CRC-32; 2: no parent hash. Older files are "not of this version" (or of the wrong
# size): skipped and removed when met, and written again as their prompts come back.
VERSION = 3
# magic, version, key digest, block hash, parent block hash, payload bytes, XXH3-64 of the payload
_HEADER = struct.Struct("<8sI32sQQQQ")
_CHECKSUM_FIELD = 6
HEADER_SIZE = _HEADER.size
PREFIX_SIZE = struct.calcsize("<8sI32s")  # magic, version, key (44 bytes): the same in every file of a layout
SUFFIX = ".kv"
TOKENS_SUFFIX = ".tok"


def layout_key(fields: dict[str, Any]) -> bytes:
    """sha256 digest (32 bytes) of the layout fields (JSON, sorted keys): model identity,
    dtype, quantization, block_size, per-layer shapes. Two engines share blocks only when
    every field is equal."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).digest()


def block_dir(root: str, key: bytes) -> str:
    """The folder of one layout key under ``root`` (created if missing)."""
    path = os.path.join(root, key.hex()[:16])
    os.makedirs(path, exist_ok=True)
    return path


def block_path(folder: str, block_hash: int) -> str:
    return os.path.join(folder, f"{block_hash:016x}{SUFFIX}")


def tokens_path(folder: str, block_hash: int) -> str:
    """The token-id file beside block ``block_hash``'s file (see the module docstring)."""
    return os.path.join(folder, f"{block_hash:016x}{TOKENS_SUFFIX}")


def read_tokens(folder: str, block_hash: int, parent_hash: int, block_size: int) -> Optional[list[int]]:
    """Block ``block_hash``'s token ids from its token file, or None when the file is
    missing, of the wrong size, or its tokens do not hash (with ``parent_hash``, 0 for a
    first block; no extra keys: adapters' blocks are never kept) to ``block_hash``."""
    from llmserve.core.kv_cache_manager import hash_block_tokens

    try:
        with open(tokens_path(folder, block_hash), "rb") as f:
            data = f.read(4 * block_size + 1)
    except OSError:
        return None
    if len(data) != 4 * block_size:
        return None
    tokens = list(struct.unpack(f"<{block_size}I", data))
    return tokens if hash_block_tokens(parent_hash, tokens) == block_hash else None


def encode_header(key: bytes, block_hash: int, parent_hash: int, payload: Any) -> bytes:
    """The header for ``payload`` (bytes-like) of block ``block_hash`` whose parent in the
    chain is ``parent_hash`` (0: none): its length and XXH3-64 checksum."""
    mv = memoryview(payload).cast("B")
    return _HEADER.pack(MAGIC, VERSION, key, block_hash, parent_hash, mv.nbytes, xxhash.xxh3_64_intdigest(mv))


def header_prefix(key: bytes) -> bytes:
    """The bytes every valid header of layout ``key`` starts with (magic, version, key): what
    the C++ reader (``llmserve/ops/tier_io.py``) compares; the fields after them it checks
    itself (block hash, payload bytes, XXH3-64 at the offsets of ``_HEADER``)."""
    return _HEADER.pack(MAGIC, VERSION, key, 0, 0, 0, 0)[:PREFIX_SIZE]


def drop_invalid(folder: str, block_hash: int, why: str) -> None:
    """Log and remove block ``block_hash``'s file, found invalid for ``why`` (it is written
    again when its prompt is computed again)."""
    path = block_path(folder, block_hash)
    logger.warning("KV tier: ignoring %s (%s); it is removed", path, why)
    _unlink_block(path)


def read_block(folder: str, key: bytes, block_hash: int, out: memoryview) -> bool:
    """Read block ``block_hash``'s payload into ``out`` (a writable buffer of exactly the
    payload size this layout has); True when it is there and valid (see ``read_chain``)."""
    fds = open_chain(folder, [block_hash])
    return read_chain(folder, key, [block_hash], fds, out, out.nbytes) == 1


def open_chain(folder: str, block_hashes: list[int]) -> list[int]:
    """Open the files of ``block_hashes`` from the first up to the first missing one;
    returns their file descriptors (the caller hands them to ``read_chain``, which closes
    them). Opening is the existence check: one syscall per block, no ``stat``."""
    fds: list[int] = []
    for h in block_hashes:
        try:
            fds.append(os.open(block_path(folder, h), os.O_RDONLY))
        except OSError:
            break
    return fds


def count_chain(folder: str, block_hashes: list[int], nbytes: int,
                native: Optional[Callable[[str, list[int], int], int]] = None) -> int:
    """How many of ``block_hashes``, from the first, have a file of the size a header and an
    ``nbytes`` payload make: one ``stat`` per block (~1.5 us), the scheduler's check before
    it counts blocks as hits (``read_chain_into`` verifies header and checksum when they are
    loaded). The first file of another size (a torn write) is logged and removed.
    ``native``: the C++ count (``tier_io.count_chain``: one ``fstatat`` per block, no GIL;
    249 files in ~0.5 ms against ~1.5 ms here, at load ~5 on 2 cores)."""
    if native is not None:
        n = native(folder, block_hashes, HEADER_SIZE + nbytes)
        if n >= 0:
            return n
        n = -n - 1
        drop_invalid(folder, block_hashes[n], "truncated or of the wrong size")
        return n
    for i, h in enumerate(block_hashes):
        path = block_path(folder, h)
        try:
            size = os.stat(path).st_size
        except OSError:
            return i
        if size != HEADER_SIZE + nbytes:
            drop_invalid(folder, h, "truncated or of the wrong size")
            return i
    return len(block_hashes)


def read_chain(folder: str, key: bytes, block_hashes: list[int], fds: list[int], out: memoryview,
               nbytes: int, touch: bool = True) -> int:
    """Read the opened blocks (``fds`` from ``open_chain``, in chain order) into ``out``
    (writable, ``len(fds) * nbytes`` bytes: payloads back to back); see ``read_chain_into``."""
    return read_chain_into(folder, key, block_hashes, fds, lambda i: [out[i * nbytes:(i + 1) * nbytes]], touch)


def read_chain_into(folder: str, key: bytes, block_hashes: list[int], fds: list[int],
                    pieces_of: Callable[[int], list[memoryview]], touch: bool = True) -> int:
    """Read the opened blocks (``fds`` from ``open_chain``, in chain order) and close every
    fd. Block ``i``'s payload goes into ``pieces_of(i)``: writable buffers that hold it in
    file order (one region of a staging buffer, or the block's K and V slots of every
    layer in the KV cache). Returns how many, from the first, are valid; the first invalid
    one (torn, corrupted, another layout key or hash, the wrong size) is logged and
    removed, and nothing after it counts (its pieces hold garbage). Valid files get their
    mtime bumped (LRU order for ``BlockWriter``) unless ``touch`` is False (a restore at
    start-up is not a use: bumping would reverse the recency order it restores by)."""
    header, extra = bytearray(HEADER_SIZE), bytearray(1)
    n = 0
    try:
        for i, fd in enumerate(fds):
            why = _read_one(fd, header, pieces_of(i), extra, key, block_hashes[i])
            if why is not None:
                drop_invalid(folder, block_hashes[i], why)
                break
            if touch:
                _touch(fd)
            n += 1
    finally:
        for fd in fds:
            os.close(fd)
    return n


def _read_one(fd: int, header: bytearray, pieces: list[memoryview], extra: bytearray, key: bytes,
              block_hash: int) -> Optional[str]:
    """Read one opened block file (header, payload into ``pieces``, and one byte too many
    to catch a longer file) with one ``readv``; why it may not be loaded, or None. The
    checksum runs piece by piece right after the read, while the payload (~360 KiB for
    SmolLM2) is still in the CPU cache."""
    nbytes = sum(p.nbytes for p in pieces)
    try:
        got = os.readv(fd, [header, *pieces, extra])
    except OSError as e:
        return f"unreadable: {e}"
    why = _invalid_header(bytes(header[:got]), key, block_hash, nbytes)
    if why is None and got != HEADER_SIZE + nbytes:
        why = "truncated or of the wrong size"
    if why is None and _checksum(pieces) != _HEADER.unpack_from(header)[_CHECKSUM_FIELD]:
        why = "checksum mismatch"
    return why


def read_parent(folder: str, key: bytes, block_hash: int, nbytes: int) -> Optional[int]:
    """The parent hash in block ``block_hash``'s file header (0: a first block), or None
    when the file is gone or its header is not one of ``key``'s ``nbytes`` blocks (the
    payload is checked when the block is loaded)."""
    try:
        fd = os.open(block_path(folder, block_hash), os.O_RDONLY)
    except OSError:
        return None
    try:
        header = os.pread(fd, HEADER_SIZE, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if _invalid_header(header, key, block_hash, nbytes) is not None:
        return None
    return _HEADER.unpack_from(header)[4]


def recent_chains(folder: str, key: bytes, nbytes: int, max_blocks: int) -> list[tuple[int, list[int]]]:
    """The tier's most recently used prefixes, for a restore at start-up: at most
    ``max_blocks`` blocks, each with every ancestor (a block is only useful after its
    parents). Files are taken newest mtime first (written or last loaded; a restore does
    not bump them); from each one not taken yet the chain is followed up through the
    parent hashes in the headers to a first block, and the blocks not taken yet are taken,
    first block first (only the first ones when the bound cuts the chain). A chain with a
    missing, torn or foreign ancestor (a header that does not check) is skipped. Files of
    the wrong size are removed, with a warning.

    Returns pieces ``(anchor, hashes)``: ``hashes`` in chain order; ``anchor`` the parent
    of ``hashes[0]``, 0 or the last hash of an earlier piece. Costs one ``stat`` per file
    (``scandir``) and one header read (~10 us) per block looked at, at most
    ``4 * max_blocks + 1024`` of them."""
    files: dict[int, int] = {}  # hash -> mtime (ns), files of the right size
    torn: list[str] = []  # files of the wrong size: removed (a zero-length one stayed forever)
    try:
        entries = list(os.scandir(folder))
    except OSError as e:  # removed or unreadable: nothing to restore
        logger.error("KV tier: cannot list %s (%s); nothing restored", folder, e)
        return []
    for entry in entries:
        name = entry.name
        if len(name) != 16 + len(SUFFIX) or not name.endswith(SUFFIX):
            continue
        try:
            h = int(name[:16], 16)
            st = entry.stat()
        except (ValueError, OSError):
            continue
        if st.st_size == HEADER_SIZE + nbytes:
            files[h] = st.st_mtime_ns
        else:  # written whole or not at all (os.replace), and the folder is one layout's: damaged
            torn.append(entry.path)
    for path in torn:
        _unlink_block(path)
    if torn:
        logger.warning("KV tier: removed %d block file(s) of the wrong size (truncated or damaged) in %s",
                       len(torn), folder)
    parents: dict[int, Optional[int]] = {}
    taken: set[int] = set()
    dead: set[int] = set()  # blocks whose chain does not reach a first block
    pieces: list[tuple[int, list[int]]] = []
    budget, reads_left = max_blocks, 4 * max_blocks + 1024
    for h in sorted(files, key=files.__getitem__, reverse=True):
        if budget <= 0 or reads_left <= 0:
            break
        path: list[int] = []
        on_path: set[int] = set()  # a header naming a descendant as parent must not loop
        x = h
        while x != 0 and x not in taken:
            if x in dead or x not in files or x in on_path or reads_left <= 0:
                dead.update(path)
                path = []
                break
            if x not in parents:
                parents[x] = read_parent(folder, key, x, nbytes)
                reads_left -= 1
            if parents[x] is None:
                dead.update(path + [x])
                path = []
                break
            path.append(x)
            on_path.add(x)
            x = parents[x]
        if not path:
            continue
        piece = path[::-1][:budget]
        taken.update(piece)
        budget -= len(piece)
        pieces.append((parents[piece[0]], piece))
    return pieces


def _checksum(pieces: list[memoryview]) -> int:
    """XXH3-64 of the pieces' bytes, concatenated (the streaming digest equals the one-shot one)."""
    if len(pieces) == 1:
        return xxhash.xxh3_64_intdigest(pieces[0])
    h = xxhash.xxh3_64()
    for p in pieces:
        h.update(p)
    return h.intdigest()


def _touch(fd: int) -> None:
    try:
        os.utime(fd)
    except OSError:
        pass


def _invalid_header(header: bytes, key: bytes, block_hash: int, nbytes: int) -> Optional[str]:
    """Why a file starting with ``header`` may not be loaded as a ``nbytes`` payload of
    block ``block_hash`` under ``key``, or None."""
    if len(header) < HEADER_SIZE:
        return "shorter than its header"
    magic, version, fkey, fhash, _, fbytes, _ = _HEADER.unpack_from(header)
    if magic != MAGIC or version != VERSION:
        return "not a KV block file of this version"
    if fkey != key:
        return "written by another model, dtype or layout"
    if fhash != block_hash:
        return "holds another block"
    if fbytes != nbytes:
        return "truncated or of the wrong size"
    return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _unlink_block(path: str) -> None:
    """Remove a block file (``path``) and its token file."""
    _unlink(path)
    _unlink(path[:-len(SUFFIX)] + TOKENS_SUFFIX)


_TOUCH = object()  # BlockWriter queue item tag: an mtime bump (``touch``), not a block


@dataclass
class WriterStats:
    """Cumulative counters of a BlockWriter: blocks and bytes written, blocks skipped
    (already on disk), blocks evicted, write errors (OSError: disk full, read-only...)."""

    blocks_stored: int = 0
    bytes_stored: int = 0
    blocks_present: int = 0
    blocks_evicted: int = 0
    write_errors: int = 0


class BlockWriter:
    """Writes blocks on a daemon thread, bounded to ``max_bytes`` (None: no bound) with LRU
    eviction by mtime. ``put`` never blocks the caller on I/O; ``flush`` waits until the
    queue is written; ``close`` flushes and stops the thread.

    A write that raises OSError (a full disk) is logged once per writer and counted; the
    files already written stay and keep being served.
    """

    def __init__(self, folder: str, key: bytes, max_bytes: Optional[int]) -> None:
        self.folder = folder
        self.key = key
        self.max_bytes = max_bytes
        self.stats = WriterStats()
        self._lru: OrderedDict[str, tuple[float, int]] = OrderedDict()  # name -> (mtime, bytes)
        self._total = 0
        self._warned = False
        # Temporary file names carry the process id and a random tag: two engines on one
        # folder (containers on a shared volume often both run as pid 1) never write to
        # the same temporary file.
        self._tmp_tag = f"{os.getpid()}.{secrets.token_hex(4)}"
        self._scan()
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()  # blocks, touches (_TOUCH), None: stop
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()

    # A temporary file older than this is a crashed write's leftover; a younger one may be
    # another engine's write in progress (several servers on one tier folder).
    STALE_TMP_SECONDS = 600.0

    def _scan(self) -> None:
        """Index the files already in the folder (a previous run's, or another engine's on
        the same folder), oldest first; remove leftover temporary files of crashed writes.
        A file that another engine removes meanwhile is skipped, not an error."""
        found = []
        stale = time.time() - self.STALE_TMP_SECONDS
        try:
            entries = list(os.scandir(self.folder))
        except OSError as e:
            logger.error("KV tier: cannot list %s (%s); starting with an empty index", self.folder, e)
            entries = []
        for entry in entries:
            try:
                st = entry.stat()
            except OSError:  # removed by another engine's eviction since the listing
                continue
            if entry.name.endswith(".tmp"):
                if st.st_mtime < stale:
                    _unlink(entry.path)
            elif entry.name.endswith(SUFFIX):
                found.append((st.st_mtime, entry.name, st.st_size))
        for mtime, name, size in sorted(found):
            self._lru[name] = (mtime, size)
            self._total += size

    @property
    def total_bytes(self) -> int:
        return self._total

    def put(self, block_hash: int, parent_hash: int, payload: Any, tokens: Optional[list[int]] = None) -> None:
        """Queue one block (its chain hash, its parent's, 0 for a first block; ``payload``:
        a bytes-like object the caller no longer changes; ``tokens``: its token ids, kept
        in its token file when given)."""
        self._queue.put((block_hash, parent_hash, payload, tokens))

    def touch(self, block_hashes: list[int], native: Optional[Callable[[str, list[int]], None]] = None) -> None:
        """Queue an mtime bump (LRU: loaded, so recently used) of the files of
        ``block_hashes``, done on the writer's thread, in order with the writes and
        evictions: off the request path (~2 us a file, 0.5 ms per 249 in a load's loop).
        ``native``: ``tier_io.touch`` (no GIL), else ``os.utime`` per file."""
        self._queue.put((_TOUCH, block_hashes, native))

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if item[0] is _TOUCH:
                    self._touch(*item[1:])
                else:
                    self._write(*item)
            except Exception:  # never let one block stop the writer
                logger.exception("KV tier: writing a block failed")
            finally:
                self._queue.task_done()

    def _touch(self, block_hashes: list[int], native: Optional[Callable[[str, list[int]], None]]) -> None:
        if native is not None:
            native(self.folder, block_hashes)
            return
        for h in block_hashes:
            try:
                os.utime(block_path(self.folder, h))
            except OSError:  # evicted meanwhile
                pass

    def _write(self, block_hash: int, parent_hash: int, payload: Any, tokens: Optional[list[int]] = None) -> None:
        path = block_path(self.folder, block_hash)
        name = os.path.basename(path)
        if os.path.exists(path):
            self.stats.blocks_present += 1
            if tokens is not None and not os.path.exists(tokens_path(self.folder, block_hash)):
                try:  # a block file written before token files
                    self._write_tokens(block_hash, tokens)
                except OSError:
                    pass
            return
        header = encode_header(self.key, block_hash, parent_hash, payload)
        size = len(header) + memoryview(payload).nbytes
        if self.max_bytes is not None and (size > self.max_bytes or not self._make_room(size)):
            return
        tmp = f"{path}.{self._tmp_tag}.tmp"
        try:
            if tokens is not None:  # first: a block file written by this version has its tokens
                os.makedirs(self.folder, exist_ok=True)
                self._write_tokens(block_hash, tokens)
            try:
                self._write_file(tmp, path, header, payload)
            except FileNotFoundError:  # the folder was removed (an operator clearing the cache): made again
                os.makedirs(self.folder, exist_ok=True)
                self._write_file(tmp, path, header, payload)
        except OSError as e:
            _unlink(tmp)
            self.stats.write_errors += 1
            if not self._warned:
                self._warned = True
                logger.error("KV tier: cannot write to %s (%s); serving the blocks already there, "
                             "new blocks are not kept (logged once)", self.folder, e)
            return
        self._lru[name] = (time.time(), size)
        self._total += size
        self.stats.blocks_stored += 1
        self.stats.bytes_stored += size

    def _write_tokens(self, block_hash: int, tokens: list[int]) -> None:
        """Write block ``block_hash``'s token file (atomically, as the block files)."""
        path = tokens_path(self.folder, block_hash)
        tmp = f"{path}.{self._tmp_tag}.tmp"
        try:
            self._write_file(tmp, path, struct.pack(f"<{len(tokens)}I", *tokens), b"")
        except OSError:
            _unlink(tmp)
            raise

    @staticmethod
    def _write_file(tmp: str, path: str, header: bytes, payload: Any) -> None:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)

    def _make_room(self, size: int) -> bool:
        """Evict least recently used files until ``size`` more bytes fit. A file whose mtime
        moved since it was indexed (a load touched it) goes to the back instead."""
        checked = 0
        while self._total + size > self.max_bytes and self._lru:
            name, (mtime, nbytes) = next(iter(self._lru.items()))
            path = os.path.join(self.folder, name)
            try:
                now = os.stat(path).st_mtime
            except OSError:
                now = None
            if now is not None and now > mtime and checked < len(self._lru):
                checked += 1
                self._lru.move_to_end(name)
                self._lru[name] = (now, nbytes)
                continue
            del self._lru[name]
            self._total -= nbytes
            _unlink_block(path)
            self.stats.blocks_evicted += 1
        return self._total + size <= self.max_bytes
