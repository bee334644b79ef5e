"""Issue 16: the idle KV prefault follows use. It stays ``KV_PREFAULT_HEADROOM_BYTES`` past
the highest block a step has used, so an idle engine holds little of a large KV cache."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from llmserve.config import CacheConfig
from llmserve.worker.model_runner import ModelRunner


def _runner(num_blocks: int) -> ModelRunner:
    mc = SimpleNamespace(device="cpu", dtype="float32", runner="generate", seed=0, is_encoder_only=False, is_encoder_decoder=False,
                         num_layers=2, num_kv_heads=1, head_dim=64)
    cfg = SimpleNamespace(model_config=mc, cache_config=CacheConfig(block_size=16), num_threads=None)
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


def test_a_kv_tier_that_loads_gets_one_sequence_of_blocks_prefaulted_at_start():
    r = _runner(64)
    r.model_config.max_model_len = 160  # 10 blocks
    r.kv_connector = SimpleNamespace(can_load=True)
    r._prefault_for_kv_tier()
    r._kv_tier_prefault.join()
    assert r._kv_prefault_next == 10 + 4 and not r.kv_prefault_done()  # one sequence + the headroom
    r.kv_connector = SimpleNamespace(can_load=False)  # kv_producer: loads nothing, no thread
    r._kv_prefault_limit = 4
    r._prefault_for_kv_tier()
    assert r._kv_prefault_limit == 4


def test_a_cache_within_the_headroom_is_prefaulted_whole():
    r = _runner(3)
    assert _drain(r) == 3 and r.kv_prefault_done()


def _kv_mapping_stats(r: ModelRunner) -> dict:
    """Rss / AnonHugePages (kB) of the mapping that holds the KV buffer."""
    import re
    addr, found, out = r._kv_addr, False, {}
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                found = int(m.group(1), 16) <= addr < int(m.group(2), 16)
            elif found and line.split(":")[0] in ("Rss", "AnonHugePages"):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def _resident_kib(addr: int, nbytes: int) -> int:
    """KiB of [addr, addr + nbytes) present in RAM, from /proc/self/pagemap (bit 63 of each
    page's entry). Not the smaps mapping's Rss: the kernel merges adjacent anonymous mappings,
    so after other tests in the same process the KV buffer's mapping may hold their memory too
    (seen: 925 MB Rss in the full suite)."""
    page = 4096
    first, last = addr // page, (addr + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * page // 1024


def test_small_use_faults_small_pages_and_large_use_advises_huge_ones():
    """Each of the 2 x num_layers regions would hold a whole 2 MiB page after the first
    request if the cache had huge pages from the start (numpy advises them): 120 MiB
    for SmolLM2's 60 regions. Small pages until the use passes KV_HUGE_PAGES_FROM_BYTES."""
    r = _runner(8192)  # 2 layers x K/V x 8192 blocks x 4 KiB = 128 MiB
    r.KV_HUGE_PAGES_FROM_BYTES = 64 << 20
    _drain(r)
    assert _kv_mapping_stats(r).get("AnonHugePages", 0) == 0
    assert _resident_kib(r._kv_addr, r._kv_nbytes) <= 2 * 4 * 16 + 64  # 4 headroom blocks x 4 regions x 4 KiB, + slack
    assert not r._kv_huge
    r._note_kv_use(np.array([[4500]], dtype=np.int32))  # 4505 blocks x 16 KiB: past 64 MiB
    assert r._kv_huge


_DIRTY_HEAP = """
import sys
sys.path.insert(0, {tests!r})
from llmserve.engine.core import _keep_freed_memory
_keep_freed_memory()  # as the engine process: glibc serves blocks under 1 GiB from the heap
import numpy as np
junk = np.ones(300 << 20, dtype=np.uint8)
del junk  # a loader's temporaries, freed into the heap
from test_kv_prefault_headroom import _runner, _resident_kib
r = _runner(8192)  # 128 MiB
print(_resident_kib(r._kv_addr, r._kv_nbytes))
"""


def test_a_fresh_cache_is_not_resident_after_the_engines_heap_was_used():
    """The engine's mallopt (M_MMAP_THRESHOLD 1 GiB) made numpy's calloc take a 128 MiB cache
    from the heap, which clears reused memory: all 131,076 KiB resident before any request
    (a CI run saw it in the test process too). The cache has a mapping of its own now."""
    import os
    import subprocess
    import sys
    code = _DIRTY_HEAP.format(tests=os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) <= 64  # nothing touched yet (slack for a page or two)
