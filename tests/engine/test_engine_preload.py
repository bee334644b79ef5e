"""Issue 31: the engine process imports transformers without torch
(``llmserve.engine.core._transformers_without_torch``) and what reading its config needs
before the config arrives (``_preload``), freezes those imports' objects out of the GC while
it waits (``_freeze_preloaded``), and trims its heap once it has gone idle after steps
(``EngineCoreProc._trim_idle_heap``)."""
import queue
import subprocess
import sys
import threading
import time

from llmserve.engine import core
from llmserve.engine.core import EngineCoreProc

def test_preload_modules_name_real_modules():
    import importlib.util

    for name in core._PRELOAD_MODULES:
        assert importlib.util.find_spec(name) is not None, name


def test_preload_survives_a_module_that_is_missing():
    core._import_best_effort(("no_such_module_for_preload", "colorsys"))  # no error; the rest still imported
    assert "no_such_module_for_preload" not in sys.modules and "colorsys" in sys.modules


def _idle_proc(monkeypatch, trims):
    monkeypatch.setattr(core, "IDLE_TRIM_S", 0.05)
    monkeypatch.setattr(core, "release_free_heap", lambda: trims.append(time.monotonic()))
    proc = EngineCoreProc.__new__(EngineCoreProc)  # the idle wait alone: no model, no sockets
    proc.core = type("NoSleepCore", (), {})()  # no config: never sleeps (wait_input_or_sleep)
    proc.input_queue = queue.Queue()
    proc._started = time.monotonic()
    return proc


def test_idle_engine_trims_its_heap_once_after_steps(monkeypatch):
    trims = []
    proc = _idle_proc(monkeypatch, trims)
    proc._heap_dirty = True  # a step ran
    got = []
    t = threading.Thread(target=lambda: got.append(proc._wait_input()))
    t.start()
    deadline = time.monotonic() + 10
    while not trims and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(trims) == 1 and t.is_alive()  # trimmed, still waiting for input
    proc.input_queue.put("next")
    t.join(10)
    assert got == ["next"] and proc._heap_dirty is False
    proc.input_queue.put("again")  # no step since: no second trim
    assert proc._wait_input() == "again" and len(trims) == 1


def test_input_within_the_idle_delay_skips_the_trim(monkeypatch):
    trims = []
    proc = _idle_proc(monkeypatch, trims)
    proc._heap_dirty = True
    proc.input_queue.put("soon")
    assert proc._wait_input() == "soon"
    assert trims == [] and proc._heap_dirty is True  # trimmed at the next idle period instead


def test_idle_engine_without_steps_never_trims(monkeypatch):
    trims = []
    proc = _idle_proc(monkeypatch, trims)  # no _heap_dirty: nothing ran yet
    t = threading.Thread(target=lambda: proc._wait_input())
    t.start()
    time.sleep(0.3)
    proc.input_queue.put("x")
    t.join(10)
    assert trims == []


def test_freeze_preloaded_collects_garbage_then_freezes_the_rest():
    import gc
    import weakref

    class Node:
        pass

    garbage = Node()
    garbage.self = garbage  # a cycle: only the collector frees it
    dead = weakref.ref(garbage)
    del garbage
    kept = Node()
    gc.unfreeze()
    try:
        core._freeze_preloaded()
        assert dead() is None  # collected before the freeze, not frozen for good
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # frozen objects are out of the GC's view
    finally:
        gc.unfreeze()


_ENGINE_IMPORTS = r"""
import json, pickle, sys
from llmserve.engine import core
core._transformers_without_torch()
core._preload()
import torch
from transformers import LlamaConfig
from transformers.utils import is_torch_available
cfg = pickle.loads(sys.stdin.buffer.read())
print(json.dumps({"transformers_sees_torch": bool(is_torch_available()), "sympy": "sympy" in sys.modules,
                  "config": [type(cfg).__name__, cfg.hidden_size, cfg.num_hidden_layers],
                  "torch_works": float(torch.ones(3).sum())}))
"""


def test_engine_imports_transformers_without_torch_and_reads_a_pickled_config():
    """The engine process's transformers runs without torch (no type_validators ->
    activations -> sympy chain for a LlamaConfig), while the engine's torch works and a
    config pickled by a process whose transformers sees torch (this one) unpickles."""
    import json
    import pickle

    from transformers import LlamaConfig

    data = pickle.dumps(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, vocab_size=100))
    out = subprocess.run([sys.executable, "-c", _ENGINE_IMPORTS], input=data, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    got = json.loads(out.stdout.decode().strip().splitlines()[-1])
    assert got == {"transformers_sees_torch": False, "sympy": False, "config": ["LlamaConfig", 64, 2],
                   "torch_works": 3.0}
