"""``SharedStorageConnector`` and ``OffloadingConnector``: a persistent disk tier under
the in-RAM prefix cache (vLLM's connector names; the file format is
``kv_transfer/disk_store.py``).

Saving: every full prompt block computed by a step is copied out of the paged cache after
the forward and queued to a writer thread (``BlockWriter``), content-addressed by its
prefix-cache chain hash. Loading: when a request is admitted, the scheduler side counts
the blocks past its in-RAM prefix-cache hit that are on disk (in chain order, up to the
first missing one or one of the wrong size: one ``stat`` each); the worker reads them
straight into the request's newly allocated blocks before the step's forward (one
``readv`` per file into the block's K and V slots of every layer) and verifies each
(header, XXH3-64 checksum). A block that fails there is reported with
``get_block_ids_with_load_errors`` (vLLM's name); the scheduler moves the request back to
its first failed block and computes the rest again (vLLM's "recompute" policy), and the
step saves nothing. The prefill computes only what was not loaded. Loaded blocks enter
the RAM prefix cache like computed ones.

Only requests that use the prefix cache qualify (no prompt logprobs, no LoRA adapter,
no pooling, no encoder inputs): the chain hash of those alone identifies their KV.

An engine started over an existing tier restores its most recently used chains into the
RAM prefix cache first (``tier_restore.py``), so a prompt repeated after a restart is a
RAM hit.

Configuration (``kv_transfer_config``):
  ``SharedStorageConnector``: ``kv_connector_extra_config.shared_storage_path`` (the
  folder; vLLM's default ``local_storage``), optional ``kv_offloading_size`` (GiB bound;
  unbounded without it).
  ``OffloadingConnector``: ``kv_connector_extra_config.kv_offloading_size`` (GiB, set by
  ``--kv-offloading-size``), optional ``shared_storage_path`` (default
  ``$XDG_CACHE_HOME/llmserve/kv_offload``).
  Both: ``kv_connector_extra_config.restore_on_start``: true (default: up to half the KV
  cache's blocks), false or 0 (off), or the share of the KV cache's blocks in (0, 1].
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from llmserve.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from llmserve.kv_transfer import disk_store
from llmserve.kv_transfer.disk_store import (BlockWriter, block_dir, count_chain, drop_invalid, header_prefix, layout_key,
                                             open_chain, read_chain, read_chain_into, read_tokens, recent_chains)

if TYPE_CHECKING:
    from llmserve.core.request import Request
    from llmserve.core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)

_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


class SharedStorageConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker: ``loads`` (per admitted request: the block ids it
    was given and the chain hashes of the blocks on disk that go there, in order) to read
    into the cache before the forward; ``saves`` (block id, chain hash, parent's chain hash
    or 0, and optionally the block's token ids, kept beside it for KV events after a
    restore) to copy out after it. ``restore``: the loads are a tier warm-up
    (``tier_restore.py``; no forward, and the files' mtimes are left as they are). Plain
    ints, so a worker in another process gets it pickled as is."""

    def __init__(self, loads: list[tuple[list[int], list[int]]], saves: list[tuple],
                 restore: bool = False) -> None:
        self.loads = loads
        self.saves = saves
        self.restore = restore


def _weights_identity(path: str) -> list:
    """(name, bytes, mtime seconds) of the model's weight file(s): a checkpoint rewritten in
    place gets another layout key."""
    def one(p: str) -> tuple:
        st = os.stat(p)
        return os.path.basename(p), st.st_size, int(st.st_mtime)
    try:
        if os.path.isdir(path):
            return [one(os.path.join(path, n)) for n in sorted(os.listdir(path)) if n.endswith(_WEIGHT_SUFFIXES)]
        return [one(path)]
    except OSError:
        return []


def layout_fields(vllm_config: Any) -> dict[str, Any]:
    """What must match for two engines to share KV blocks: model identity (name, weight
    files), dtype, quantization, block size, layer/head shapes, tensor-parallel size, and the
    KV cache's dtype where it is not the model's (left out otherwise, so blocks stored before
    ``--kv-cache-dtype`` existed keep their key)."""
    mc = vllm_config.model_config
    fields = {"model": mc.model, "weights": _weights_identity(mc.model_path), "dtype": mc.dtype,
              "quantization": mc.quantization, "block_size": vllm_config.cache_config.block_size,
              "num_layers": mc.num_layers, "num_kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim,
              "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size}
    kv_dtype = vllm_config.cache_config.kv_dtype(mc)
    if kv_dtype != mc.dtype:
        fields["kv_cache_dtype"] = kv_dtype
    return fields


def _one_view(kv_caches: list[Any]) -> Any:
    """The per-layer caches (each contiguous ``[2, num_blocks, block_size, heads, head_dim]``)
    as one ``[L, 2, num_blocks, block elements]`` view when they are equally spaced slices
    of one buffer (the model runner's layout), else None."""
    import torch

    kv0 = kv_caches[0]
    step = kv0.numel()
    if not all(kv.is_contiguous() and kv.shape == kv0.shape and kv.untyped_storage().data_ptr()
               == kv0.untyped_storage().data_ptr() and kv.storage_offset() == kv0.storage_offset() + i * step
               for i, kv in enumerate(kv_caches)):
        return None
    per_block = step // (2 * kv0.shape[1])
    return torch.as_strided(kv0, (len(kv_caches), 2, kv0.shape[1], per_block),
                            (step, kv0.shape[1] * per_block, per_block, 1))


def _cache_bytes(kv_all: Any) -> Any:
    """A CPU cache as one ``[L, 2, num_blocks, block elements]`` view (``_one_view``, one
    contiguous buffer) as a 1-d uint8 tensor over the same memory: ``2 L`` equal regions
    (layer and K/V, the order of a block file's payload), block ``b``'s slot bytes
    ``[b * slot, (b + 1) * slot)`` of each."""
    import torch

    return torch.as_strided(kv_all, (kv_all.numel(),), (1,)).view(torch.uint8)


def _slot_regions(kv_all: Any) -> Optional[list[memoryview]]:
    """For a CPU cache as one ``[L, 2, num_blocks, block elements]`` view (``_one_view``):
    one writable byte view per layer and K/V over all its blocks (``_cache_bytes``), so a
    file is read straight into the cache; None for a cache elsewhere (GPU), which takes the
    staged path."""
    if kv_all is None or kv_all.device.type != "cpu":
        return None
    mv = memoryview(_cache_bytes(kv_all).numpy()).cast("B")
    region = mv.nbytes // (kv_all.shape[0] * 2)
    return [mv[i * region:(i + 1) * region] for i in range(kv_all.shape[0] * 2)]


def _native_reader(kv_all: Any, block_nbytes: int) -> Optional[tuple[Any, Any]]:
    """``(tier_io module, the cache's bytes)`` for the C++ reader (``llmserve/ops/tier_io.py``):
    a CPU cache in one buffer, the module built, reading this file format, and payloads
    over 240 bytes; else None (the Python reads of ``disk_store``)."""
    from llmserve.ops.tier_io import MIN_PAYLOAD, get_tier_io

    if kv_all is None or kv_all.device.type != "cpu" or block_nbytes < MIN_PAYLOAD:
        return None
    ops = get_tier_io()
    if ops is None or ops.FORMAT_VERSION != disk_store.VERSION or ops.HEADER_SIZE != disk_store.HEADER_SIZE:
        return None
    return ops, _cache_bytes(kv_all)


def _native_counter() -> Optional[Any]:
    """The C++ count of a chain's files on disk (``tier_io.count_chain``), or None where the
    module is not built (``disk_store.count_chain`` stats in Python)."""
    from llmserve.ops.tier_io import get_tier_io

    ops = get_tier_io()
    return None if ops is None else ops.count_chain


def _copy_into(kv_all: Any, block_ids: list[int], data: Any) -> None:
    """``kv_all[:, :, block_ids] = data`` (``[L, 2, n, block elements]``). Fresh allocations
    are mostly runs of consecutive block ids; a run is one slice ``copy_`` (60 contiguous
    pieces for SmolLM2), which copied 249 blocks (92 MB) in ~3 ms against ~8 ms for
    ``index_copy_`` (6 KiB pieces). Many short runs go through ``index_copy_``."""
    import torch

    runs, lo = [], 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            runs.append((lo, i))
            lo = i
    if len(runs) > 8:
        kv_all.index_copy_(2, torch.tensor(block_ids, device=kv_all.device), data)
        return
    for lo, hi in runs:
        kv_all[:, :, block_ids[lo]:block_ids[lo] + hi - lo].copy_(data[:, :, lo:hi])


def _eligible(request: "Request") -> bool:
    return (request.use_prefix_cache and getattr(request, "lora_request", None) is None
            and request.pooling_params is None and request.encoder_inputs is None)


class SharedStorageConnector(KVConnectorBase_V1):
    """vLLM's disk connector: KV blocks of prompts kept as files under
    ``kv_connector_extra_config.shared_storage_path``, reused across requests, restarts
    and engines of the same model layout. See the module docstring."""

    DEFAULT_PATH = "local_storage"  # vLLM's SharedStorageConnector default

    def __init__(self, vllm_config: Any, role: KVConnectorRole) -> None:
        super().__init__(vllm_config, role)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.root = self._storage_path(extra)
        self.max_bytes = self._max_bytes(extra)
        mc = vllm_config.model_config
        self.block_size = vllm_config.cache_config.block_size
        self.block_nbytes = (2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim
                             * _ELEMENT_BYTES.get(vllm_config.cache_config.kv_dtype(mc), 4))
        self.key = layout_key(layout_fields(vllm_config))
        role_name = vllm_config.kv_transfer_config.kv_role
        self.folder = self._layout_folder(role)
        self.can_load = self.folder is not None and role_name in ("kv_consumer", "kv_both")
        self.can_save = self.folder is not None and role_name in ("kv_producer", "kv_both")
        # scheduler side: the last lookup (request id, first block, hashes found on disk),
        # loads of the step being built, counters since get_stats
        self._matched: Optional[tuple[str, int, list[int]]] = None
        self._step_loads: list[tuple[list[int], list[int]]] = []
        self._stats = self._new_stats()
        self._count_native: Optional[Any] = None  # the C++ count of files on disk (tier_io), if built
        # share of the KV pool a restarted engine fills from the tier (tier_restore.py)
        self.restore_share = self._restore_share(extra) if self.can_load else 0.0
        # worker side
        self.kv_caches: list[Any] = []
        self._kv_all: Any = None  # all layers as one [L, 2, num_blocks, block elements] view, or None
        self._slots: Optional[list[memoryview]] = None  # CPU: per layer and K/V, all blocks (_slot_regions)
        self._native: Optional[tuple[Any, Any]] = None  # the C++ reader and the cache's bytes (_native_reader)
        self._prefix = header_prefix(self.key)
        self._load_errors: set[int] = set()  # block ids whose load failed this step
        self._step_failed = False  # this step's saves are skipped (see start_load_kv)
        self._pool: Any = None  # the second load thread (_load_split), made on the first load
        self.writer: Optional[BlockWriter] = None
        self._layer_saves: dict[int, Any] = {}
        if role == KVConnectorRole.SCHEDULER and self.can_load:  # built at start (cached per build key), not on a request
            self._count_native = _native_counter()
        if role == KVConnectorRole.SCHEDULER and self.folder is not None:  # once per engine, not once per half
            logger.info("KV tier (%s): %s%s", type(self).__name__, self.folder,
                        "" if self.max_bytes is None else f", at most {self.max_bytes / 2**30:.2f} GiB")

    def _layout_folder(self, role: KVConnectorRole) -> Optional[str]:
        """This layout's folder under the tier's root (``disk_store.block_dir``), or None
        when it cannot be made: a read-only or full tier shared by a fleet, written by
        another model or dtype, or mounted read-only before this layout wrote there. The
        engine then runs with a cold cache (nothing loaded or saved) and says so once,
        instead of dying after the model loaded."""
        try:
            return block_dir(self.root, self.key)
        except OSError as e:
            if role == KVConnectorRole.SCHEDULER:
                logger.error("KV tier: cannot create this model's folder under %s (%s); the tier is off for this "
                             "engine (a cold cache: nothing is loaded from or saved to disk)",
                             self.root, e.strerror or e)
            return None

    @staticmethod
    def _make_folder(path: str) -> None:
        """Create the tier's folder now, so a path that cannot hold one (a file, /proc, no
        permission) is a one-line config error, not an engine that dies after loading the
        model (fresh-user trial: two tracebacks from os.makedirs in the engine).

        Raises:
            ValueError: naming ``kv_connector_extra_config.shared_storage_path``."""
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            why = "it is not a directory" if isinstance(e, FileExistsError) else (e.strerror or str(e))
            raise ValueError(f"kv_connector_extra_config.shared_storage_path {path!r} cannot be used as the "
                             f"KV tier's folder: {why}") from None

    @classmethod
    def _storage_path(cls, extra: dict) -> str:
        path = extra.get("shared_storage_path") or cls.DEFAULT_PATH
        if not isinstance(path, str):
            raise ValueError(f"kv_connector_extra_config.shared_storage_path must be a path, got {path!r}")
        return os.path.abspath(os.path.expanduser(path))

    @staticmethod
    def _max_bytes(extra: dict) -> Optional[int]:
        gib = extra.get("kv_offloading_size")
        if gib is None:
            return None
        try:
            value = float(gib)
        except (TypeError, ValueError):
            value = -1.0
        if not value > 0:
            raise ValueError(f"kv_connector_extra_config.kv_offloading_size must be a positive number of "
                             f"GiB, got {gib!r}")
        return int(value * (1 << 30))

    # restore_on_start true: this share of the KV pool's blocks at most.
    DEFAULT_RESTORE_SHARE = 0.5

    @classmethod
    def _restore_share(cls, extra: dict) -> float:
        """``kv_connector_extra_config.restore_on_start``: true (default: up to half the KV
        pool), false or 0 (off), or the share of the KV pool's blocks in (0, 1]."""
        value = extra.get("restore_on_start", True)
        if isinstance(value, bool):
            return cls.DEFAULT_RESTORE_SHARE if value else 0.0
        if isinstance(value, (int, float)) and 0 <= value <= 1:
            return float(value)
        raise ValueError(f"kv_connector_extra_config.restore_on_start must be true, false or a share of the "
                         f"KV cache's blocks between 0 and 1, got {value!r}")

    @classmethod
    def check_config(cls, kv_transfer_config: Any) -> None:
        extra = dict(kv_transfer_config.kv_connector_extra_config or {})
        cls._make_folder(cls._storage_path(extra))
        cls._max_bytes(extra)
        cls._restore_share(extra)

    # ---- scheduler side ----------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Blocks past the RAM hit found on disk, in chain order (files of the right size:
        the worker verifies them as it loads them). At least one prompt token is left to
        compute."""
        if not self.can_load or not _eligible(request):
            return 0, False
        start = num_computed_tokens // self.block_size
        stop = min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)
        m = self._matched
        if m is None or m[0] != request.request_id or m[1] != start:
            hashes = request.block_hashes[start:max(start, stop)]
            found = count_chain(self.folder, hashes, self.block_nbytes, self._count_native)
            self._matched = m = (request.request_id, start, hashes[:found])
        return len(m[2]) * self.block_size, False

    # Files opened at once by a load (a 32k-token prompt is 2,000 blocks; fd limits are ~1,024).
    OPEN_BATCH = 256

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        m, self._matched = self._matched, None
        if _eligible(request):
            self._stats["queries"] += request.num_tokens
            self._stats["hits"] += num_external_tokens
        n = num_external_tokens // self.block_size
        if not n or m is None or m[0] != request.request_id:
            return
        self._stats["bytes_loaded"] += n * self.block_nbytes
        self._step_loads.append((list(block_ids[:n]), list(m[2][:n])))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> SharedStorageConnectorMetadata:
        """Loads gathered at admission; saves: the full prompt blocks each scheduled
        request completes this step (the writer skips those already on disk)."""
        saves: list[tuple[int, int, int, list[int]]] = []
        bs = self.block_size
        for s in scheduler_output.scheduled if self.can_save else ():
            req = s.request
            if not _eligible(req):
                continue
            end = min(s.num_computed_tokens + s.num_scheduled_tokens, req.num_prompt_tokens) // self.block_size
            end = min(end, len(req.block_hashes), len(s.block_ids))
            hashes = req.block_hashes
            for i in range(s.num_computed_tokens // self.block_size, end):
                saves.append((s.block_ids[i], hashes[i], hashes[i - 1] if i else 0,
                              list(req.all_token_ids[i * bs:(i + 1) * bs])))
        meta = SharedStorageConnectorMetadata(self._step_loads, saves)
        self._step_loads, self._matched = [], None
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        if self._matched is not None and self._matched[0] == request.request_id:
            self._matched = None
        return False, None

    def get_stats(self) -> dict[str, int]:
        """Since the last call: prompt tokens looked up (``queries``) and found on disk
        (``hits``), bytes loaded for requests, blocks and bytes restored at start-up."""
        out, self._stats = self._stats, self._new_stats()
        return out

    @staticmethod
    def _new_stats() -> dict[str, int]:
        return {"queries": 0, "hits": 0, "bytes_loaded": 0, "blocks_restored": 0, "bytes_restored": 0}

    def plan_restore(self, max_blocks: int) -> list[tuple[int, list[int]]]:
        """The tier's most recently used chains to restore, at most ``max_blocks`` blocks
        (``disk_store.recent_chains``)."""
        return recent_chains(self.folder, self.key, self.block_nbytes, max_blocks)

    def restored_tokens(self, block_hash: int, parent_hash: int) -> Optional[list[int]]:
        """The token ids kept beside block ``block_hash`` (its parent's hash ``parent_hash``,
        0 for a first block), or None (``disk_store.read_tokens``): what a restored block's
        BlockStored event carries."""
        return read_tokens(self.folder, block_hash, parent_hash, self.block_size)

    def restore_meta(self, loads: list[tuple[list[int], list[int]]]) -> SharedStorageConnectorMetadata:
        """A restore chunk's work for the workers: ``loads`` as (block ids, chain hashes)."""
        return SharedStorageConnectorMetadata(loads, [], restore=True)

    def note_restored(self, num_blocks: int) -> None:
        """Count ``num_blocks`` restored into the RAM prefix cache (``get_stats``)."""
        self._stats["blocks_restored"] += num_blocks
        self._stats["bytes_restored"] += num_blocks * self.block_nbytes

    # ---- worker side -------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """Check the cache layout against the key's and start the writer. Raises
        ValueError when a layer's block is not the size the layout key implies."""
        per_block = sum(kv[:, 0].numel() * kv.element_size() for kv in kv_caches)
        if per_block != self.block_nbytes:
            raise ValueError(f"{type(self).__name__}: a KV block holds {per_block} bytes, the layout key "
                             f"says {self.block_nbytes}; this model's KV cache layout is not supported")
        self.kv_caches = kv_caches
        self._kv_all = _one_view(kv_caches)
        self._slots = _slot_regions(self._kv_all)
        self._native = _native_reader(self._kv_all, self.block_nbytes) if self._slots is not None else None
        if self.folder is not None:  # None: the tier is off (_layout_folder)
            self.writer = BlockWriter(self.folder, self.key, self.max_bytes)

    def start_load_kv(self, **kwargs: Any) -> None:
        """Read this step's loaded blocks into the cache (synchronously: every layer is in
        place when this returns, so ``wait_for_layer_load`` has nothing to wait for). On
        the CPU each file goes straight into its block's slots (``_slot_regions``: one
        ``readv`` of 2 x num_layers pieces) and is checksummed there while in the CPU cache.
        With the C++ reader (``_load_native``) all files go in one GIL-free call.
        For 249 blocks (92 MB, SmolLM2, 4,000 tokens) the old path (the scheduler read into
        a staging buffer, then one copy into the cache) took ~8 + ~5.5 ms in isolation and
        a median 36 ms per hit in the engine; this one ~10 ms and 19 ms (both at load ~4 on
        2 cores, same run). Blocks that fail verification, and the rest of their chain, go
        to ``get_block_ids_with_load_errors``; a step with such a block saves nothing (its
        forward read the bad KV)."""
        meta = self._connector_metadata
        self._load_errors, self._step_failed = set(), False
        if not isinstance(meta, SharedStorageConnectorMetadata) or not meta.loads:
            return
        for block_ids, hashes in meta.loads:
            n = self._load_split(block_ids, hashes, touch=not meta.restore)
            self._load_errors.update(block_ids[n:])
        self._step_failed = bool(self._load_errors)

    # Threads that read one load's files (readv and xxhash release the GIL): a 249-block
    # load took a median 17 ms on two against 21 ms on one (load ~3 on 2 cores).
    LOAD_THREADS = 2

    def _load_split(self, block_ids: list[int], hashes: list[int], touch: bool = True) -> int:
        """Load blocks ``hashes`` into ``block_ids`` with the C++ reader when there is one
        (``_load_native``), else ``_load_chain`` over halves of the blocks on two threads
        (straight reads only); how many, from the first, are valid. ``touch``: bump the
        files' mtimes (LRU)."""
        if self._native is not None:
            return self._load_native(block_ids, hashes, touch)
        half = len(hashes) // 2
        if self.LOAD_THREADS < 2 or self._slots is None or half < 8:
            return self._load_chain(block_ids, hashes, touch)
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-load")
        later = self._pool.submit(self._load_chain, block_ids[half:], hashes[half:], touch)
        n = self._load_chain(block_ids[:half], hashes[:half], touch)
        m = later.result()
        return n if n < half else half + m

    def _load_native(self, block_ids: list[int], hashes: list[int], touch: bool = True) -> int:
        """All blocks in one call of the C++ reader (``tier_io.read_blocks``: open, preadv into
        the slots, XXH3, close per file, ``LOAD_THREADS`` threads, no GIL); the first invalid
        file is logged and removed here, as the Python path does. The valid files' mtimes
        (``touch``) are bumped after, on the writer's thread (``BlockWriter.touch``)."""
        import torch

        from llmserve.ops.tier_io import MISSING, STATUS_REASONS

        ops, cache = self._native
        regions = len(self._slots)  # layer and K/V: the pieces of a file's payload
        status = torch.empty(len(hashes), dtype=torch.int8)
        n = ops.read_blocks(cache, regions, self.block_nbytes // regions, self.folder, hashes,
                            torch.tensor(block_ids, dtype=torch.int64), self._prefix, False, self.LOAD_THREADS,
                            status)
        if n < len(hashes) and int(status[n]) != MISSING:  # a missing file was evicted since: nothing to remove
            drop_invalid(self.folder, hashes[n], STATUS_REASONS.get(int(status[n]), "invalid"))
        if touch and n and self.writer is not None:
            self.writer.touch(hashes[:n], ops.touch)
        return n

    def _load_chain(self, block_ids: list[int], hashes: list[int], touch: bool = True) -> int:
        """``_load`` in batches of ``OPEN_BATCH`` files, up to the first invalid block."""
        n = 0
        for lo in range(0, len(hashes), self.OPEN_BATCH):
            batch = hashes[lo:lo + self.OPEN_BATCH]
            k = self._load(block_ids[lo:lo + self.OPEN_BATCH], batch, touch)
            n += k
            if k < len(batch):
                break
        return n

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids of this step whose load failed (vLLM's name); the scheduler computes
        their requests again from the first of them."""
        return self._load_errors

    def _load(self, block_ids: list[int], hashes: list[int], touch: bool = True) -> int:
        """Load blocks ``hashes`` into ``block_ids``; how many, from the first, are valid."""
        fds = open_chain(self.folder, hashes)
        if self._slots is not None:
            regions = self._slots
            slot = self.block_nbytes // len(regions)
            return read_chain_into(self.folder, self.key, hashes, fds,
                                   lambda i: [r[block_ids[i] * slot:(block_ids[i] + 1) * slot] for r in regions],
                                   touch)
        return self._load_staged(block_ids, hashes, fds, touch)

    def _load_staged(self, block_ids: list[int], hashes: list[int], fds: list[int], touch: bool = True) -> int:
        """Read into one host buffer, then copy into the cache: a cache off the CPU, or
        per-layer caches that are not one buffer. The buffer is new each time (its pages
        fault in on the read: ~20 ms per 92 MB); these layouts are not the CPU engine's."""
        import torch

        nb = self.block_nbytes
        buf = memoryview(np.empty(len(fds) * nb, dtype=np.uint8))
        n = read_chain(self.folder, self.key, hashes, fds, buf, nb, touch)
        if not n:
            return 0
        kv0 = self.kv_caches[0]
        # [n, L, 2, block elements] as written -> [L, 2, n, block elements] (a strided view)
        data = torch.frombuffer(buf[:n * nb], dtype=torch.uint8).view(kv0.dtype)
        data = data.view(n, len(self.kv_caches), 2, -1).permute(1, 2, 0, 3).to(kv0.device)
        if self._kv_all is not None:
            _copy_into(self._kv_all, block_ids[:n], data)
            return n
        ids = torch.tensor(block_ids[:n], device=kv0.device)
        for layer, kv in enumerate(self.kv_caches):
            kv[:, ids] = data[layer].reshape(2, n, *kv.shape[2:])
        return n

    def save_kv_layer(self, layer_name: str, kv_layer: Any, **kwargs: Any) -> None:
        """Copy layer ``int(layer_name)``'s blocks of this step's save set out of the cache."""
        meta = self._connector_metadata
        if isinstance(meta, SharedStorageConnectorMetadata) and meta.saves:
            import torch

            ids = torch.tensor([save[0] for save in meta.saves], device=kv_layer.device)
            self._layer_saves[int(layer_name)] = kv_layer[:, ids].to("cpu")  # [2, N, bs, H, D]

    def wait_for_save(self) -> None:
        """Save the layers not saved yet, then queue each block (all layers) to the writer;
        the writer thread does the file I/O."""
        meta = self._connector_metadata
        if not isinstance(meta, SharedStorageConnectorMetadata) or not meta.saves or self.writer is None:
            return
        if self._step_failed:  # KV computed over a bad loaded block: recomputed (and saved) later
            self._layer_saves = {}
            return
        import torch

        if self._kv_all is not None and not self._layer_saves:  # one gather over all layers
            ids = torch.tensor([save[0] for save in meta.saves], device=self._kv_all.device)
            stacked = self._kv_all.index_select(2, ids).to("cpu")  # [L, 2, N, block elements]
        else:
            for layer, kv in enumerate(self.kv_caches):
                if layer not in self._layer_saves:
                    self.save_kv_layer(str(layer), kv)
            stacked = torch.stack([self._layer_saves[i] for i in range(len(self.kv_caches))])  # [L, 2, N, ...]
            stacked = stacked.flatten(3)
        self._layer_saves = {}
        blocks = stacked.permute(2, 0, 1, 3).contiguous()  # [N, L, 2, block elements]
        rows = blocks.view(torch.uint8).view(len(meta.saves), -1).numpy()
        for i, save in enumerate(meta.saves):
            self.writer.put(save[1], save[2], rows[i], save[3] if len(save) > 3 else None)
        if not self.can_load:  # a kv_producer (prefill instance): on disk before its answer goes out
            self.writer.flush()

    def flush(self) -> None:
        """Wait until every queued block is written (tests, shutdown)."""
        if self.writer is not None:
            self.writer.flush()

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


class OffloadingConnector(SharedStorageConnector):
    """vLLM's tiered-offloading connector name (``--kv-offloading-backend native
    --kv-offloading-size GiB``): the same disk tier, bounded by ``kv_offloading_size``,
    under ``shared_storage_path`` or ``$XDG_CACHE_HOME/llmserve/kv_offload``. vLLM's native
    backend keeps the tier in CPU RAM; on a CPU engine the KV already lives in RAM, so the
    next tier here is the local disk."""

    @classmethod
    def _storage_path(cls, extra: dict) -> str:
        if extra.get("shared_storage_path"):
            return super()._storage_path(extra)
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(cache, "llmserve", "kv_offload")

    @staticmethod
    def _max_bytes(extra: dict) -> Optional[int]:
        if extra.get("kv_offloading_size") is None:
            raise ValueError("OffloadingConnector needs kv_connector_extra_config.kv_offloading_size (GiB; "
                             "--kv-offloading-size)")
        return SharedStorageConnector._max_bytes(extra)
