"""Issue 31: the engine process imports what reading its config needs before the config
arrives (``llmserve.engine.core._preload`` / ``_preload_ahead``), freezes those imports' objects
out of the GC while it waits (``_freeze_preloaded``), and trims its heap once
it has gone idle after steps (``EngineCoreProc._trim_idle_heap``)."""
import queue
import subprocess
import sys
import threading
import time

import pytest

from llmserve.engine import core
from llmserve.engine.core import EngineCoreProc

_PROBE = "from llmserve.engine.core import _stdin_ready; print(_stdin_ready(), flush=True)"


def test_stdin_ready_is_false_while_the_config_has_not_been_written():
    proc = subprocess.Popen([sys.executable, "-c", _PROBE + "; import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "False"
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def test_stdin_ready_is_true_once_the_config_was_written():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); " + _PROBE],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    proc.stdin.write("config")
    proc.stdin.close()
    out = proc.stdout.read()
    proc.wait(timeout=60)
    assert out.strip() == "True"


@pytest.fixture
def fresh_module(tmp_path, monkeypatch):
    """The name of an importable module that nothing has imported yet."""
    (tmp_path / "preload_probe_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "preload_probe_mod", raising=False)
    return "preload_probe_mod"


def test_preload_ahead_imports_the_default_config_module_while_waiting(fresh_module, monkeypatch):
    monkeypatch.setattr(core, "_PRELOAD_AHEAD_MODULES", (fresh_module,))
    monkeypatch.setattr(core, "_stdin_ready", lambda: False)
    core._preload_ahead()
    assert fresh_module in sys.modules


def test_preload_ahead_skips_it_when_the_config_is_already_there(fresh_module, monkeypatch):
    monkeypatch.setattr(core, "_PRELOAD_AHEAD_MODULES", (fresh_module,))
    monkeypatch.setattr(core, "_stdin_ready", lambda: True)
    core._preload_ahead()
    assert fresh_module not in sys.modules


def test_preload_ahead_survives_a_module_that_is_missing(monkeypatch):
    monkeypatch.setattr(core, "_PRELOAD_AHEAD_MODULES", ("no_such_module_for_preload",))
    monkeypatch.setattr(core, "_stdin_ready", lambda: False)
    core._preload_ahead()
    assert "no_such_module_for_preload" not in sys.modules


def test_preload_modules_name_real_modules():
    import importlib.util

    for name in core._PRELOAD_MODULES + core._PRELOAD_AHEAD_MODULES:
        assert importlib.util.find_spec(name) is not None, name


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
