"""The C++ disk-tier reader (llmserve/ops/tier_io.py, csrc/tier_io.cpp) against the Python
reads of llmserve/kv_transfer/disk_store.py: its XXH3-64 equals the xxhash package's for any
split of the input; a chain of block files lands in the same cache slots; every kind of bad
file (missing, truncated, longer, corrupted, another layout, an old version, another block)
stops the chain at the same block, and the connector removes the same files with the same
reason; the scheduler's count of files on disk is the same. The engine-level tests
(test_disk_tier.py) run the connector with the C++ reader and without it."""
from __future__ import annotations

import logging
import os
import random
import struct

import pytest
import torch
import xxhash

from llmserve.kv_transfer import disk_store
from llmserve.kv_transfer.disk_store import block_dir, block_path, count_chain, encode_header, layout_key
from llmserve.kv_transfer.shared_storage import SharedStorageConnector, _cache_bytes, _native_reader, _one_view
from llmserve.ops.tier_io import MIN_PAYLOAD, get_tier_io


@pytest.fixture(scope="module")
def ops():
    module = get_tier_io()
    assert module is not None, "the C++ tier reader did not build (see the log)"
    return module


def test_format_constants_match_the_python_format(ops):
    assert ops.FORMAT_VERSION == disk_store.VERSION and ops.HEADER_SIZE == disk_store.HEADER_SIZE
    key = layout_key({"model": "prefix"})
    assert disk_store.header_prefix(key) == encode_header(key, 7, 3, b"x" * 300)[:disk_store.PREFIX_SIZE]


@pytest.mark.parametrize("length", [241, 255, 256, 1023, 1024, 1025, 1088, 2048, 2049, 6144, 368640, 100003])
def test_xxh3_equals_xxhash_for_any_split(ops, length):
    rng = random.Random(length)
    data = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(length))
    want = xxhash.xxh3_64_intdigest(data.numpy().tobytes())
    assert ops.xxh3_64([data]) == want
    for pieces in (rng.randrange(2, 9), 40):
        cuts = sorted(rng.sample(range(1, length), pieces - 1))
        parts = [data[a:b].clone() for a, b in zip([0] + cuts, cuts + [length])]
        assert ops.xxh3_64(parts) == want, cuts
    ones = [data[i:i + 1].clone() for i in range(min(length, 300))] + ([data[300:].clone()] if length > 300 else [])
    assert ops.xxh3_64(ones) == want  # every stripe of the first 300 bytes spans pieces
    for at in (0, length // 2, length - 1):  # one byte changed anywhere (the last: XXH3's final stripe)
        changed = data.clone()
        changed[at] ^= 1
        assert ops.xxh3_64([changed]) == xxhash.xxh3_64_intdigest(changed.numpy().tobytes()) != want


def test_short_inputs_are_refused(ops):
    with pytest.raises(RuntimeError, match="240 bytes"):
        ops.xxh3_64([torch.zeros(240, dtype=torch.uint8)])


L, SLOT, NB = 3, 64, 12  # layers, bytes per K (or V) slot, blocks in the cache: 384-byte payloads


def _cache() -> torch.Tensor:
    """[L, 2, NB, SLOT] bytes: region r = (layer, K/V) holds block b's slot at b * SLOT."""
    return torch.zeros(L, 2, NB, SLOT, dtype=torch.uint8)


def _write(folder: str, key: bytes, h: int, parent: int, payload: bytes) -> str:
    path = block_path(folder, h)
    with open(path, "wb") as f:
        f.write(encode_header(key, h, parent, payload) + payload)
    return path


def _chain(tmp_path, n: int = 6):
    key = layout_key({"model": "tier_io"})
    folder = block_dir(str(tmp_path), key)
    hashes = [0xF000_0000_0000_0000 + 17 * i for i in range(n)]  # above 2**63: unsigned in the file
    payloads = [bytes(random.Random(i).randrange(256) for _ in range(2 * L * SLOT)) for i in range(n)]
    for i, (h, p) in enumerate(zip(hashes, payloads)):
        _write(folder, key, h, hashes[i - 1] if i else 0, p)
    return key, folder, hashes, payloads


def _read_native(ops, folder, key, hashes, ids, touch=True):
    cache = _cache()
    status = torch.empty(len(hashes), dtype=torch.int8)
    n = ops.read_blocks(cache.view(-1), 2 * L, SLOT, folder, hashes, torch.tensor(ids), disk_store.header_prefix(key),
                        touch, 2, status)
    return n, status.tolist(), cache


def _read_python(folder, key, hashes, ids):
    cache = _cache()
    regions = [memoryview(cache[i // 2, i % 2].numpy()).cast("B") for i in range(2 * L)]
    fds = disk_store.open_chain(folder, hashes)
    n = disk_store.read_chain_into(folder, key, hashes, fds,
                                   lambda i: [r[ids[i] * SLOT:(ids[i] + 1) * SLOT] for r in regions])
    return n, cache


def test_a_chain_lands_in_the_same_slots_as_the_python_read(ops, tmp_path):
    key, folder, hashes, payloads = _chain(tmp_path, 10)
    ids = [7, 3, 11, 0, 5, 6, 9, 1, 2, 10]
    old = os.stat(block_path(folder, hashes[0])).st_mtime_ns
    os.utime(block_path(folder, hashes[0]), ns=(old - 10**10, old - 10**10))
    n, status, cache = _read_native(ops, folder, key, hashes, ids)
    assert n == 10 and status == [0] * 10
    assert os.stat(block_path(folder, hashes[0])).st_mtime_ns > old - 10**10  # touched: LRU order
    for b, p in zip(ids, payloads):  # file order: layer 0 K, layer 0 V, layer 1 K, ...
        assert bytes(cache[:, :, b].reshape(-1).tolist()) == p
    assert torch.equal(cache, _read_python(folder, key, hashes, ids)[1])
    os.utime(block_path(folder, hashes[1]), ns=(5, 5))
    _read_native(ops, folder, key, hashes, ids, touch=False)
    assert os.stat(block_path(folder, hashes[1])).st_mtime_ns == 5  # a restore does not bump


def _damage(kind: str, folder: str, key: bytes, h: int, payload: bytes) -> None:
    path = block_path(folder, h)
    if kind == "missing":
        os.remove(path)
    elif kind == "truncated":
        os.truncate(path, os.path.getsize(path) - 7)
    elif kind == "header_only":
        os.truncate(path, 40)
    elif kind == "longer":
        with open(path, "ab") as f:
            f.write(b"\x00")
    elif kind == "corrupted":
        with open(path, "r+b") as f:
            f.seek(disk_store.HEADER_SIZE + 100)
            f.write(bytes([payload[100] ^ 0xFF]))
    elif kind == "other_layout":
        _write(folder, layout_key({"model": "another"}), h, 0, payload)
    elif kind == "old_version":
        data = bytearray(open(path, "rb").read())
        data[8:12] = struct.pack("<I", 2)
        open(path, "wb").write(data)
    elif kind == "other_block":
        _write(folder, key, h + 1, 0, payload)
        os.replace(block_path(folder, h + 1), path)


REASONS = {"missing": 1, "truncated": 7, "header_only": 3, "longer": 7, "corrupted": 8, "other_layout": 5,
           "old_version": 4, "other_block": 6}


@pytest.mark.parametrize("kind", sorted(REASONS))
def test_a_bad_file_stops_the_chain_where_the_python_read_stops(ops, tmp_path, kind):
    key, folder, hashes, payloads = _chain(tmp_path)
    _damage(kind, folder, key, hashes[3], payloads[3])
    ids = list(range(6))
    n, status, cache = _read_native(ops, folder, key, hashes, ids)
    assert n == 3 and status[:4] == [0, 0, 0, REASONS[kind]] and set(status[4:]) <= {0, 9}
    n_py, cache_py = _read_python(folder, key, hashes, ids)  # (removes the bad file: after the C++ read)
    assert n_py == 3 and torch.equal(cache[:, :, :3], cache_py[:, :, :3])


@pytest.mark.parametrize("native", [True, False])
def test_the_connector_removes_the_bad_file_with_its_reason(ops, tmp_path, caplog, native):
    """The worker side of the connector over a SmolLM2-like cache layout (slots of 6 KiB):
    the same blocks load, and the first bad file is removed and logged, with or without the
    C++ reader; a missing file is not logged."""
    from types import SimpleNamespace as NS

    from llmserve.config import CacheConfig
    from llmserve.kv_transfer.base import KVConnectorRole

    cfg = NS(model_config=NS(model="m", model_path="/nonexistent", dtype="bfloat16", quantization=None, num_layers=4,
                             num_kv_heads=3, head_dim=64),
             cache_config=CacheConfig(block_size=16), parallel_config=NS(tensor_parallel_size=1),
             kv_transfer_config=NS(kv_connector="SharedStorageConnector", kv_role="kv_both",
                                   kv_connector_extra_config={"shared_storage_path": str(tmp_path)}))
    buf = torch.randn(4, 2, 20, 16, 3, 64).to(torch.bfloat16)
    conn = SharedStorageConnector(cfg, KVConnectorRole.WORKER)
    conn.register_kv_caches(list(buf.unbind(0)))
    assert conn._native is not None
    if not native:
        conn._native = None
    hashes = [101, 102, 103, 104, 105]
    rows = _cache_bytes(conn._kv_all).view(8, 20, -1)
    payloads = [rows[:, b].reshape(-1).numpy().tobytes() for b in range(5)]
    for i, (h, p) in enumerate(zip(hashes, payloads)):
        _write(conn.folder, conn.key, h, hashes[i - 1] if i else 0, p)
    buf[:, :, 10:20] = 0
    os.utime(block_path(conn.folder, 101), ns=(5, 5))
    assert conn._load_split(list(range(10, 15)), hashes) == 5
    assert torch.equal(buf[:, :, 10:15].view(torch.int16), buf[:, :, 0:5].view(torch.int16))
    conn.flush()  # the C++ path bumps the mtimes on the writer's thread
    assert os.stat(block_path(conn.folder, 101)).st_mtime_ns > 5  # loaded: recently used (LRU)
    os.utime(block_path(conn.folder, 101), ns=(5, 5))
    assert conn._load_split(list(range(10, 15)), hashes, touch=False) == 5  # a restore
    conn.flush()
    assert os.stat(block_path(conn.folder, 101)).st_mtime_ns == 5
    _damage("corrupted", conn.folder, conn.key, 103, payloads[2])
    with caplog.at_level(logging.WARNING, logger="llmserve.kv_transfer.disk_store"):
        assert conn._load_split(list(range(15, 20)), hashes) == 2
    assert "checksum mismatch" in caplog.text and not os.path.exists(block_path(conn.folder, 103))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmserve.kv_transfer.disk_store"):
        assert conn._load_split(list(range(15, 20)), hashes) == 2  # 103 is gone now: a miss, not an error
    assert caplog.text == "" and os.path.exists(block_path(conn.folder, 104))
    conn.shutdown()


def test_count_on_disk_equals_the_python_count(ops, tmp_path, caplog):
    key, folder, hashes, payloads = _chain(tmp_path)
    nbytes = len(payloads[0])
    assert count_chain(folder, hashes, nbytes, ops.count_chain) == count_chain(folder, hashes, nbytes) == 6
    assert count_chain(folder, hashes + [5], nbytes, ops.count_chain) == 6  # up to the first missing one
    _damage("truncated", folder, key, hashes[2], payloads[2])
    with caplog.at_level(logging.WARNING, logger="llmserve.kv_transfer.disk_store"):
        assert count_chain(folder, hashes, nbytes, ops.count_chain) == 2
    assert "truncated" in caplog.text and not os.path.exists(block_path(folder, hashes[2]))  # removed, as in Python
    assert count_chain(folder, hashes, nbytes, ops.count_chain) == count_chain(folder, hashes, nbytes) == 2


def test_native_reader_only_for_one_cpu_buffer_and_long_payloads(ops):
    buf = torch.zeros(2, 2, 4, 16, 1, 8)  # 1 KiB slots... 2 x 2 x 512 B = 2 KiB payloads
    kv_all = _one_view(list(buf.unbind(0)))
    got = _native_reader(kv_all, 2048)
    assert got is not None and got[0] is ops and got[1].data_ptr() == buf.data_ptr()
    assert got[1].numel() == buf.numel() * 4
    assert _native_reader(kv_all, MIN_PAYLOAD - 1) is None
    assert _native_reader(None, 2048) is None
