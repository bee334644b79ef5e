"""The kernel build lock: a builder killed mid-build leaves torch's ``lock`` file behind;
the next builder must remove it instead of waiting on it forever."""
import multiprocessing as mp
import os
import time

from llmserve.ops.cpu_ops import build_lock


def _hold(path: str, started) -> None:
    with build_lock(path):
        started.set()
        time.sleep(30)


def test_a_stale_torch_lock_is_removed_under_the_flock(tmp_path):
    (tmp_path / "lock").write_text("")  # what a killed cpp_extension build leaves
    with build_lock(str(tmp_path)):
        assert not (tmp_path / "lock").exists()


def test_the_flock_dies_with_its_holder(tmp_path):
    ctx = mp.get_context("fork")
    started = ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), started))
    holder.start()
    assert started.wait(20)
    os.kill(holder.pid, 9)  # killed mid-"build"
    holder.join(10)
    t0 = time.monotonic()
    with build_lock(str(tmp_path)):
        waited = time.monotonic() - t0
    assert waited < 10  # the kernel dropped the dead holder's lock; a live one would block 30 s


def _cached_or_built(tmp_path, monkeypatch, caplog, cached):
    """cached_or_built on ``tmp_path`` with import_built answering ``cached`` in turn and a
    build that returns "compiled": (module, build called, log text)."""
    import llmserve.ops.cpu_ops as cpu_ops

    answers = iter(cached)
    monkeypatch.setattr(cpu_ops, "import_built", lambda build_dir, name: next(answers))
    monkeypatch.setattr(cpu_ops, "COMPILED", set())
    calls = []
    with caplog.at_level("WARNING", logger="llmserve.ops.cpu_ops"):
        module = cpu_ops.cached_or_built(str(tmp_path), "ext", "test kernel", "a while",
                                         lambda: calls.append(1) or "compiled")
    return module, bool(calls), caplog.text, cpu_ops.ready_word(True, "ext")


def test_building_is_said_only_when_it_compiles(tmp_path, monkeypatch, caplog):
    """'Building ...' and 'built' only when the compiler runs; a cached build is 'loaded'."""
    module, built, log, word = _cached_or_built(tmp_path, monkeypatch, caplog, ["cached"])
    assert (module, built, log, word) == ("cached", False, "", "loaded from the cache")
    module, built, log, word = _cached_or_built(tmp_path, monkeypatch, caplog, [None, None])
    assert (module, built, word) == ("compiled", True, "built") and "Building the test kernel" in log


def test_a_process_that_waits_for_another_build_does_not_say_building(tmp_path, monkeypatch, caplog):
    """Two processes missing the cache together: the second waits for the first's lock and
    loads what it built; it said 'Building' (seen: two engines starting on a fresh cache)."""
    import threading

    held, release = threading.Event(), threading.Event()

    def holder():
        with build_lock(str(tmp_path)):
            held.set()
            release.wait(10)
    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(10)
    threading.Timer(0.3, release.set).start()
    module, built, log, word = _cached_or_built(tmp_path, monkeypatch, caplog, [None, "theirs"])
    t.join(10)
    assert (module, built, word) == ("theirs", False, "loaded from the cache")
    assert "Waiting for another process building the test kernel" in log and "Building" not in log
