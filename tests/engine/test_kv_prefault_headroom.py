"""Issue 16: the idle KV prefault follows use. It stays ``KV_PREFAULT_HEADROOM_BYTES`` past
the highest block a step has used, so an idle engine holds little of a large KV cache."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from llmserve.worker.model_runner import ModelRunner


def _runner(num_blocks: int) -> ModelRunner:
    mc = SimpleNamespace(device="cpu", dtype="float32", runner="generate", seed=0, is_encoder_only=False, is_encoder_decoder=False,
                         num_layers=2, num_kv_heads=1, head_dim=64)
    cfg = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(block_size=16), num_threads=None)
    r = ModelRunner(cfg)
    r.KV_PREFAULT_HEADROOM_BYTES = 4 * 16 * 64 * 4 * 4  # 4 blocks (16 KiB each over 2 layers' K and V)
    r.initialize_kv_cache(num_blocks)
    return r


def _drain(r: ModelRunner) -> int:
    while r.prefault_kv(budget_bytes=16 << 10):
        pass
    return r._kv_prefault_next


def test_prefault_stops_at_the_headroom_and_follows_the_highest_used_block():
    r = _runner(32)
    assert _drain(r) == 4 and not r.kv_prefault_done()  # idle from the start: headroom only
    r._note_kv_use(np.array([[3, 10], [0, 0]], dtype=np.int32))
    assert _drain(r) == 15  # block 10 used: up to 10 + 1 + 4
    r._note_kv_use(np.array([[2]], dtype=np.int32))  # a lower block does not shrink it
    assert _drain(r) == 15
    r._note_kv_use(np.array([[30]], dtype=np.int32))
    assert _drain(r) == 32 and r.kv_prefault_done()  # capped at the cache size


def test_a_cache_within_the_headroom_is_prefaulted_whole():
    r = _runner(3)
    assert _drain(r) == 3 and r.kv_prefault_done()
