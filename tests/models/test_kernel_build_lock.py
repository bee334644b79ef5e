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
