"""Paged KV cache bookkeeping: a block pool with reference counts, a free-block queue,
prefix caching by a hash chain over full blocks, and LRU eviction of cached free blocks.

Follows vLLM's v1 KVCacheManager / BlockPool design (and the PagedAttention paper,
Kwon et al. 2023). Deals in token counts and block ids only; never in tensors.
"""
from __future__ import annotations

import hashlib
import logging
import pickle
from collections import OrderedDict
from typing import Optional, Sequence

from llmserve.core.kv_events import MEDIUM_PRIMARY, AllBlocksCleared, BlockRemoved, BlockStored
from llmserve.core.request import Request

logger = logging.getLogger(__name__)

_NONE_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    """Hash of one full block: (parent block hash, its token ids, extra keys).

    Chaining the parent hash makes the hash identify the whole prefix, not just the
    block. sha256 truncated to 64 bits: collisions are negligible.
    """
    data = pickle.dumps((parent_hash, tuple(token_ids), extra_keys), protocol=pickle.HIGHEST_PROTOCOL)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


# Prefix-cache keys of KV cache group g (hybrid models, core/kv_cache_coordinator.py) are the
# 64-bit chain hash plus g * 2**64: the same prefix names a different block in each group
# (its layers' K/V), and only the first group's (g = 0: the plain hash) are published as KV
# events, so subscribers see one block per prefix as for a single-group model.
GROUP_KEY_STRIDE = 1 << 64


def max_window_blocks(sliding_window: int, block_size: int, max_step_tokens: int) -> int:
    """The most blocks a request can hold at once when every layer has a window of
    ``sliding_window`` tokens and a step runs at most ``max_step_tokens`` of it:
    ``ceil((n + W) / block_size) + 3`` (the window before the step's first block, that
    block's own tokens, the step's, and rounding at both ends; see
    ``KVCacheManager._num_skippable``)."""
    return -(-(max_step_tokens + sliding_window) // block_size) + 3


def max_blocks_held(group_windows: Sequence[Optional[int]], num_tokens: int, block_size: int,
                    max_step_tokens: int) -> int:
    """The most blocks a request of ``num_tokens`` tokens can hold at once over the KV
    cache groups whose windows are ``group_windows`` (None: full attention, all
    ``ceil(num_tokens / block_size)`` blocks; a window: at most ``max_window_blocks``)."""
    total = -(-num_tokens // block_size)
    return sum(total if w is None else min(total, max_window_blocks(w, block_size, max_step_tokens))
               for w in group_windows)


class KVCacheBlock:
    """Metadata of one block: id, reference count, and its hash once full and cached."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[int] = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """All KV blocks. Blocks freed after use (ref_cnt 0) sit in an LRU queue: the first
    block of the queue is evicted first. A free block may still hold a cached prefix
    (``block_hash``); it is found by hash until it is evicted for reuse.

    Blocks never used yet are handed out (in id order) before a block holding a cached
    prefix is evicted only while fewer than ``cache_floor_blocks`` blocks have been used;
    past that, freed blocks are reused first, so the KV memory a workload touches follows
    its peak number of live blocks (or the floor) instead of the cache size (issue 16: the
    KV buffer's pages become resident only when first written). Freed blocks that hold no
    cached prefix are always reused first. The price: past the floor, a cached prefix is
    evicted before fresh memory is used, so the prefix cache holds what fits in the floor
    or beside the largest batch seen so far, not the whole configured cache (vLLM
    preallocates and fills it all). Measured on a 128-token-chat benchmark that ran ~40k
    tokens through a 4 GiB cache: the highest block used, and with it the engine's RSS,
    had grown by ~900 MiB; with the floor at 16k tokens, by at most ~380 MiB (SmolLM2).

    Block 0 is reserved as a null/padding block and never handed out.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, cache_floor_blocks: int = 0) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.cache_floor_blocks = cache_floor_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.next_fresh = 1  # blocks next_fresh.. have never been handed out
        self.cached: dict[int, KVCacheBlock] = {}
        # KV events (core/kv_events.py) made since the engine last drained them; None
        # when --kv-events-config is off, so nothing is made (vLLM's BlockPool.kv_event_queue).
        self.events: Optional[list] = None

    def get_num_free_blocks(self) -> int:
        return len(self.free_queue) + self.num_blocks - self.next_fresh

    def _pop_free(self) -> KVCacheBlock:
        fresh_left = self.next_fresh < self.num_blocks
        if self.free_queue:
            head = next(iter(self.free_queue.values()))
            grow = fresh_left and head.block_hash is not None and self.next_fresh <= self.cache_floor_blocks
            if not grow:
                return self.free_queue.popitem(last=False)[1]
        self.next_fresh += 1
        return self.blocks[self.next_fresh - 1]

    def get_cached_block(self, block_hash: int) -> Optional[KVCacheBlock]:
        return self.cached.get(block_hash)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.pop(b.block_id, None)
            b.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop n free blocks (evicting their cached contents). Raises ValueError if short."""
        if n > self.get_num_free_blocks():
            raise ValueError(f"cannot get {n} free blocks from the pool")
        out = []
        for _ in range(n):
            b = self._pop_free()
            if b.block_hash is not None:
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                    if self.events is not None and b.block_hash < GROUP_KEY_STRIDE:
                        self.events.append(BlockRemoved([b.block_hash], MEDIUM_PRIMARY))
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def take_unused_blocks(self, n: int) -> list[KVCacheBlock]:
        """Up to ``n`` blocks that hold no cached prefix (free ones without a hash, then
        never-used ones), with one reference each; no cached prefix is evicted, so fewer
        come back when the pool has fewer. For restoring a KV tier (kv_transfer/tier_restore.py)."""
        out: list[KVCacheBlock] = []
        while len(out) < n and self.free_queue and next(iter(self.free_queue.values())).block_hash is None:
            out.append(self.free_queue.popitem(last=False)[1])
        while len(out) < n and self.next_fresh < self.num_blocks:
            self.next_fresh += 1
            out.append(self.blocks[self.next_fresh - 1])
        for b in out:
            b.ref_cnt = 1
        return out

    def free_restored(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop the only reference on ``blocks`` (cached, given in eviction order) and queue
        them as the least recently used cached blocks: after the free blocks that hold no
        prefix (reused first anyway), before every other cached block. A restore's chunks
        come most recently used first, so a later chunk is evicted before an earlier one,
        and anything used since the engine started outlives both."""
        uncached = []
        while self.free_queue and next(iter(self.free_queue.values())).block_hash is None:
            uncached.append(self.free_queue.popitem(last=False)[1])
        for b in reversed([*uncached, *blocks]):
            b.ref_cnt = 0
            self.free_queue[b.block_id] = b
            self.free_queue.move_to_end(b.block_id, last=False)

    def free_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference; blocks reaching 0 go to the tail of the LRU queue (callers
        pass them in eviction order: the ones to evict first come first), or to its head
        when they hold no cached prefix (nothing is lost by reusing them first)."""
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue[b.block_id] = b
                if b.block_hash is None:
                    self.free_queue.move_to_end(b.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> bool:
        """Enter a full block under its hash; True when it was newly cached."""
        if block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # an identical block is already cached; keep that one
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes. Only possible when no block is in use."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    @property
    def usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)


class KVCacheManager:
    """Allocates KV blocks to requests (vLLM's KVCacheManager).

    Args:
      num_blocks: blocks in the cache (block 0 reserved). block_size: tokens per block.
      enable_caching: prefix caching on/off. cache_floor_tokens: KV (tokens) the prefix
      cache may fill before evicting (None: ``PREFIX_CACHE_FLOOR_TOKENS``; see BlockPool).
      enable_kv_cache_events: record the prefix cache's block events (core/kv_events.py)
      for ``take_events`` (``--kv-events-config``; only with prefix caching).
      sliding_window: when EVERY attention layer attends only to its last W positions (the
      largest W of the layers; Mistral v0.1, Phi-3), the blocks no window reaches any more
      are freed while the request runs and replaced in its block table by the null block
      (block 0, never read: the attention masks or skips positions outside the window);
      None (any full-attention layer, e.g. Gemma 2/3's global layers): nothing is freed
      before the request ends. vLLM's SlidingWindowManager, for a single KV cache group.
    """

    # Tokens of KV the prefix cache may fill with fresh memory before it evicts (BlockPool):
    # as much as llama-server's -c 16384 holds for its slots.
    PREFIX_CACHE_FLOOR_TOKENS = 16384

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 cache_floor_tokens: Optional[int] = None, enable_kv_cache_events: bool = False,
                 sliding_window: Optional[int] = None, pool: Optional[BlockPool] = None,
                 cache_group: int = 0) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_caching = enable_caching
        # One KV cache group of a hybrid model (HybridKVCacheManager): ``pool`` is shared by
        # the groups and ``cache_group`` offsets this group's prefix-cache keys.
        self.key_offset = cache_group * GROUP_KEY_STRIDE
        if pool is None:
            floor = self.PREFIX_CACHE_FLOOR_TOKENS if cache_floor_tokens is None else cache_floor_tokens
            pool = BlockPool(num_blocks, enable_caching, floor // block_size)
            if enable_kv_cache_events and enable_caching:
                pool.events = []
        self.pool = pool
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        # Sliding window: the placeholder of freed blocks in a block table (block 0, reserved
        # by the pool: it is never handed out, cached or freed), and per request how many
        # leading entries of its table are placeholders already (freeing resumes there).
        self.null_block = self.pool.blocks[0]
        self.num_skipped: dict[str, int] = {}
        # Counters for prefix-cache hit rate (tokens).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - 1 - self.pool.get_num_free_blocks()

    def _update_block_hashes(self, request: Request) -> list[int]:
        hashes = request.block_hashes
        bs = self.block_size
        toks = request.all_token_ids
        n_full = len(toks) // bs
        while len(hashes) < n_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else _NONE_HASH
            # The first block carries the adapter (vLLM's LoRA extra key): the chain then
            # keeps two adapters' KV of the same prompt apart.
            lora = getattr(request, "lora_request", None) if i == 0 else None
            extra = (lora.lora_int_id, lora.lora_name) if lora is not None else ()
            hashes.append(hash_block_tokens(parent, toks[i * bs:(i + 1) * bs], extra))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in full blocks.

        Returns (blocks, num_computed_tokens). At least one token is always left to
        compute, so the model produces logits for the last position. With a sliding window
        the hit needs only the blocks the window of its first uncomputed token reaches; the
        blocks before them are the null block (see ``_longest_window_hit``).
        """
        if not self.enable_caching or not request.use_prefix_cache:
            return [], 0
        hashes = self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            blocks = self._longest_window_hit(hashes[:max_blocks])
        else:
            blocks = self._longest_full_hit(hashes[:max_blocks])
        n = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += n
        return blocks, n

    def _longest_full_hit(self, hashes: Sequence[int]) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of ``hashes`` cached in this group."""
        blocks: list[KVCacheBlock] = []
        for h in hashes:
            b = self.pool.get_cached_block(h + self.key_offset)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def longest_hit(self, hashes: Sequence[int]) -> list[KVCacheBlock]:
        """This group's longest prefix hit among the prefixes of ``hashes`` (block hashes
        of the request), null blocks included where a window no longer reaches."""
        if self.sliding_window is not None:
            return self._longest_window_hit(hashes)
        return self._longest_full_hit(hashes)

    def _num_skippable(self, num_computed_tokens: int) -> int:
        """Leading blocks of a request no layer reads again once ``num_computed_tokens`` are
        computed (0 without a sliding window). Counted from the first token of the block
        that holds the next token, not from the next token itself: a request can then
        always go back to its last full block and recompute from there (a beam forked
        without a free block for its partial block; a prefix hit ends on a block boundary
        too). That keeps at most one block more than vLLM's ``num_computed - W + 1``.
        A query at position p reads keys p - W + 1 .. p (``PagedAttention``'s mask)."""
        if self.sliding_window is None:
            return 0
        start = num_computed_tokens // self.block_size * self.block_size
        return max(0, start - self.sliding_window + 1) // self.block_size

    def _longest_window_hit(self, hashes: Sequence[int]) -> list[KVCacheBlock]:
        """Sliding window: the longest prefix of ``hashes`` (n blocks) whose blocks from
        ``_num_skippable(n * block_size)`` on are all cached, with the null block for the
        ones before (they may be evicted: nothing reads them). vLLM's
        SlidingWindowManager.find_longest_cache_hit, scanning left to right: a request's
        blocks are freed (and so evicted) oldest first, so a re-sent long conversation
        typically still has its last window's blocks cached but not its first ones."""
        found: list[Optional[KVCacheBlock]] = []
        best = best_start = run_start = 0
        for i, h in enumerate(hashes):
            b = self.pool.get_cached_block(h + self.key_offset)
            found.append(b)
            if b is None:
                run_start = i + 1
                continue
            need = self._num_skippable((i + 1) * self.block_size)
            if run_start <= need:
                best, best_start = i + 1, need
        return [self.null_block] * best_start + found[best_start:best]

    def _free_skipped(self, request: Request) -> None:
        """Free the request's blocks that its window has left (replaced by the null block in
        its table). Oldest first, so the pool evicts their cached prefix first."""
        rid = request.request_id
        blocks = self.req_to_blocks[rid]
        n = min(self._num_skippable(request.num_computed_tokens), len(blocks))
        done = self.num_skipped.get(rid, 0)
        if n <= done:
            return
        gone = [b for b in blocks[done:n] if b is not self.null_block]
        blocks[done:n] = [self.null_block] * (n - done)
        self.num_skipped[rid] = n
        self.pool.free_blocks(gone)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()) -> Optional[list[KVCacheBlock]]:
        """Make room for ``num_new_tokens`` more tokens of the request (after its
        ``num_computed_tokens`` plus the ``new_computed_blocks`` prefix hits).

        Returns the newly allocated blocks, or None when the pool is too small (nothing is
        allocated then; with a sliding window, the blocks the window has left are freed
        first either way).
        """
        self.free_out_of_window(request)
        num_new_blocks, num_evictable_hits = self.blocks_needed(request, num_new_tokens, new_computed_blocks)
        if num_new_blocks > self.pool.get_num_free_blocks() - num_evictable_hits:
            return None
        return self.commit_slots(request, num_new_blocks, new_computed_blocks)

    def free_out_of_window(self, request: Request) -> None:
        """With a sliding window, free the request's blocks its window has left (the first
        stage of ``allocate_slots``; nothing without a window or before any allocation)."""
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if self.sliding_window is not None and req_blocks:
            self._free_skipped(request)

    def blocks_needed(self, request: Request, num_new_tokens: int,
                      new_computed_blocks: Sequence[KVCacheBlock] = ()) -> tuple[int, int]:
        """(fresh blocks ``allocate_slots`` would take, prefix hits among
        ``new_computed_blocks`` that sit in the free queue now and would leave it)."""
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        null = self.null_block
        return num_new_blocks, sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not null)

    def commit_slots(self, request: Request, num_new_blocks: int,
                     new_computed_blocks: Sequence[KVCacheBlock] = ()) -> list[KVCacheBlock]:
        """Take the prefix hits and ``num_new_blocks`` fresh blocks (the caller checked
        that the pool has them); returns the fresh ones."""
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        null = self.null_block
        if new_computed_blocks:
            self.pool.touch([b for b in new_computed_blocks if b is not null])
            if not req_blocks and new_computed_blocks[0] is null:  # a sliding-window hit
                self.num_skipped[request.request_id] = sum(1 for b in new_computed_blocks if b is null)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(req_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_caching or not request.use_prefix_cache:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        start = self.num_cached_block.get(request.request_id, 0)
        n_full = min(num_computed_tokens // self.block_size, len(blocks))
        if n_full <= start:
            return
        hashes = self._update_block_hashes(request)
        null = self.null_block  # a freed block's placeholder is never entered in the cache
        fresh = [i for i in range(start, min(n_full, len(hashes)))
                 if blocks[i] is not null and self.pool.cache_block(blocks[i], hashes[i] + self.key_offset)]
        self.num_cached_block[request.request_id] = min(n_full, len(hashes))
        if fresh and self.pool.events is not None and not self.key_offset:
            self._record_stored(request, hashes, fresh)

    def _record_stored(self, request: Request, hashes: list[int], fresh: list[int]) -> None:
        """One BlockStored per run of consecutive newly cached blocks (``fresh``: their
        indexes in the request), with the parent hash and tokens of that run."""
        bs, toks = self.block_size, request.all_token_ids
        lora = getattr(request, "lora_request", None)
        lora_id, lora_name = (lora.lora_int_id, lora.lora_name) if lora is not None else (None, None)
        first = 0
        for k in range(1, len(fresh) + 1):
            if k < len(fresh) and fresh[k] == fresh[k - 1] + 1:
                continue
            a, b = fresh[first], fresh[k - 1] + 1
            self.pool.events.append(BlockStored(hashes[a:b], hashes[a - 1] if a else None,
                                                list(toks[a * bs:b * bs]), bs, lora_id, MEDIUM_PRIMARY,
                                                lora_name))
            first = k

    def take_events(self) -> list:
        """The block events recorded since the last call (empty when events are off);
        the engine publishes them once per step (vLLM's KVCacheManager.take_events)."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def free(self, request: Request) -> None:
        """Release the request's blocks; its last blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.num_skipped.pop(request.request_id, None)
        self.pool.free_blocks([b for b in reversed(blocks) if b is not self.null_block])

    def fork(self, parent: Request, child: Request, allow_copy: bool = True) -> Optional[tuple[int, int]]:
        """Give ``child`` (a beam forked from ``parent`` after its computed tokens) the
        parent's blocks by reference; the last, partial block (still to be written by
        both) is copied instead: returns the (src, dst) block ids to copy, or None when
        there is no partial block, or no free block for the copy (then the child keeps
        only the full blocks and recomputes the partial one's tokens: the caller sets its
        ``num_computed_tokens`` from ``child_computed_tokens``). ``allow_copy`` False: no
        copy whatever the pool holds (a hybrid model's groups copy all or none)."""
        blocks = self.req_to_blocks.get(parent.request_id, [])
        n_full = min(parent.num_computed_tokens // self.block_size, len(blocks))
        shared = blocks[:n_full]
        self.pool.touch([b for b in shared if b is not self.null_block])
        if parent.request_id in self.num_skipped:  # the window's null blocks are shared as they are
            self.num_skipped[child.request_id] = min(self.num_skipped[parent.request_id], n_full)
        mine = list(shared)
        copy = None
        if allow_copy and self.needs_fork_copy(parent) and self.pool.get_num_free_blocks():
            dst = self.pool.get_new_blocks(1)[0]
            mine.append(dst)
            copy = (blocks[n_full].block_id, dst.block_id)
        self.req_to_blocks[child.request_id] = mine
        self.num_cached_block[child.request_id] = min(self.num_cached_block.get(parent.request_id, 0), n_full)
        return copy

    def needs_fork_copy(self, parent: Request) -> bool:
        """True when ``parent`` has a partial last block that ``fork`` would copy."""
        blocks = self.req_to_blocks.get(parent.request_id, [])
        return bool(parent.num_computed_tokens % self.block_size) and \
            len(blocks) > parent.num_computed_tokens // self.block_size

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past the first ``ceil(num_tokens / block_size)``
        (speculative decoding: blocks that only held rejected draft tokens). They hold no
        cached prefix (only blocks of computed tokens are cached), so they are freed as
        reusable first."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks and len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.free_blocks(list(reversed(extra)))
