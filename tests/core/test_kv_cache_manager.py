"""KVCacheManager: allocation, reference counts, prefix caching, LRU eviction."""
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.request import Request
from llmserve.sampling_params import SamplingParams


def _req(rid, toks, **kw):
    return Request(rid, toks, SamplingParams(**kw), eos_token_id=None)


def test_allocate_and_free_returns_blocks():
    m = KVCacheManager(num_blocks=9, block_size=4)
    r = _req("a", list(range(10)))
    blocks = m.allocate_slots(r, 10)
    assert len(blocks) == 3 and m.num_used_blocks == 3
    assert 0 not in m.get_block_ids("a")  # block 0 is reserved padding
    r.num_computed_tokens = 10
    assert m.allocate_slots(r, 2) == []  # fits in the last block (12 slots)
    assert len(m.allocate_slots(r, 3)) == 1
    m.free(r)
    assert m.num_used_blocks == 0 and m.usage == 0.0


def test_allocation_fails_cleanly_when_full():
    m = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable blocks
    a = _req("a", list(range(8)))
    assert m.allocate_slots(a, 8) is not None
    b = _req("b", list(range(100, 108)))
    assert m.allocate_slots(b, 8) is None
    assert m.num_used_blocks == 2  # nothing changed on failure


def test_prefix_cache_hit_shares_blocks_and_leaves_one_token():
    m = KVCacheManager(num_blocks=20, block_size=4)
    a = _req("a", list(range(12)))
    m.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    m.cache_blocks(a, 12)
    b = _req("b", list(range(12)) + [99])
    blocks, n = m.get_computed_blocks(b)
    assert n == 12 and [x.block_id for x in blocks] == m.get_block_ids("a")
    m.allocate_slots(b, 1, blocks)
    assert m.get_block_ids("b")[:3] == m.get_block_ids("a")
    assert all(x.ref_cnt == 2 for x in blocks)
    # A prompt that is exactly cached still leaves its last token to compute.
    c = _req("c", list(range(12)))
    _, n = m.get_computed_blocks(c)
    assert n == 8


def test_prefix_cache_disabled_and_prompt_logprobs_skip_cache():
    m = KVCacheManager(num_blocks=20, block_size=4, enable_caching=False)
    a = _req("a", list(range(12)))
    m.allocate_slots(a, 12)
    m.cache_blocks(a, 12)
    assert m.get_computed_blocks(_req("b", list(range(13))))[1] == 0
    m2 = KVCacheManager(num_blocks=20, block_size=4)
    a = _req("a", list(range(12)))
    m2.allocate_slots(a, 12)
    m2.cache_blocks(a, 12)
    assert m2.get_computed_blocks(_req("b", list(range(13)), prompt_logprobs=1))[1] == 0


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    m = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable
    a = _req("a", list(range(8)))
    m.allocate_slots(a, 8)
    m.cache_blocks(a, 8)
    m.free(a)
    # Still findable after free.
    b = _req("b", list(range(8)) + [7])
    blocks, n = m.get_computed_blocks(b)
    assert n == 8
    m.allocate_slots(b, 1, blocks)
    assert m.num_used_blocks == 3
    m.free(b)
    # A different request needing all blocks evicts the cached ones.
    c = _req("c", list(range(50, 66)))
    assert m.allocate_slots(c, 16) is not None
    assert m.get_computed_blocks(_req("d", list(range(9))))[1] == 0


def test_hash_chain_depends_on_prefix():
    m = KVCacheManager(num_blocks=20, block_size=4)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7, 8])
    m.allocate_slots(a, 8)
    m.cache_blocks(a, 8)
    # Same second block, different first block: no hit on the second block.
    b = _req("b", [9, 9, 9, 9, 5, 6, 7, 8, 1])
    assert m.get_computed_blocks(b)[1] == 0


def test_large_pool_block_ids_follow_use_not_traffic():
    """Issue 16: a large pool hands out ids below the most blocks ever in use at once
    (rounded up to a grow step), evicting cached free blocks before growing, so the KV
    pages touched follow use; the not-yet-used blocks still count as free."""
    n = 1 + 64 * 1024
    m = KVCacheManager(num_blocks=n, block_size=4)
    step = m.pool.grow_step
    assert step == (n - 1) // 32 and m.pool.num_exposed == 1 + step
    assert m.pool.get_num_free_blocks() == n - 1 and m.usage == 0.0
    # Much more traffic than one step, never more than 40 blocks in use at once.
    for i in range(4 * step // 10):
        r = _req(f"r{i}", [i * 1000 + t for t in range(40)])
        assert len(m.allocate_slots(r, 40)) == 10
        r.num_computed_tokens = 40
        m.cache_blocks(r, 40)
        m.free(r)
    assert m.pool.num_exposed == 1 + step
    # A request larger than what is left grows the pool by what it needs (at least a step).
    big = _req("big", list(range(4 * (step + 100))))
    assert len(m.allocate_slots(big, 4 * (step + 100))) == step + 100
    assert m.pool.num_exposed == 1 + 2 * step  # 100 more were needed: one step
    assert max(m.get_block_ids("big")) < m.pool.num_exposed
    assert m.num_used_blocks == step + 100 and m.pool.get_num_free_blocks() == n - 1 - step - 100
    m.free(big)
    assert m.usage == 0.0 and m.reset_prefix_cache()
    # The whole pool is still usable.
    whole = _req("whole", list(range(4 * (n - 1))))
    assert len(m.allocate_slots(whole, 4 * (n - 1))) == n - 1 and m.pool.num_exposed == n
    assert m.allocate_slots(_req("x", [1, 2]), 2) is None
