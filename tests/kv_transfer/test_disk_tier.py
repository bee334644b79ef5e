"""The disk KV tier (SharedStorageConnector / OffloadingConnector, llmserve/kv_transfer):
greedy output with the tier equals without (and transformers'); an engine restarted over
the same path loads the prompt's blocks from disk (cached_tokens) and answers the same;
truncated, corrupted, other-model files are skipped; a failing disk keeps serving; the
LRU bound; both connectors and vLLM's --kv-offloading-size form work offline."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.kv_transfer import KVConnectorFactory
from llmserve.kv_transfer import disk_store
from llmserve.kv_transfer.disk_store import (BlockWriter, block_dir, encode_header, layout_key, open_chain, read_block,
                                             read_chain)
from llmserve.kv_transfer.shared_storage import SharedStorageConnector
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.metrics.stats import SchedulerStats

PROMPT = [int(t) for t in torch.randint(5, 250, (100,), generator=torch.Generator().manual_seed(1))]
FULL_BLOCKS = (len(PROMPT) - 1) // 16  # 6 blocks of 16 tokens: 96 tokens a restart can load
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, save_tiny_model_fn):
    path = tmp_path_factory.mktemp("kv_tier_model")
    hf = save_tiny_model_fn("llama", str(path))
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)
    return str(path), out[0, len(PROMPT):].tolist()


def _llm(model: str, dtype: str = "float32", **kw) -> LLM:
    return LLM(model, tokenizer="SmolLM2-135M-Instruct", dtype=dtype, multiprocess_mode=False,
               kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=64, **kw)


def _tier(path, **extra) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(path), **extra}}


def _run(llm: LLM, prompt=PROMPT):
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def _connector(llm: LLM):
    """The worker side of the in-process engine's connector."""
    return llm.llm_engine.engine_core.engine_core.model_runner.kv_connector


def _files(path) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".kv"))


@pytest.mark.parametrize("native", [True, False], ids=["cpp_reader", "python_reads"])
def test_restart_loads_prompt_from_disk_and_bad_files_are_skipped(tiny, tmp_path, monkeypatch, native):
    """With the C++ reader (llmserve/ops/tier_io.py) and with disk_store's Python reads
    (where it cannot be built)."""
    from llmserve.kv_transfer import shared_storage
    from llmserve.ops.tier_io import get_tier_io

    assert get_tier_io() is not None, "the C++ tier reader did not build (see the log)"
    if not native:
        monkeypatch.setattr(shared_storage, "_native_reader", lambda *a: None)
        monkeypatch.setattr(shared_storage, "_native_counter", lambda: None)
    model, hf_tokens = tiny
    llm = _llm(model, kv_transfer_config=_tier(tmp_path))
    assert (_connector(llm)._native is not None) == native
    assert (llm.llm_engine.engine_core.engine_core.scheduler.connector._count_native is not None) == native
    assert _run(llm) == (hf_tokens, 0)  # chunked prefill (64-token steps) saves each chunk's blocks
    llm.shutdown()  # flushes the writer
    files = _files(tmp_path)
    assert len(files) == FULL_BLOCKS
    # a restart without the warm-up: the RAM prefix cache is empty, the blocks load on demand
    llm = _llm(model, kv_transfer_config=_tier(tmp_path, restore_on_start=False))
    stats = _spy_stats(llm)
    assert _run(llm) == (hf_tokens, FULL_BLOCKS * 16)
    prom = PrometheusStatLogger(llm.llm_engine.vllm_config)
    for st in stats:
        prom.record(SchedulerStats(kv_connector_stats=st), None)
    value = lambda name: prom.registry.get_sample_value(name, {"model_name": prom.model_name, "engine": "0"})
    assert value("vllm:external_prefix_cache_hits_total") == FULL_BLOCKS * 16
    assert value("vllm:external_prefix_cache_queries_total") == len(PROMPT)
    assert value("vllm:kv_connector_bytes_loaded_total") == FULL_BLOCKS * _connector(llm).block_nbytes
    # the chain is loaded up to the first bad file: block 2 torn, block 4 corrupted
    llm.reset_prefix_cache()
    by_order = _chain_files(tmp_path)
    with open(by_order[2], "r+b") as f:
        f.truncate(os.path.getsize(by_order[2]) - 7)
    with open(by_order[4], "r+b") as f:
        f.seek(disk_store.HEADER_SIZE + 5)
        f.write(b"\xff\xfe")
    assert _run(llm) == (hf_tokens, 2 * 16)
    _connector(llm).flush()  # the torn file was removed and written again by the recompute
    assert os.path.getsize(by_order[2]) == os.path.getsize(by_order[0])
    llm.shutdown()
    llm = _llm(model, kv_transfer_config=_tier(tmp_path, restore_on_start=False))
    # block 4 was still corrupt (the right size): found when loaded, removed, and the
    # request computed again from block 4 (the step that read it saved nothing)
    assert _run(llm) == (hf_tokens, 4 * 16)
    _connector(llm).flush()
    llm.shutdown()
    assert os.path.getsize(by_order[4]) == os.path.getsize(by_order[0])  # written again by the recompute
    llm = _llm(model, kv_transfer_config=_tier(tmp_path))
    assert _run(llm) == (hf_tokens, FULL_BLOCKS * 16)
    llm.shutdown()


def _spy_stats(llm: LLM) -> list[dict]:
    """The scheduler-side connector's per-step stats, as the engine's stat loggers get them."""
    conn, seen = llm.llm_engine.engine_core.engine_core.scheduler.connector, []
    take = conn.get_stats
    conn.get_stats = lambda: seen.append(take()) or seen[-1]
    return seen


def _chain_files(path) -> list[str]:
    """The tier's files of PROMPT in chain order (block 0 first)."""
    from llmserve.core.kv_cache_manager import hash_block_tokens

    hashes, parent = [], 0
    for i in range(FULL_BLOCKS):
        parent = hash_block_tokens(parent, PROMPT[i * 16:(i + 1) * 16])
        hashes.append(parent)
    by_name = {os.path.basename(p): p for p in _files(path)}
    return [by_name[f"{h:016x}.kv"] for h in hashes]


def test_failing_disk_keeps_serving_and_logs_once(tiny, tmp_path, monkeypatch, caplog):
    model, hf_tokens = tiny
    llm = _llm(model, kv_transfer_config=_tier(tmp_path))
    assert _run(llm) == (hf_tokens, 0)
    _connector(llm).flush()

    def full(*a, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(disk_store.os, "replace", full)
    other = [t + 1 for t in PROMPT]
    with caplog.at_level(logging.ERROR, logger="llmserve.kv_transfer.disk_store"):
        first = _run(llm, other)
        _run(llm, [t + 2 for t in PROMPT])
        _connector(llm).flush()
    assert sum("cannot write" in r.message for r in caplog.records) == 1
    names = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert len(_files(tmp_path)) == FULL_BLOCKS and not [f for f in names if f.endswith(".tmp")]
    assert _connector(llm).writer.stats.write_errors == 2 * FULL_BLOCKS
    monkeypatch.undo()
    llm.reset_prefix_cache()
    assert _run(llm) == (hf_tokens, FULL_BLOCKS * 16)  # what the tier had is still served
    assert _run(llm, other) == first
    llm.shutdown()
    assert len(_files(tmp_path)) == 2 * FULL_BLOCKS  # the disk works again: new blocks are kept


def test_offloading_connector_and_vllm_flags_offline(tiny, tmp_path, monkeypatch):
    model, hf_tokens = tiny
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    llm = _llm(model, kv_offloading_size=0.001, kv_offloading_backend="native")  # vLLM's form
    assert llm.llm_engine.vllm_config.kv_transfer_config.kv_connector == "OffloadingConnector"
    assert _run(llm) == (hf_tokens, 0)
    llm.shutdown()
    llm = _llm(model, kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                          "kv_connector_extra_config": {"kv_offloading_size": 0.001}})
    assert _run(llm) == (hf_tokens, FULL_BLOCKS * 16)
    llm.shutdown()
    assert _files(os.path.join(tmp_path, "llmserve", "kv_offload"))
    consumer = dict(_tier(os.path.join(tmp_path, "llmserve", "kv_offload")), kv_role="kv_consumer")
    llm = _llm(model, kv_transfer_config=consumer)  # loads, never saves
    assert _run(llm) == (hf_tokens, FULL_BLOCKS * 16)
    before = _files(tmp_path)
    _run(llm, [t + 3 for t in PROMPT])
    llm.shutdown()
    assert _files(tmp_path) == before
    with pytest.raises(ValueError, match="kv_offloading_size"):
        _llm(model, kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="kv_offloading_backend='lmcache'"):
        _llm(model, kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        _llm(model, kv_transfer_config=_tier(tmp_path), enable_prefix_caching=False)


def test_other_model_or_dtype_file_is_never_loaded(tmp_path, caplog):
    key, other = layout_key({"model": "a", "dtype": "float32"}), layout_key({"model": "a", "dtype": "bfloat16"})
    assert key != other and block_dir(str(tmp_path), key) != block_dir(str(tmp_path), other)
    folder = block_dir(str(tmp_path), key)
    payload = bytes(range(256)) * 4
    for k, h in ((key, 1), (other, 2)):
        with open(os.path.join(folder, f"{h:016x}.kv"), "wb") as f:
            f.write(encode_header(k, h, 0, payload) + payload)
    out = memoryview(bytearray(len(payload)))
    assert read_block(folder, key, 1, out) and out == payload
    with caplog.at_level(logging.WARNING):
        assert not read_block(folder, key, 2, out)  # another layout's header
    assert "another model" in caplog.text and not os.path.exists(os.path.join(folder, f"{2:016x}.kv"))
    assert not read_block(folder, key, 1, memoryview(bytearray(len(payload) + 1)))  # the wrong size here


def test_other_dtype_engine_over_the_same_tier_prefills_and_keeps_its_own_blocks(tiny, tmp_path):
    model, hf_tokens = tiny
    llm = _llm(model, kv_transfer_config=_tier(tmp_path))
    assert _run(llm) == (hf_tokens, 0)
    llm.shutdown()
    bf = _llm(model, "bfloat16", kv_transfer_config=_tier(tmp_path))
    first, cached = _run(bf)
    assert cached == 0  # the float32 blocks are another layout: never looked at
    _connector(bf).flush()
    assert len(os.listdir(tmp_path)) == 2 and len(_files(tmp_path)) == 2 * FULL_BLOCKS
    bf.reset_prefix_cache()
    assert _connector(bf)._native is not None
    assert _run(bf) == (first, FULL_BLOCKS * 16)  # its own blocks, read straight into the cache (C++)
    bf.reset_prefix_cache()
    _connector(bf)._native = None  # no C++ reader: disk_store's readv per file, into the slots
    assert _run(bf) == (first, FULL_BLOCKS * 16)
    bf.reset_prefix_cache()
    _connector(bf)._slots = None  # a cache off the CPU: staged, then one copy over all layers
    assert _run(bf) == (first, FULL_BLOCKS * 16)
    bf.reset_prefix_cache()
    _connector(bf)._kv_all = None  # caches that are not one buffer: the per-layer copy
    assert _run(bf) == (first, FULL_BLOCKS * 16)
    bf.shutdown()


def test_narrow_kv_cache_dtype_is_its_own_layout_of_half_the_bytes(tiny, tmp_path):
    """--kv-cache-dtype float16 under a float32 model: its blocks hold 2-byte values, and
    neither layout ever reads the other's files; the float32 layout keeps its old key."""
    from llmserve.kv_transfer.shared_storage import layout_fields
    model, hf_tokens = tiny
    llm = _llm(model, kv_transfer_config=_tier(tmp_path))
    assert "kv_cache_dtype" not in layout_fields(llm.llm_engine.vllm_config)
    assert _run(llm) == (hf_tokens, 0)
    full_bytes = _connector(llm).block_nbytes
    llm.shutdown()
    half = _llm(model, kv_cache_dtype="float16", kv_transfer_config=_tier(tmp_path))
    assert _connector(half).block_nbytes * 2 == full_bytes
    first, cached = _run(half)
    assert cached == 0
    _connector(half).flush()
    assert len(os.listdir(tmp_path)) == 2 and len(_files(tmp_path)) == 2 * FULL_BLOCKS
    half.reset_prefix_cache()
    assert _run(half) == (first, FULL_BLOCKS * 16)  # its own blocks, loaded
    half.shutdown()


def test_read_chain_stops_at_the_first_bad_file_and_closes_every_file(tmp_path, caplog):
    key = layout_key({"model": "chain"})
    folder = block_dir(str(tmp_path), key)
    payloads = [bytes([h]) * 512 for h in (1, 2, 3, 4)]
    for h, payload in zip((1, 2, 3, 4), payloads):
        with open(os.path.join(folder, f"{h:016x}.kv"), "wb") as f:
            f.write(encode_header(key, h, h - 1, payload) + payload)
    v1 = bytearray(open(os.path.join(folder, f"{3:016x}.kv"), "rb").read())
    v1[8:12] = (1).to_bytes(4, "little")  # a version-1 (CRC-32) file
    open(os.path.join(folder, f"{3:016x}.kv"), "wb").write(v1)
    fds = open_chain(folder, [1, 2, 3, 4, 9])
    assert len(fds) == 4  # up to the first missing file
    out = memoryview(bytearray(4 * 512))
    with caplog.at_level(logging.WARNING):
        assert read_chain(folder, key, [1, 2, 3, 4], fds, out, 512) == 2
    assert out[:1024] == payloads[0] + payloads[1] and "not a KV block file of this version" in caplog.text
    assert not os.path.exists(os.path.join(folder, f"{3:016x}.kv"))  # removed; block 4 stays
    assert os.path.exists(os.path.join(folder, f"{4:016x}.kv"))
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


@pytest.mark.parametrize("block_ids", [[5, 6, 7, 8, 2, 3], [9, 1, 7, 3, 11, 5, 0, 13, 4, 2]])
def test_loaded_blocks_land_in_place_by_runs_or_by_index(block_ids):
    from llmserve.kv_transfer.shared_storage import _copy_into, _one_view

    buf = torch.zeros(3, 2, 16, 4, 2, 5)  # [L, 2, num_blocks, block_size, heads, head_dim]
    kv_all = _one_view(list(buf.unbind(0)))
    data = torch.randn(3, 2, len(block_ids), 40)
    _copy_into(kv_all, block_ids, data)
    ref = torch.zeros_like(buf).flatten(3)
    ref[:, :, block_ids] = data
    assert torch.equal(buf.flatten(3), ref)
    assert _one_view([buf[0], buf[2]]) is None  # not equally spaced: the per-layer path


def test_writer_lru_bound_keeps_recently_loaded_blocks(tmp_path):
    key = layout_key({"model": "lru"})
    folder = block_dir(str(tmp_path), key)
    payload = b"x" * 1000
    size = disk_store.HEADER_SIZE + len(payload)
    w = BlockWriter(folder, key, max_bytes=3 * size)
    for h in (1, 2, 3):
        w.put(h, 0, payload)
    w.flush()
    os.utime(os.path.join(folder, f"{1:016x}.kv"), (1e10, 1e10))  # block 1 loaded since: most recent
    w.put(4, 0, payload)
    w.flush()
    assert sorted(os.listdir(folder)) == [f"{h:016x}.kv" for h in (1, 3, 4)]
    assert w.total_bytes == 3 * size and w.stats.blocks_evicted == 1
    w.close()
    w = BlockWriter(folder, key, max_bytes=3 * size)  # a restart finds them again
    assert w.total_bytes == 3 * size
    w.close()


class _Recorder(SharedStorageConnector):
    """A third-party connector (here: the disk tier under another name)."""


def test_tier_without_prefix_caching_says_so_in_a_sentence():
    """The start-up error of a KV tier with --no-enable-prefix-caching reads as a sentence
    naming the flag (it said "cannot run with enable_prefix_caching is off")."""
    from types import SimpleNamespace

    from llmserve.engine_config_builder import _kv_transfer_config

    args = SimpleNamespace(kv_offloading_size=1.0, kv_offloading_backend="native", kv_transfer_config=None,
                           enable_prefix_caching=False, tensor_parallel_size=1)
    with pytest.raises(ValueError) as e:
        _kv_transfer_config(args, SimpleNamespace(runner="generate", is_encoder_only=False,
                                                  is_encoder_decoder=False))
    assert str(e.value) == ("kv_transfer_config: the OffloadingConnector connector cannot run with prefix caching "
                            "off (--no-enable-prefix-caching, enable_prefix_caching=False): the KV tier extends "
                            "the prefix cache")


def test_registry_lists_known_connectors_and_takes_third_party_ones():
    assert {"SharedStorageConnector", "OffloadingConnector"} <= set(KVConnectorFactory.known_connectors())
    KVConnectorFactory.register_connector("TestRecorderConnector", __name__, "_Recorder")
    try:
        cfg = type("C", (), {"kv_connector": "TestRecorderConnector", "kv_connector_module_path": None})
        assert KVConnectorFactory.get_connector_class(cfg) is _Recorder
        with pytest.raises(ValueError, match="already registered"):
            KVConnectorFactory.register_connector("TestRecorderConnector", __name__, "_Recorder")
        cfg.kv_connector, cfg.kv_connector_module_path = "_Recorder", __name__
        assert KVConnectorFactory.get_connector_class(cfg) is _Recorder
    finally:
        KVConnectorFactory._registry.pop("TestRecorderConnector", None)


def test_metadata_pickles_for_a_worker_process():
    import pickle

    from llmserve.kv_transfer.shared_storage import SharedStorageConnectorMetadata

    meta = pickle.loads(pickle.dumps(SharedStorageConnectorMetadata([([3, 4], [11, 12])], [(5, 99, 12)], True)))
    assert meta.loads == [([3, 4], [11, 12])] and meta.saves == [(5, 99, 12)] and meta.restore
