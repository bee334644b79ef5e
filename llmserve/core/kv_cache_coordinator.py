"""KV cache groups of a hybrid model: one block table per group per request, all from one
block pool (vLLM's hybrid KV cache allocator: ``KVCacheCoordinator`` over one
``SingleTypeKVCacheManager`` per group).

A model whose layers mix full attention and sliding-window attention (Gemma 2: every other
layer windowed; Gemma 3: five windowed per full one) gets one group of full-attention
layers and one or more groups of windowed layers, all with the same number of layers
(the model runner's ``worker/kv_cache_groups.py`` plans them; vLLM's uniform page size).
A block id then names one page of that many layers' K/V, used by whichever group holds it:
the full group keeps every block of a request, each windowed group only the blocks its
window still reaches (``KVCacheManager``'s sliding-window freeing, the null block in their
place), so a long conversation holds the window's KV in the windowed layers, not all of it.

Each group is a ``KVCacheManager`` over the shared pool (its own ``req_to_blocks``); this
class keeps their tables in step: a request's tables have the same length in every group,
an allocation takes blocks for every group or none, a prefix hit is a length every group
can serve (the full group's blocks for the whole prefix, a windowed group's for the last
window), forks copy every group's partial block or none. Plain Python, no torch.
"""
from __future__ import annotations

from typing import Optional, Sequence

from llmserve.core.kv_cache_manager import BlockPool, KVCacheBlock, KVCacheManager
from llmserve.core.request import Request


class HybridKVCacheManager:
    """KVCacheManager's interface over several KV cache groups sharing one pool.

    Args:
      num_blocks, block_size, enable_caching, cache_floor_tokens, enable_kv_cache_events:
      as ``KVCacheManager`` (for the one shared pool). group_windows: per group, None (full
      attention) or its sliding window in tokens; at least two groups. Raises ValueError
      for fewer than two groups or a window < 1.

    ``get_computed_blocks`` returns one block list per group, which ``allocate_slots``
    takes back as ``new_computed_blocks``; ``allocate_slots`` returns the fresh blocks of
    every group (their count matters to callers, not their order). ``get_block_ids`` is the
    first group's table; ``get_group_block_ids`` every group's. KV events are published
    for the first group's blocks only (``GROUP_KEY_STRIDE``).
    """

    def __init__(self, num_blocks: int, block_size: int, group_windows: Sequence[Optional[int]],
                 enable_caching: bool = True, cache_floor_tokens: Optional[int] = None,
                 enable_kv_cache_events: bool = False) -> None:
        if len(group_windows) < 2:
            raise ValueError(f"group_windows must name at least two KV cache groups, got {list(group_windows)}")
        first = KVCacheManager(num_blocks, block_size, enable_caching, cache_floor_tokens,
                               enable_kv_cache_events, sliding_window=group_windows[0])
        self.groups = [first] + [
            KVCacheManager(num_blocks, block_size, enable_caching, sliding_window=w, pool=first.pool,
                           cache_group=g)
            for g, w in enumerate(group_windows[1:], start=1)]
        self.group_windows = list(group_windows)
        self.pool: BlockPool = first.pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.null_block = first.null_block
        # Not one window for the whole model (the scheduler's bounds use group_windows).
        self.sliding_window = None
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """The first group's tables (every group's table has the same length)."""
        return self.groups[0].req_to_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - 1 - self.pool.get_num_free_blocks()

    def group_num_used_blocks(self, request_id: str) -> list[int]:
        """Blocks (not the null block) each group holds for the request."""
        null = self.null_block
        return [sum(1 for b in g.req_to_blocks.get(request_id, []) if b is not null) for g in self.groups]

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """The longest prefix, in full blocks, that every group has cached: the full groups
        all its blocks, the windowed groups those their window reaches at its end (vLLM's
        HybridKVCacheCoordinator.find_longest_cache_hit: each group in turn cuts the length
        to its own longest hit within it, until none cuts further; a full group's hit
        holds for every shorter length, a windowed group's is looked up again at the new
        length). Returns (per-group blocks, tokens); at least one token is left to compute."""
        n_groups = len(self.groups)
        if not self.enable_caching or not request.use_prefix_cache:
            return [[] for _ in range(n_groups)], 0
        hashes = self.groups[0]._update_block_hashes(request)
        n = (request.num_tokens - 1) // self.block_size
        hits: list[list[KVCacheBlock]] = [[] for _ in range(n_groups)]
        stable = False
        while not stable and n > 0:
            stable = True
            for g, m in enumerate(self.groups):
                if len(hits[g]) != n:
                    hits[g] = m.longest_hit(hashes[:n])
                if len(hits[g]) < n:
                    n, stable = len(hits[g]), False
        hits = [h[:n] for h in hits]
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += n * self.block_size
        return hits, n * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[Sequence[KVCacheBlock]] = ()) -> Optional[list[KVCacheBlock]]:
        """``KVCacheManager.allocate_slots`` for every group at once: each group first frees
        what its window has left, then either every group gets its blocks or (the pool too
        small for all of them) none does and None is returned."""
        hits = list(new_computed_blocks) or [()] * len(self.groups)
        needed = evictable = 0
        for m, h in zip(self.groups, hits):
            m.free_out_of_window(request)
            n, e = m.blocks_needed(request, num_new_tokens, h)
            needed, evictable = needed + n, evictable + e
        if needed > self.pool.get_num_free_blocks() - evictable:
            return None
        fresh: list[KVCacheBlock] = []
        for m, h in zip(self.groups, hits):
            fresh += m.commit_slots(request, m.blocks_needed(request, num_new_tokens, h)[0], h)
        return fresh

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for m in self.groups:
            m.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        """Release the request's blocks in every group (the windowed groups' first, so the
        pool evicts those cached blocks before the full group's)."""
        for m in reversed(self.groups):
            m.free(request)

    def fork(self, parent: Request, child: Request) -> Optional[list[tuple[int, int]]]:
        """``KVCacheManager.fork`` in every group; the partial block is copied in every
        group or (fewer free blocks than groups that need a copy) in none, so the child's
        tables agree on what it recomputes. Returns the (src, dst) copies, or None."""
        need = sum(1 for m in self.groups if m.needs_fork_copy(parent))
        allow = need <= self.pool.get_num_free_blocks()
        copies = [c for m in self.groups if (c := m.fork(parent, child, allow)) is not None]
        return copies or None

    def trim(self, request: Request, num_tokens: int) -> None:
        for m in self.groups:
            m.trim(request, num_tokens)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.groups[0].get_block_ids(request_id)

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table in each group (the null block, 0, where freed)."""
        return [m.get_block_ids(request_id) for m in self.groups]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list:
        return self.groups[0].take_events()
