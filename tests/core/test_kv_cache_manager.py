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


def _run_one(m, rid, toks):
    r = _req(rid, toks)
    hits, n = m.get_computed_blocks(r)
    r.num_computed_tokens = 0
    assert m.allocate_slots(r, len(toks) - n, hits) is not None
    r.num_computed_tokens = len(toks)
    m.cache_blocks(r, len(toks))
    m.free(r)
    return n


def test_freed_blocks_are_reused_before_fresh_ones():
    """Memory follows use (issue 16): 200 distinct 3-block prompts one after another in a
    1000-block pool touch only the blocks one of them needs, and a prompt sent again
    right after itself still hits the prefix cache."""
    m = KVCacheManager(num_blocks=1000, block_size=4, cache_floor_tokens=0)
    used = set()
    for i in range(200):
        toks = [i * 100 + j for j in range(10)]
        _run_one(m, f"r{i}", toks)
        assert _run_one(m, f"again{i}", toks) == 8  # its 2 full blocks are still cached
        used |= {b.block_id for b in m.pool.blocks if b.block_hash is not None}
    assert max(used) <= 3 and m.pool.next_fresh <= 4
    assert m.pool.get_num_free_blocks() == 999


def test_fresh_blocks_when_the_live_batch_grows():
    m = KVCacheManager(num_blocks=100, block_size=4, cache_floor_tokens=0)
    reqs = [_req(f"r{i}", list(range(i * 50, i * 50 + 8))) for i in range(10)]
    for r in reqs:
        assert m.allocate_slots(r, 8) is not None  # 10 live requests x 2 blocks
    assert m.pool.next_fresh == 21 and m.num_used_blocks == 20
    for r in reqs:
        m.free(r)
    r = _req("x", list(range(1000, 1040)))
    m.allocate_slots(r, 40)  # 10 blocks: all from the freed ones
    assert max(m.get_block_ids("x")) <= 20 and m.pool.next_fresh == 21


def test_prefix_cache_fills_the_floor_before_evicting():
    """Up to the floor (here 40 tokens = 10 blocks) cached prefixes stay and fresh blocks are
    used; past it, the least recently used cached blocks are reused."""
    m = KVCacheManager(num_blocks=1000, block_size=4, cache_floor_tokens=40)
    prompts = [[i * 100 + j for j in range(8)] for i in range(8)]  # 2 full blocks each
    for i, toks in enumerate(prompts[:4]):
        _run_one(m, f"r{i}", toks)
    assert m.pool.next_fresh == 9  # 8 blocks, all still cached
    assert _run_one(m, "again0", prompts[0] + [1]) == 8
    for i, toks in enumerate(prompts[4:]):
        _run_one(m, f"s{i}", toks)
    assert m.pool.next_fresh <= 12  # the floor, then reuse
    assert _run_one(m, "again7", prompts[7] + [1]) == 8  # the most recent ones are cached
