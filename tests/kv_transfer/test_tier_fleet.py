"""The disk KV tier in a fleet: a tier folder this engine cannot write into (a read-only
or full volume shared by several servers, where this model's folder does not exist yet)
starts the engine with a cold cache and one log line instead of killing it after the
model loaded; several engines on one folder never share or delete each other's
temporary files; a folder removed while serving (an operator clearing the cache) is
made again by the next write."""
from __future__ import annotations

import logging
import os
import time

import pytest

from llmserve import LLM, SamplingParams
from llmserve.kv_transfer import disk_store
from llmserve.kv_transfer.disk_store import BlockWriter, block_path, layout_key

PROMPT = list(range(1000, 1100))  # 6 full blocks of 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _llm(model: str, tier, **kw) -> LLM:
    return LLM(model, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
               kv_cache_memory="8MiB", max_model_len=256, max_num_batched_tokens=64,
               kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"shared_storage_path": str(tier)}}, **kw)


def test_a_tier_folder_that_cannot_be_made_is_a_cold_cache_and_one_log_line(tmp_path, monkeypatch, caplog,
                                                                              save_tiny_model_fn):
    model = str(tmp_path / "model")
    save_tiny_model_fn("llama", model)
    tier = tmp_path / "tier"
    tier.mkdir()
    real = os.makedirs

    def read_only(path, *a, **kw):  # the root exists; nothing may be made inside it (EROFS)
        if str(path).startswith(str(tier) + os.sep):
            raise OSError(30, "Read-only file system", path)
        return real(path, *a, **kw)

    monkeypatch.setattr(disk_store.os, "makedirs", read_only)
    with caplog.at_level(logging.ERROR, logger="llmserve.kv_transfer"):
        llm = _llm(model, tier)  # raised OSError from the worker's connector before
        first = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0]
        llm.shutdown()
    errors = [r.getMessage() for r in caplog.records if "cannot create" in r.getMessage()]
    assert len(errors) == 1 and "Read-only file system" in errors[0] and "cold cache" in errors[0], errors
    assert os.listdir(tier) == [] and first.num_cached_tokens == 0 and len(first.outputs[0].token_ids) == 4


def test_engines_on_one_folder_keep_their_temporary_files_apart(tmp_path):
    key = layout_key({"model": "fleet"})
    folder = str(tmp_path)
    young, old = os.path.join(folder, "a.kv.1.x.tmp"), os.path.join(folder, "b.kv.1.y.tmp")
    for p in (young, old):
        open(p, "wb").close()
    ago = time.time() - 2 * BlockWriter.STALE_TMP_SECONDS
    os.utime(old, (ago, ago))
    a, b = BlockWriter(folder, key, None), BlockWriter(folder, key, None)
    try:
        # another engine's write in progress survives a start; a crashed write's leftover does not
        assert os.path.exists(young) and not os.path.exists(old)
        assert a._tmp_tag != b._tmp_tag  # same pid (one process here, pid 1 in two containers)
        payload = bytes(range(256)) * 4
        a.put(7, 0, payload)
        b.put(7, 0, payload)
        a.flush(), b.flush()
        assert a.stats.write_errors == b.stats.write_errors == 0
        out = memoryview(bytearray(len(payload)))
        assert disk_store.read_block(folder, key, 7, out) and out == payload
    finally:
        a.close(), b.close()


def test_a_file_removed_during_the_start_scan_is_skipped(tmp_path, monkeypatch):
    key = layout_key({"model": "fleet"})
    folder = str(tmp_path)
    open(block_path(folder, 1), "wb").close()
    open(block_path(folder, 2), "wb").close()
    listing = list(os.scandir(folder))
    os.unlink(block_path(folder, 1))  # another engine evicts it between the listing and the stat
    monkeypatch.setattr(disk_store.os, "scandir", lambda path: iter(listing))
    w = BlockWriter(folder, key, None)  # raised FileNotFoundError (the engine died at start)
    w.close()
    assert list(w._lru) == [os.path.basename(block_path(folder, 2))]


def test_a_removed_folder_is_made_again_by_the_next_write(tmp_path, caplog):
    key = layout_key({"model": "fleet"})
    folder = str(tmp_path / "layout")
    os.makedirs(folder)
    w = BlockWriter(folder, key, None)
    try:
        os.rmdir(folder)  # rm -rf of the cache while serving
        payload = b"\x01" * 512
        with caplog.at_level(logging.ERROR, logger="llmserve.kv_transfer.disk_store"):
            w.put(9, 0, payload)
            w.flush()
        assert w.stats.write_errors == 0 and "cannot write" not in caplog.text
        assert os.path.getsize(block_path(folder, 9)) == disk_store.HEADER_SIZE + len(payload)
    finally:
        w.close()
