"""Tier warm-up (issue 32, llmserve/kv_transfer/tier_restore.py): an engine started over an
existing disk tier restores the tier's most recently used chains into its RAM prefix cache,
so the repeat of a prompt is a RAM hit (cached tokens, no load on the request path) with
the cold run's greedy tokens; the bound (restore_on_start) keeps whole chains from their
first block; a corrupt file is skipped; the switch turns it off; a request that arrives
mid-restore is served correctly; the chain picking and the pool's part, alone."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.core.kv_cache_manager import BlockPool, hash_block_tokens
from llmserve.kv_transfer import disk_store
from llmserve.kv_transfer.disk_store import SUFFIX, block_dir, encode_header, layout_key, recent_chains
from llmserve.kv_transfer.tier_restore import make_tier_restore

PROMPT = [int(t) for t in torch.randint(5, 250, (100,), generator=torch.Generator().manual_seed(2))]
FULL_BLOCKS = (len(PROMPT) - 1) // 16  # 6 blocks of 16 tokens a hit can take
# with logprobs: a restored or loaded block must give the cold run's numbers, not only its tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)


@pytest.fixture(scope="module")
def written(tmp_path_factory, save_tiny_model_fn):
    """A tiny float32 checkpoint, a tier holding PROMPT's blocks, the cold run's greedy
    tokens, and the engine's KV cache size in blocks."""
    path = str(tmp_path_factory.mktemp("restore_model"))
    save_tiny_model_fn("llama", path)
    tier = str(tmp_path_factory.mktemp("restore_tier"))
    llm = _llm(path, tier)
    tokens, cached = _run(llm)
    num_blocks = _core(llm).num_blocks
    llm.shutdown()  # flushes the writer
    assert cached == 0 and len(_files(tier)) == FULL_BLOCKS
    return path, tier, tokens, num_blocks


def _llm(model: str, tier: str, **extra) -> LLM:
    return LLM(model, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
               kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=64,
               kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"shared_storage_path": tier, **extra}})


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def _run(llm: LLM):
    """((greedy token ids, each step's top logprobs), cached prompt tokens)."""
    out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0]
    logprobs = [sorted((t, lp.logprob) for t, lp in step.items()) for step in out.outputs[0].logprobs]
    return (list(out.outputs[0].token_ids), logprobs), out.num_cached_tokens


def _files(path) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".kv"))


def _hashes() -> list[int]:
    out, parent = [], 0
    for i in range(FULL_BLOCKS):
        parent = hash_block_tokens(parent, PROMPT[i * 16:(i + 1) * 16])
        out.append(parent)
    return out


def _copy_tier(src: str, dst) -> str:
    """A copy of the tier (mtimes kept), so a test may damage it."""
    import shutil

    shutil.copytree(src, dst, copy_function=shutil.copy2)
    return str(dst)


def _stats_totals(llm: LLM) -> dict:
    """The scheduler-side connector's counters since start, summed over the engine's
    stats (each step takes them)."""
    conn, totals = _core(llm).scheduler.connector, {}
    take = conn.get_stats

    def spy():
        st = take()
        for k, v in st.items():
            totals[k] = totals.get(k, 0) + v
        return st
    conn.get_stats = spy
    spy()  # what the restore at start counted
    return totals


def _cached_hashes(llm: LLM) -> set[int]:
    return {h for h in _hashes() if _core(llm).scheduler.kv_cache_manager.pool.get_cached_block(h) is not None}


def test_restart_restores_the_prompt_into_ram_and_serves_the_cold_tokens(written, tmp_path):
    model, tier, cold, _ = written
    tier = _copy_tier(tier, tmp_path / "tier")
    llm = _llm(model, tier)  # restore_on_start defaults to on
    totals = _stats_totals(llm)
    assert _cached_hashes(llm) == set(_hashes())  # in the RAM prefix cache before any request
    assert _run(llm) == (cold, FULL_BLOCKS * 16)
    block = _core(llm).scheduler.connector.block_nbytes
    # the hit came from RAM: nothing read from the tier on the request path
    assert totals["blocks_restored"] == FULL_BLOCKS and totals["bytes_restored"] == FULL_BLOCKS * block
    assert totals["hits"] == 0 and totals["bytes_loaded"] == 0
    assert _core(llm)._tier_restore is None  # done
    llm.shutdown()


def test_bound_restores_a_chain_from_its_first_block_and_the_rest_loads_on_demand(written, tmp_path):
    model, tier, cold, num_blocks = written
    tier = _copy_tier(tier, tmp_path / "tier")
    share = 2.5 / (num_blocks - 1)  # at most 2 blocks of the pool
    llm = _llm(model, tier, restore_on_start=share)
    totals = _stats_totals(llm)
    assert _cached_hashes(llm) == set(_hashes()[:2])
    assert _run(llm) == (cold, FULL_BLOCKS * 16)
    assert totals["blocks_restored"] == 2 and totals["hits"] == (FULL_BLOCKS - 2) * 16  # 4 from disk
    llm.shutdown()


def test_corrupt_file_is_skipped_at_restore_with_its_descendants(written, tmp_path, caplog):
    model, tier, cold, _ = written
    tier = _copy_tier(tier, tmp_path / "tier")
    bad = [p for p in _files(tier) if os.path.basename(p) == f"{_hashes()[3]:016x}.kv"][0]
    with open(bad, "r+b") as f:  # the right size, a wrong payload: found by the XXH3 check
        f.seek(disk_store.HEADER_SIZE + 9)
        f.write(b"\x01\x02\x03")
    with caplog.at_level(logging.INFO):
        llm = _llm(model, tier)
    assert "checksum mismatch" in caplog.text and not os.path.exists(bad)
    assert "restored 3 blocks" in caplog.text and "3 blocks skipped" in caplog.text
    assert _cached_hashes(llm) == set(_hashes()[:3])  # block 3 failed; 4 and 5 hang from it
    assert _run(llm) == (cold, 3 * 16)  # block 3 is gone from disk too: computed from there
    llm.shutdown()


def test_with_kv_events_a_block_without_its_token_file_is_not_restored_nor_its_descendants(written, tmp_path, caplog):
    """KV events announce each restored block with its tokens (kept beside the block
    files): a block whose token file is gone (a tier written before they were kept) is
    not restored where events are on, nor anything chained after it; without events it
    is restored as before."""
    model, tier, cold, _ = written
    tier = _copy_tier(tier, tmp_path / "tier")
    tok = [os.path.join(d, f) for d, _, fs in os.walk(tier) for f in fs if f == f"{_hashes()[3]:016x}.tok"]
    assert len(tok) == 1 and len([f for f in os.listdir(os.path.dirname(tok[0])) if f.endswith(".tok")]) == FULL_BLOCKS
    os.unlink(tok[0])
    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/ev", "replay_endpoint": f"ipc://{tmp_path}/rp"}
    with caplog.at_level(logging.INFO):
        llm = LLM(model, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
                  kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=64, kv_events_config=events,
                  kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                                      "kv_connector_extra_config": {"shared_storage_path": tier}})
    assert "restored 3 blocks" in caplog.text and "3 blocks not restored (no token ids" in caplog.text
    assert _cached_hashes(llm) == set(_hashes()[:3])
    assert _run(llm) == (cold, FULL_BLOCKS * 16)  # the other 3 load from disk on demand
    llm.shutdown()
    llm = _llm(model, tier)  # events off: the token files are not needed
    assert _cached_hashes(llm) == set(_hashes())
    llm.shutdown()


def test_restore_off_and_bad_values(written, tmp_path):
    model, tier, cold, _ = written
    tier = _copy_tier(tier, tmp_path / "tier")
    for off in (False, 0):
        llm = _llm(model, tier, restore_on_start=off)
        totals = _stats_totals(llm)
        assert _cached_hashes(llm) == set() and _core(llm)._tier_restore is None
        assert _run(llm) == (cold, FULL_BLOCKS * 16)  # loaded from disk on demand
        assert totals["hits"] == FULL_BLOCKS * 16 and totals["blocks_restored"] == 0
        llm.shutdown()
    for bad in (1.5, -0.1, "yes", None):
        with pytest.raises(ValueError, match="restore_on_start"):
            _llm(model, tier, restore_on_start=bad)


def test_request_arriving_mid_restore_is_served_and_the_rest_skips_its_blocks(written, tmp_path, monkeypatch):
    model, tier, cold, num_blocks = written
    tier = _copy_tier(tier, tmp_path / "tier")
    llm = _llm(model, tier, restore_on_start=False)
    core = _core(llm)
    totals = _stats_totals(llm)
    conn = core.scheduler.connector
    conn.restore_share = 0.5
    monkeypatch.setattr("llmserve.kv_transfer.tier_restore.TierRestore.CHUNK_BYTES", 2 * conn.block_nbytes)
    core._tier_restore = make_tier_restore(conn, core.scheduler.kv_cache_manager.pool, True)
    assert core.restore_kv_tier()  # one chunk: the first 2 blocks
    assert _cached_hashes(llm) == set(_hashes()[:2])
    # a request for the first 4 blocks (and a partial one): 2 from RAM, blocks 2-3 from disk
    out = llm.generate([{"prompt_token_ids": PROMPT[:72]}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 4 * 16 and totals["hits"] == 2 * 16
    assert _cached_hashes(llm) == set(_hashes()[:4])
    while core.restore_kv_tier():  # the rest: the chunk of blocks 2-3 is cached already, 4-5 are restored
        pass
    assert _cached_hashes(llm) == set(_hashes())
    assert core.tier_restore_done.blocks == 2 + 2 and core.tier_restore_done.failed == 0
    assert _run(llm) == (cold, FULL_BLOCKS * 16) and totals["hits"] == 2 * 16  # all from RAM
    assert totals["blocks_restored"] == 2 + 2  # counted by the step's stats
    llm.shutdown()


def _write(folder: str, key: bytes, h: int, parent: int, payload: bytes, mtime: float) -> None:
    path = os.path.join(folder, f"{h:016x}.kv")
    with open(path, "wb") as f:
        f.write(encode_header(key, h, parent, payload) + payload)
    os.utime(path, (mtime, mtime))


def test_recent_chains_takes_whole_chains_newest_first(tmp_path):
    key = layout_key({"model": "chains"})
    folder = block_dir(str(tmp_path), key)
    payload = b"k" * 64
    # a tree: 1 -> 2 -> 3 and 1 -> 4 (4 used last); 8's parent 7 is missing; 9 is another
    # layout's; 11 and 12 name each other as parent (a corrupt pair must not loop)
    for h, parent, mtime in ((1, 0, 100), (2, 1, 101), (3, 2, 102), (4, 1, 300), (8, 7, 250), (11, 12, 240),
                             (12, 11, 240)):
        _write(folder, key, h, parent, payload, mtime)
    _write(folder, layout_key({"model": "other"}), 9, 0, payload, 400)
    _write(folder, key, 5, 0, b"short", 500)  # the wrong size: damaged, removed
    names = set(os.listdir(folder))
    assert recent_chains(folder, key, len(payload), 100) == [(0, [1, 4]), (1, [2, 3])]
    assert names - set(os.listdir(folder)) == {f"{5:016x}{SUFFIX}"}
    assert recent_chains(folder, key, len(payload), 3) == [(0, [1, 4]), (1, [2])]
    assert recent_chains(folder, key, len(payload), 1) == [(0, [1])]
    assert recent_chains(folder, key, len(payload), 0) == []


def test_pool_takes_only_blocks_without_a_prefix_and_queues_restored_ones_as_oldest():
    pool = BlockPool(8, enable_caching=True, cache_floor_blocks=0)
    a, b, c = pool.get_new_blocks(3)  # ids 1, 2, 3
    pool.cache_block(a, 100)
    pool.free_blocks([a, b])  # a: cached, at the tail; b: no prefix, at the head
    got = pool.take_unused_blocks(10)  # b, then the never-used 4..7; a keeps its prefix
    assert [x.block_id for x in got] == [2, 4, 5, 6, 7] and pool.get_cached_block(100) is a
    r1, r2, spare = got[0], got[1], got[2]
    pool.cache_block(r1, 201)
    pool.cache_block(r2, 202)
    pool.free_blocks([spare])  # no prefix: reused first
    pool.free_restored([r2, r1])  # r2 to be evicted first
    assert list(pool.free_queue) == [spare.block_id, r2.block_id, r1.block_id, a.block_id]
    assert all(x.ref_cnt == 0 for x in (r1, r2, spare)) and c.ref_cnt == 1
