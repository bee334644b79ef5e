"""Sleep mode offline (vLLM's ``LLM.sleep`` / ``wake_up``) on a tiny random Llama, float32,
in-process: asleep the runner holds no weights and no KV cache (its oneDNN-packed linears
cannot be parked, so level 1 frees the model as level 2 does); the next generate wakes it
and its greedy tokens still equal transformers'; the default GGUF model's level 1 parks
its weights on disk (pages not resident, the same model object, the same tokens after the
wake), and a parked file that cannot be read back makes the wake rebuild the model;
partial wakes by tag; refusals (busy, bad
level/tag, sleep mode off); the idle sleep of ``sleep_idle_seconds`` in the engine
process's input wait (llama.cpp's --sleep-idle-seconds)."""
from __future__ import annotations

import os
import queue
import threading
import time

import pytest
import torch

PROMPT = [5, 900, 31, 4000, 77, 12, 6000, 3]
NEW = 8


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def sleepy(tmp_path_factory, save_tiny_model_fn):
    """(LLM with enable_sleep_mode and sleep_idle_seconds=0.2, transformers model); level 1
    parks the weights in a temporary directory."""
    from llmserve import LLM

    path = str(tmp_path_factory.mktemp("sleepy"))
    hf = save_tiny_model_fn("llama", path, seed=3)
    from llmserve.worker import sleep_park

    old, sleep_park.PARK_DIR = sleep_park.PARK_DIR, str(tmp_path_factory.mktemp("park"))
    llm = LLM(path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              kv_cache_memory="64MiB", enable_sleep_mode=True, sleep_idle_seconds=0.2)
    yield llm, hf
    llm.shutdown()
    sleep_park.PARK_DIR = old


def resident_pages(ranges) -> int:
    """How many of the pages in ``ranges`` ((address, length), page-aligned) are resident
    (mincore(2))."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    n = 0
    for addr, length in ranges:
        vec = (ctypes.c_ubyte * (length // page))()
        assert libc.mincore(addr, length, vec) == 0, ctypes.get_errno()
        n += sum(b & 1 for b in vec)
    return n


def _greedy(llm) -> list[int]:
    from llmserve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return list(llm.generate({"prompt_token_ids": PROMPT}, sp, use_tqdm=False)[0].outputs[0].token_ids)


def _core(llm):
    return llm.llm_engine.engine_core.engine_core


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_weights_and_kv_and_generate_wakes(sleepy, level):
    llm, hf = sleepy
    ref = hf_greedy(hf, PROMPT, NEW)
    assert _greedy(llm) == ref
    runner = _core(llm).model_runner
    blocks = runner.kv_caches[0].shape[1]
    llm.sleep(level=level)
    assert llm.llm_engine.is_sleeping()
    assert runner.model is None and runner.kv_caches == [] and runner._sleep.parked is None
    assert _core(llm).scheduler.kv_cache_manager.num_used_blocks == 0
    assert _greedy(llm) == ref  # woken by the request, same tokens as transformers
    assert not llm.llm_engine.is_sleeping() and runner.kv_caches[0].shape[1] == blocks


def test_level_1_then_2(sleepy):
    """A level-2 sleep over a level-1 one frees the parked model and closes its file."""
    llm, hf = sleepy
    runner = _core(llm).model_runner
    llm.sleep(1)
    fd = runner._sleep.parked.fd if runner._sleep.parked is not None else None
    llm.sleep(2)
    assert runner.model is None and runner._sleep.parked is None
    if fd is not None:
        with pytest.raises(OSError):
            os.fstat(fd)
    assert _greedy(llm) == hf_greedy(hf, PROMPT, NEW)


def test_level_1_parks_the_gguf_weights(tmp_path, monkeypatch):
    """The default GGUF model (packed weights, no oneDNN tensors): level 1 keeps the model
    object, writes its weights' pages to disk and frees them (not resident), the wake reads
    them back (resident again) and the greedy tokens are the same; a parked file cut short
    makes the wake rebuild the model, again with the same tokens."""
    from llmserve import LLM, SamplingParams

    from llmserve.worker import sleep_park

    monkeypatch.setattr(sleep_park, "PARK_DIR", str(tmp_path))
    llm = LLM("SmolLM2-135M-Instruct", multiprocess_mode=False, kv_cache_memory="16MiB", max_model_len=256,
              enable_sleep_mode=True)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)

    def greedy() -> list[int]:
        return list(llm.generate({"prompt_token_ids": PROMPT[:4]}, sp, use_tqdm=False)[0].outputs[0].token_ids)

    try:
        ref = greedy()
        runner = _core(llm).model_runner
        model = runner.model
        llm.sleep(1)
        parked = runner._sleep.parked
        assert runner.model is model and parked.nbytes > 50 * 2**20  # ~94 MiB of packed weights and more
        assert resident_pages(parked.ranges) == 0
        assert greedy() == ref
        assert runner.model is model and runner._sleep.parked is None
        assert resident_pages(parked.ranges) == parked.nbytes // os.sysconf("SC_PAGE_SIZE")
        llm.sleep(1)
        os.ftruncate(runner._sleep.parked.fd, 100)
        assert greedy() == ref
        assert runner.model is not model and runner._sleep.parked is None
    finally:
        llm.shutdown()


def test_wake_up_by_tags(sleepy):
    llm, hf = sleepy
    runner = _core(llm).model_runner
    llm.sleep(1)
    llm.wake_up(tags=["weights"])
    assert runner.model is not None and runner.kv_caches == [] and llm.llm_engine.is_sleeping()
    llm.wake_up(tags=["kv_cache"])
    assert runner.kv_caches and not llm.llm_engine.is_sleeping()
    llm.wake_up()  # awake: a no-op
    assert _greedy(llm) == hf_greedy(hf, PROMPT, NEW)


def test_refusals(sleepy):
    from llmserve import SamplingParams

    llm, _ = sleepy
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["activations"])
    llm.llm_engine.add_request("busy", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="busy"):
        llm.sleep(1)
    assert not llm.llm_engine.is_sleeping()
    llm.llm_engine.abort_request("busy")
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    with pytest.raises(ValueError, match="sleep_idle_seconds"):
        from llmserve import EngineArgs

        EngineArgs(model="SmolLM2-135M-Instruct", sleep_idle_seconds=0).create_engine_config()
    for sleep in ({"enable_sleep_mode": True}, {"sleep_idle_seconds": 5.0}):  # refused at start, naming both
        with pytest.raises(ValueError, match=f"enable_lora.*{next(iter(sleep))}"):
            EngineArgs(model="SmolLM2-135M-Instruct", enable_lora=True, **sleep).create_engine_config()


def test_sleep_mode_off_refuses(sleepy):
    """An engine built without enable_sleep_mode / sleep_idle_seconds refuses to sleep."""
    import dataclasses

    from llmserve.engine.core import EngineCore

    core = _core(sleepy[0])
    off = EngineCore.__new__(EngineCore)
    off.config = dataclasses.replace(core.config, model_config=dataclasses.replace(
        core.config.model_config, enable_sleep_mode=False, sleep_idle_seconds=None))
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        off.sleep(1)
    assert not core.is_sleeping()


def test_idle_seconds_put_the_engine_to_sleep(sleepy):
    """EngineCoreProc's idle wait (run_busy_loop) sleeps after sleep_idle_seconds and hands
    on the next input, which then wakes the engine (add_request)."""
    from llmserve.engine.core import EngineCoreProc

    llm, hf = sleepy
    proc = EngineCoreProc.__new__(EngineCoreProc)
    proc.core, proc.input_queue = _core(llm), queue.Queue()
    proc._started = time.monotonic()
    proc.input_queue.put("stats")  # not a step: the idle clock keeps running
    assert proc._wait_input() == "stats"
    got = []
    t = threading.Thread(target=lambda: got.append(proc._wait_input()))
    t.start()
    deadline = time.monotonic() + 10
    while not proc.core.is_sleeping() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.core.is_sleeping()
    proc.input_queue.put("next")
    t.join(10)
    assert got == ["next"]
    assert _greedy(llm) == hf_greedy(hf, PROMPT, NEW)
