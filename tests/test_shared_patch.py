"""llmserve/shared_patch.py: the attribute is replaced while any holder is inside, restored
when the last leaves, whichever thread entered first."""
from __future__ import annotations

import threading
from types import SimpleNamespace

from llmserve.shared_patch import SharedPatch


def test_nested_and_overlapping_holders_restore_the_original_once():
    obj, patch = SimpleNamespace(f="orig"), SharedPatch()
    with patch.applied(obj, "f", "new"):
        with patch.applied(obj, "f", "new"):
            assert obj.f == "new"
        assert obj.f == "new"  # the outer holder is still inside
    assert obj.f == "orig"
    inside, leave, seen = threading.Event(), threading.Event(), []

    def holder():
        with patch.applied(obj, "f", "new"):
            inside.set()
            leave.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    inside.wait(5)
    with patch.applied(obj, "f", "new"):
        seen.append(obj.f)
    seen.append(obj.f)  # this thread left first: the other holds it
    leave.set()
    t.join(5)
    assert seen == ["new", "new"] and obj.f == "orig"
