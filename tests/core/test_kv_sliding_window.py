"""KVCacheManager with a sliding window on every layer: blocks the window has left are freed
while the request runs (the null block, id 0, takes their place in its table), prefix hits
need only the last window's blocks, forks and preemption keep the counts right."""
import pytest

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.request import Request
from llmserve.core.scheduler import Scheduler
from llmserve.sampling_params import SamplingParams
from tests.core.sched_utils import compute_tokens, run_step

BS, W = 4, 8  # a query at position p reads keys p - 7 .. p


def _req(rid, toks, **kw):
    return Request(rid, toks, SamplingParams(**kw), eos_token_id=None)


def _run(m: KVCacheManager, r: Request, upto: int, first: int = 0) -> list[int]:
    """Compute r's tokens up to ``upto``: ``first`` of them (0: all) in one step if none
    is computed yet, then one a step. Returns the blocks in use after each step."""
    return compute_tokens(m, r, upto, first)


def _leading_nulls(ids: list[int]) -> int:
    return next((i for i, b in enumerate(ids) if b != 0), len(ids))


def test_blocks_the_window_left_are_freed_while_running():
    m = KVCacheManager(num_blocks=32, block_size=BS, sliding_window=W)
    full = KVCacheManager(num_blocks=32, block_size=BS)
    toks = list(range(60))
    r, f = _req("a", toks), _req("a", toks)
    used, used_full = _run(m, r, 60, first=10), _run(full, f, 60, first=10)
    # Before a step from c computed tokens, the blocks wholly before (c // 4 * 4) - 7 are
    # freed: the two the window of the current block's first token reaches, and that block.
    assert max(used) == 3 and used[-1] == 3, used
    assert used_full[-1] == 15
    ids = m.get_block_ids("a")
    # At 59 computed tokens (the last step's start): (56 - 7) // 4 = 12 null blocks.
    assert len(ids) == 15 and _leading_nulls(ids) == 12 and 0 not in ids[12:]
    null = m.pool.blocks[0]
    assert null.ref_cnt == 0 and null.block_hash is None and 0 not in m.pool.free_queue
    assert m.usage < full.usage
    m.free(r)
    assert m.num_used_blocks == 0 and m.pool.get_num_free_blocks() == 31


def test_window_hit_needs_only_the_last_window_and_never_a_null_block():
    m = KVCacheManager(num_blocks=40, block_size=BS, sliding_window=W)
    toks = list(range(100, 141))  # 41 tokens: 10 full blocks
    a = _req("a", toks)
    _run(m, a, 41)
    m.free(a)
    # The first three blocks are evicted (handed to another request); the rest stay cached.
    for b in m.pool.blocks[1:4]:
        m.pool.cached.pop(b.block_hash)
        b.block_hash = None
    b = _req("b", toks + [7, 8, 9])
    blocks, n = m.get_computed_blocks(b)
    # 44 tokens: up to 10 blocks may hit; the window of token 40 needs blocks 8 and 9
    # ((40 - 7) // 4 = 8), all cached: the hit is whole, blocks 0-7 are null placeholders.
    assert n == 40 and [x.block_id for x in blocks[:8]] == [0] * 8
    assert [x.block_id for x in blocks[8:]] == [9, 10]
    assert m.allocate_slots(b, 4, blocks) is not None
    assert m.num_used_blocks == 3 and m.pool.blocks[0].ref_cnt == 0
    # A full-attention manager finds nothing: block 0 of the chain is gone.
    plain = KVCacheManager(num_blocks=40, block_size=BS)
    plain.pool = m.pool
    assert plain.get_computed_blocks(_req("c", toks + [7]))[1] == 0


def test_window_hit_stops_before_a_missing_block_inside_the_window():
    m = KVCacheManager(num_blocks=40, block_size=BS, sliding_window=W)
    toks = list(range(200, 241))
    a = _req("a", toks)
    _run(m, a, 41)
    m.free(a)
    gone = m.pool.blocks[9]  # block index 8 of the request (ids start at 1)
    m.pool.cached.pop(gone.block_hash)
    gone.block_hash = None
    blocks, n = m.get_computed_blocks(_req("b", toks + [1]))
    # Hits ending at blocks 9 or 10 need block 8 (missing); the longest one left ends
    # at block 8 (32 tokens, needing blocks 6 and 7).
    assert n == 32 and _leading_nulls([x.block_id for x in blocks]) == 6
    assert all(x.block_hash is not None for x in blocks[6:])


def test_fork_shares_the_window_and_frees_cleanly():
    m = KVCacheManager(num_blocks=32, block_size=BS, sliding_window=W)
    toks = list(range(30))
    p = _req("p", toks)
    _run(m, p, 30, first=26)
    used = m.num_used_blocks
    c = _req("c", toks)
    copy = m.fork(p, c)  # 30 = 7 full blocks + 2 tokens: the partial block is copied
    assert copy is not None and m.num_used_blocks == used + 1
    ids_p, ids_c = m.get_block_ids("p"), m.get_block_ids("c")
    assert ids_c[:-1] == ids_p[:-1] and _leading_nulls(ids_c) == _leading_nulls(ids_p) > 0
    c.num_computed_tokens = 30
    for x in (p, c):
        x.append_output_token_ids([1, 2, 3, 4, 5, 6])
    _run(m, c, 36)
    _run(m, p, 36)
    m.free(p)
    m.free(c)
    assert m.num_used_blocks == 0 and m.pool.blocks[0].ref_cnt == 0


def test_scheduler_frees_window_blocks_and_preempts_and_recomputes():
    """On an 8-block pool two 48-token requests (12 blocks each: refused without the
    window) run side by side, 8-token steps, none preempted; the window lets each hold at
    most ceil((8 + 8) / 4) + 3 = 7 blocks. A preempted request comes back through a
    window prefix hit; all finish and every block returns."""
    def sched(num_blocks, budget):
        return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=128),
                         CacheConfig(block_size=BS, enable_prefix_caching=True), num_blocks,
                         kv_sliding_window=W)

    s = sched(9, 8)
    for i in range(2):
        s.add_request(_req(f"r{i}", list(range(i * 50, i * 50 + 16)), max_tokens=32, ignore_eos=True))
    peak = 0
    while s.get_num_unfinished_requests():
        run_step(s)
        peak = max(peak, s.kv_cache_manager.num_used_blocks)
    assert s.num_preemptions_total == 0 and peak <= 8
    assert s.kv_cache_manager.num_used_blocks == 0
    plain = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8, max_model_len=128),
                      CacheConfig(block_size=BS), 9)
    with pytest.raises(ValueError, match="needs up to 48 tokens"):
        plain.add_request(_req("x", list(range(16)), max_tokens=32))

    # Preempted mid-answer (its early blocks already freed), q0 comes back through the
    # prefix cache: a window hit with null blocks before it, then runs to the end.
    s = sched(9, 8)
    for i in range(2):
        s.add_request(_req(f"q{i}", list(range(i * 50, i * 50 + 12)), max_tokens=24, ignore_eos=True))
    done = {}
    q0 = s.requests["q0"]
    while q0.num_computed_tokens < 26:
        for o in run_step(s)[1]:
            done[o.request_id] = done.get(o.request_id, 0) + len(o.new_token_ids)
    ids = s.kv_cache_manager.get_block_ids("q0")
    assert ids[:4] == [0, 0, 0, 0] and 0 not in ids[4:]
    s._preempt(q0)
    so, outs = run_step(s)
    back = next(x for x in so.scheduled if x.request is q0)
    assert back.num_computed_tokens == 24 and back.block_ids[:4] == [0, 0, 0, 0]
    for o in outs:
        done[o.request_id] = done.get(o.request_id, 0) + len(o.new_token_ids)
    while s.get_num_unfinished_requests():
        for o in run_step(s)[1]:
            done[o.request_id] = done.get(o.request_id, 0) + len(o.new_token_ids)
    assert done == {"q0": 24, "q1": 24} and s.num_preemptions_total == 1
    assert s.kv_cache_manager.num_used_blocks == 0 and s.kv_cache_manager.pool.blocks[0].ref_cnt == 0
