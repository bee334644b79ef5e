"""HybridKVCacheManager: a full-attention KV cache group and windowed groups sharing one
block pool (Gemma 2/3). The windowed groups free the blocks their window has left while the
full group keeps all; a prefix hit is a length every group can serve; allocations, forks
and frees keep the groups' tables in step; the scheduler sizes requests by both."""
import pytest

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.kv_cache_coordinator import HybridKVCacheManager
from llmserve.core.kv_cache_manager import GROUP_KEY_STRIDE, max_blocks_held
from llmserve.core.kv_events import BlockRemoved, BlockStored
from llmserve.core.request import Request
from llmserve.core.scheduler import Scheduler
from llmserve.sampling_params import SamplingParams
from tests.core.sched_utils import compute_tokens, run_step

BS, W = 4, 8
GROUPS = [None, W, W]  # a full group and two windowed ones (Gemma 3's shape, small)


def _req(rid, toks, **kw):
    return Request(rid, toks, SamplingParams(**kw), eos_token_id=None)


def _run(m, r: Request, upto: int, first: int = 0) -> list[list[int]]:
    """Compute r's tokens up to ``upto`` (``first`` in one step if none is computed yet,
    then one a step); the blocks each group holds after each step."""
    return compute_tokens(m, r, upto, first, lambda m, r: m.group_num_used_blocks(r.request_id))


def _nulls(ids: list[int]) -> int:
    return next((i for i, b in enumerate(ids) if b != 0), len(ids))


def test_windowed_groups_hold_their_window_while_the_full_group_holds_all():
    m = HybridKVCacheManager(64, BS, GROUPS)
    r = _req("a", list(range(60)))
    held = _run(m, r, 60, first=10)
    # 60 tokens: 15 blocks in the full group; at most 3 in each windowed group (the
    # current block and the two the window of its first token reaches).
    assert held[-1] == [15, 3, 3] and max(h[1] for h in held) == 3
    assert m.num_used_blocks == 21
    tables = m.get_group_block_ids("a")
    assert [len(t) for t in tables] == [15, 15, 15]
    assert _nulls(tables[0]) == 0 and _nulls(tables[1]) == _nulls(tables[2]) == 12
    ids = [b for t in tables for b in t if b]
    assert len(ids) == len(set(ids))  # no block in two groups
    assert m.get_block_ids("a") == tables[0]
    m.free(r)
    assert m.num_used_blocks == 0 and m.pool.blocks[0].ref_cnt == 0


def test_allocation_is_all_groups_or_none():
    m = HybridKVCacheManager(10, BS, GROUPS)  # 9 usable blocks
    r = _req("a", list(range(16)))
    assert m.allocate_slots(r, 12) is not None  # 3 blocks per group
    assert m.num_used_blocks == 9
    r.num_computed_tokens = 12
    # One more block per group (3) while none is free: nothing is taken in any group.
    assert m.allocate_slots(r, 4) is None
    assert [len(t) for t in m.get_group_block_ids("a")] == [3, 3, 3]


def test_prefix_hit_needs_the_full_prefix_and_each_windows_last_blocks():
    m = HybridKVCacheManager(64, BS, GROUPS)
    toks = list(range(100, 141))  # 41 tokens: 10 full blocks
    a = _req("a", toks)
    _run(m, a, 41)
    m.free(a)
    b = _req("b", toks + [7, 8, 9])
    hits, n = m.get_computed_blocks(b)
    # 44 tokens: 10 blocks may hit; the full group has all 10, each windowed group the
    # two the window of token 40 reaches ((40 - 7) // 4 = 8): blocks 0-7 are null there.
    assert n == 40 and [len(h) for h in hits] == [10, 10, 10]
    assert 0 not in [x.block_id for x in hits[0]]
    assert all(_nulls([x.block_id for x in h]) == 8 for h in hits[1:])
    # The same chain hash names a different block in each group.
    assert len({hits[0][9].block_id, hits[1][9].block_id, hits[2][9].block_id}) == 3
    assert m.allocate_slots(b, 4, hits) is not None
    assert m.group_num_used_blocks("b") == [11, 3, 3]
    m.free(b)

    # A windowed group missing a block inside the last window cuts the hit to the longest
    # length every group serves: block 8 of group 2 gone -> hits ending at blocks 9-10 are
    # out for it; at 8 blocks (32 tokens) it needs blocks 6-7, which it has.
    gone = m.groups[2].req_to_blocks  # (empty: the request is freed; find the block by key)
    key = b.block_hashes[8] + 2 * GROUP_KEY_STRIDE
    blk = m.pool.cached.pop(key)
    blk.block_hash = None
    hits, n = m.get_computed_blocks(_req("c", toks + [1]))
    assert gone == {} and n == 32 and [len(h) for h in hits] == [8, 8, 8]
    # The full group's first block gone: no hit at all, whatever the windows hold.
    blk = m.pool.cached.pop(b.block_hashes[0])
    blk.block_hash = None
    assert m.get_computed_blocks(_req("d", toks + [1]))[1] == 0


def test_fork_copies_every_groups_partial_block_or_none():
    m = HybridKVCacheManager(64, BS, GROUPS)
    toks = list(range(30))
    p = _req("p", toks)
    _run(m, p, 30, first=26)
    c = _req("c", toks)
    copies = m.fork(p, c)  # 7 full blocks + 2 tokens: each group's partial block copied
    assert len(copies) == 3 and len({d for _, d in copies}) == 3
    for tp, tc in zip(m.get_group_block_ids("p"), m.get_group_block_ids("c")):
        assert tc[:-1] == tp[:-1] and tc[-1] != tp[-1]
    m.free(c)
    # Two free blocks, three groups to copy: no group copies, the child keeps full blocks.
    tight = HybridKVCacheManager(25, BS, GROUPS)
    p2 = _req("p", toks)
    _run(tight, p2, 30, first=26)
    while tight.pool.get_num_free_blocks() > 2:
        tight.pool.get_new_blocks(1)
    c2 = _req("c", toks)
    assert tight.fork(p2, c2) is None
    assert [len(t) for t in tight.get_group_block_ids("c")] == [7, 7, 7]


def test_trim_and_kv_events_of_the_first_group_only():
    m = HybridKVCacheManager(64, BS, GROUPS, enable_kv_cache_events=True)
    r = _req("a", list(range(20)))
    assert m.allocate_slots(r, 20 + 6) is not None  # with 6 draft tokens: 7 blocks each
    r.num_computed_tokens = 20
    m.cache_blocks(r, 20)
    m.trim(r, 21)  # drafts rejected: back to ceil(21 / 4) = 6 blocks in every group
    assert [len(t) for t in m.get_group_block_ids("a")] == [6, 6, 6]
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 5  # group 0's five full blocks, once
    m.free(r)
    m.pool.get_new_blocks(m.pool.get_num_free_blocks())  # evicts every cached block
    removed = [h for e in m.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(r.block_hashes[:5])


def _scheduler(num_blocks, budget, groups, max_len=128):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=max_len),
                     CacheConfig(block_size=BS, enable_prefix_caching=True), num_blocks, kv_cache_groups=groups)


def test_scheduler_runs_preempts_and_recomputes_with_groups():
    """Two 48-token requests on a pool that cannot hold both whole in every group: one is
    preempted and comes back through a prefix hit (null blocks in the windowed groups),
    both finish, every block returns; the steps carry every group's tables."""
    s = _scheduler(34, 8, GROUPS)
    for i in range(2):
        s.add_request(_req(f"r{i}", list(range(i * 50, i * 50 + 16)), max_tokens=32, ignore_eos=True))
    done, saw_groups = {}, False
    while s.get_num_unfinished_requests():
        so, outs = run_step(s)
        for x in so.scheduled:
            saw_groups |= len(x.group_block_ids) == 3 and x.group_block_ids[0] == x.block_ids
            assert x.block_ids and all(len(t) == len(x.block_ids) for t in x.group_block_ids)
        for o in outs:
            done[o.request_id] = done.get(o.request_id, 0) + len(o.new_token_ids)
    assert done == {"r0": 32, "r1": 32} and saw_groups
    assert s.num_preemptions_total >= 1
    assert s.kv_cache_manager.num_used_blocks == 0 and s.kv_cache_manager.pool.blocks[0].ref_cnt == 0
    # A request larger than the pool in all groups is refused at once: 12 full-group
    # blocks + 2 windowed groups x min(12, ceil((8 + 8) / 4) + 3 = 7) = 26 > 20.
    with pytest.raises(ValueError, match="needs up to 48 tokens"):
        _scheduler(21, 8, GROUPS).add_request(_req("x", list(range(16)), max_tokens=32))
    assert max_blocks_held(GROUPS, 48, BS, 8) == 26


def test_connector_needs_one_group():
    with pytest.raises(ValueError, match="kv_cache_groups"):
        Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8, max_model_len=128),
                  CacheConfig(block_size=BS), 32, kv_cache_groups=GROUPS, kv_connector=object())


def gemma3_1b_long_conversation(free: bool) -> dict:
    """Scheduler simulation with Gemma 3 1B's KV layout: 26 layers, 4 full-attention and
    22 with a 512-token window, grouped 4 layers a group (worker/kv_cache_groups.py: one
    full group, six windowed); 16-token blocks, 2,048-token steps; one 16,000-token
    conversation plus 384 new tokens. ``free`` False: one group of all 26 layers (no
    freeing, as before). Returns peak blocks, blocks held while decoding, and the bytes
    they stand for (bf16, 1 KV head of 256: 16 KiB per layer per block)."""
    groups = [None] + [512] * 6 if free else [None]
    layers_per_block = 4 if free else 26
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=32768),
                  CacheConfig(block_size=16, enable_prefix_caching=True), 4096, kv_cache_groups=groups)
    s.add_request(_req("chat", [i % 30000 for i in range(16000)], max_tokens=384, ignore_eos=True))
    peak = decoding = 0
    while s.get_num_unfinished_requests():
        so, _ = run_step(s)
        used = s.kv_cache_manager.num_used_blocks
        peak = max(peak, used)
        if so.scheduled and so.scheduled[0].num_scheduled_tokens == 1:
            decoding = max(decoding, used)
    kib = 2 * 16 * 256 * 2 * layers_per_block / 1024
    return {"peak_blocks": peak, "decode_blocks": decoding, "peak_mib": peak * kib / 1024,
            "decode_mib": decoding * kib / 1024}


def test_gemma3_1b_long_conversation_holds_the_windows_not_the_history():
    """The figure of the commit: with groups the 16,384-token request peaks at 1,856
    blocks of 4 layers (at the seventh 2,048-token chunk: 896 in the full group and 160
    in each windowed one, the chunk and the window before it: 116 MiB) and decodes
    with 1,222 (1,024 + 6 x 33:
    76 MiB), against 1,024 blocks of all 26 layers (416 MiB) without freeing."""
    hybrid, plain = gemma3_1b_long_conversation(True), gemma3_1b_long_conversation(False)
    assert plain == {"peak_blocks": 1024, "decode_blocks": 1024, "peak_mib": 416.0, "decode_mib": 416.0}
    assert hybrid["peak_blocks"] == 1856 and hybrid["decode_blocks"] == 1024 + 6 * 33
    assert hybrid["peak_mib"] == 116.0 and hybrid["decode_mib"] < 76.5
