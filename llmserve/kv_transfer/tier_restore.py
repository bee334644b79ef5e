"""Tier warm-up: an engine started over an existing disk KV tier loads the tier's most
recently used prefixes into its RAM prefix cache before requests ask for them, so the
first repeat of a prompt after a restart is an ordinary in-RAM prefix-cache hit instead of
a load from disk on the request path (issue 32: a 4,000-token SmolLM2 prompt loaded on
demand took 11-13 ms of TTFT against ~8.4 ms allowed, 1.2x a warm RAM hit).

The tier's files are content-addressed by the prefix cache's chain hashes (deterministic
across processes) and each header names its parent, so ``disk_store.recent_chains`` picks
whole chains, newest first, and restored blocks are entered in the prefix cache under
their hashes. They are free-but-cached blocks, never pinned: queued as the least recently
used cached blocks (``BlockPool.free_restored``), so the LRU evicts them before anything
used since the start. Only blocks that hold no cached prefix are taken
(``BlockPool.take_unused_blocks``): a restore never evicts.

The work runs in chunks of ``CHUNK_BYTES`` of KV: the EngineCore's process runs one chunk
whenever it is idle (``EngineCoreProc.run_busy_loop``; a request arriving waits at most
for the chunk under way), an in-process engine all of them at start (``InprocClient``: it
has no idle time). A request that arrives before the restore is over is served as usual:
the blocks restored so far are RAM hits, the others load from disk or are computed; the
next chunk skips blocks the request put in the cache. Files the worker finds torn or
corrupt (XXH3) are removed and not entered, nor is anything chained after them.

With KV cache events on (``--kv-events-config``) each restored run of blocks is announced
as a BlockStored (chain order, parents first; the engine publishes each chunk's events
before it serves), with the token ids kept beside the block files
(``disk_store.read_tokens``), so a subscriber's set of blocks stays the prefix cache's: a
block without its token file (written before they were kept) is not restored then, nor
is anything chained after it; it still loads from disk on request, announced as usual.

No torch here (the scheduler's side); the worker reads the files into the blocks through
the connector's usual load path (``SharedStorageConnectorMetadata.restore``).
"""
from __future__ import annotations

from collections import deque
from typing import Any, Optional

from llmserve.core.kv_events import MEDIUM_PRIMARY, BlockStored


class TierRestore:
    """Restores up to ``max_blocks`` of the tier's blocks into ``pool`` (a ``BlockPool``)
    through ``connector`` (the scheduler side of a ``SharedStorageConnector``).

    Protocol: ``next_chunk()`` allocates blocks and returns the connector metadata for the
    workers (None when done); the caller runs it (``execute_model`` with no requests) and
    hands the worker's failed block ids to ``finish_chunk``, which enters the blocks that
    loaded in the prefix cache. Counters: ``blocks`` and ``nbytes`` entered, ``failed``
    (not entered: their file failed the check, or one before them in the chain did),
    ``untold`` (not entered with KV events on: no valid token file, or none before them),
    ``seconds`` spent (``add_seconds``: planning and chunks, not the waits between them).
    """

    # KV bytes per chunk: 16 MiB is ~45 SmolLM2 bf16 blocks, ~15 ms at ~1 GiB/s of fresh
    # pages (reads from the page cache plus first-touch faults), the longest a request
    # arriving mid-restore waits.
    CHUNK_BYTES = 16 << 20

    def __init__(self, connector: Any, pool: Any, max_blocks: int) -> None:
        self.connector = connector
        self.pool = pool
        self.max_blocks = max_blocks
        self.chunk_blocks = max(1, self.CHUNK_BYTES // connector.block_nbytes)
        self._pieces: Optional[deque] = None  # (anchor hash, hashes) left, planned on the first chunk
        self._runs: list[tuple[int, list[Any], list[int]]] = []  # the chunk under way
        self.blocks = self.nbytes = self.failed = self.untold = 0
        self.seconds = 0.0

    def next_chunk(self) -> Optional[Any]:
        """Allocate the next chunk's blocks; its ``SharedStorageConnectorMetadata``, or
        None when nothing is left (or the pool has no block without a cached prefix)."""
        if self._pieces is None:
            self._pieces = deque(self.connector.plan_restore(self.max_blocks))
        while self._pieces:  # a chunk's worth of blocks may all be cached already: on to the next
            runs = self._take(self.chunk_blocks)
            if runs:
                self._runs = runs
                return self.connector.restore_meta([([b.block_id for b in blocks], hashes)
                                                    for _, blocks, hashes in runs])
        return None

    def _take(self, limit: int) -> list[tuple[int, list[Any], list[int]]]:
        """Up to ``limit`` blocks of the planned pieces, as runs (anchor, blocks, hashes)
        of blocks not cached yet whose anchor is a first block's 0, cached, or earlier in
        this chunk; a piece longer than what is left is split (its rest waits)."""
        runs: list[tuple[int, list[Any], list[int]]] = []
        here: set[int] = set()
        want: list[tuple[int, list[int]]] = []
        n = 0
        while self._pieces and n < limit:
            anchor, hashes = self._pieces.popleft()
            if anchor and anchor not in here and self.pool.get_cached_block(anchor) is None:
                continue  # its parent failed to load or was evicted: useless
            if len(hashes) > limit - n:
                self._pieces.appendleft((hashes[limit - n - 1], hashes[limit - n:]))
                hashes = hashes[:limit - n]
            run_anchor, run = anchor, []
            for h in hashes:
                if self.pool.get_cached_block(h) is not None:  # computed by a request since
                    if run:
                        want.append((run_anchor, run))
                    run_anchor, run = h, []
                    continue
                run.append(h)
                here.add(h)
            if run:
                want.append((run_anchor, run))
            n += len(hashes)
        blocks = self.pool.take_unused_blocks(sum(len(h) for _, h in want))
        i = 0
        for anchor, hashes in want:
            got = blocks[i:i + len(hashes)]
            i += len(got)
            if got:
                runs.append((anchor, got, hashes[:len(got)]))
        if i < sum(len(h) for _, h in want):
            self._pieces.clear()  # the pool is out of blocks that hold nothing: stop
        return runs

    def finish_chunk(self, failed_block_ids: set[int]) -> None:
        """Enter the chunk's blocks that loaded (up to each run's first failed one) under
        their hashes, when their anchor is in the cache; free the others uncached. With KV
        events on, record a BlockStored per run of newly entered blocks (parents first);
        a run stops at its first block without valid token ids."""
        keep: list[Any] = []
        drop: list[Any] = []
        for anchor, blocks, hashes in self._runs:
            ok = next((i for i, b in enumerate(blocks) if b.block_id in failed_block_ids), len(blocks))
            if anchor and self.pool.get_cached_block(anchor) is None:
                ok = 0
            self.failed += len(blocks) - ok
            tokens: list[list[int]] = []
            if self.pool.events is not None:
                for i in range(ok):
                    t = self.connector.restored_tokens(hashes[i], hashes[i - 1] if i else anchor)
                    if t is None:
                        self.untold += ok - i
                        ok = i
                        break
                    tokens.append(t)
            fresh = []
            for i, (b, h) in enumerate(zip(blocks[:ok], hashes)):
                if self.pool.cache_block(b, h):
                    keep.append(b)
                    fresh.append(i)
                else:
                    drop.append(b)
            drop.extend(blocks[ok:])
            if fresh and self.pool.events is not None:
                self._record_stored(anchor, hashes, tokens, fresh)
        self._runs = []
        # Eviction order: the chunk's last (least recently used) runs first, leaves first.
        self.pool.free_restored(keep[::-1])
        self.pool.free_blocks(drop)
        self.blocks += len(keep)
        self.nbytes += len(keep) * self.connector.block_nbytes
        self.connector.note_restored(len(keep))

    def _record_stored(self, anchor: int, hashes: list[int], tokens: list[list[int]], fresh: list[int]) -> None:
        """One BlockStored per run of consecutive newly entered blocks (``fresh``: their
        indexes in ``hashes``), as ``KVCacheManager._record_stored`` makes for a request's
        (no adapter: adapters' blocks are never kept on disk)."""
        first = 0
        for k in range(1, len(fresh) + 1):
            if k < len(fresh) and fresh[k] == fresh[k - 1] + 1:
                continue
            a, b = fresh[first], fresh[k - 1] + 1
            parent = hashes[a - 1] if a else (anchor or None)
            self.pool.events.append(BlockStored(hashes[a:b], parent, [t for ts in tokens[a:b] for t in ts],
                                                self.connector.block_size, None, MEDIUM_PRIMARY))
            first = k

    def add_seconds(self, seconds: float) -> None:
        """Count a chunk's time (the caller times it whole, the workers' reads included)."""
        self.seconds += seconds

    def summary(self) -> str:
        return (f"restored {self.blocks} blocks ({self.nbytes / 2**20:.1f} MiB) of the KV tier into the prefix "
                f"cache in {self.seconds:.3f} s" + (f"; {self.failed} blocks skipped (bad files)" if self.failed else "")
                + (f"; {self.untold} blocks not restored (no token ids on disk to announce them in KV events)"
                   if self.untold else ""))


def make_tier_restore(connector: Any, pool: Any, enable_caching: bool) -> Optional[TierRestore]:
    """The warm-up for ``connector`` (a scheduler-side connector, or None) over ``pool``,
    or None when there is nothing to do: no connector that restores (its
    ``restore_share``, from ``kv_connector_extra_config.restore_on_start``, is 0 or it
    does not load), or no prefix cache."""
    share = getattr(connector, "restore_share", 0.0)
    if not share or not enable_caching:
        return None
    max_blocks = int(share * (pool.num_blocks - 1))
    return TierRestore(connector, pool, max_blocks) if max_blocks > 0 else None
