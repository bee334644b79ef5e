"""Process helpers shared by every child process llmserve starts (EngineCore, TP workers,
API servers of ``--api-server-count``)."""
from __future__ import annotations

import os
import threading
import time


def _exit_when_orphaned(parent_pid: int, poll_s: float) -> None:
    while True:
        time.sleep(poll_s)
        if os.getppid() != parent_pid:
            os._exit(1)


def exit_when_parent_dies(parent_pid: int, poll_s: float = 1.0) -> threading.Thread:
    """Start a daemon thread that exits this process (status 1) once ``parent_pid`` is no
    longer its parent, checked every ``poll_s`` seconds: a SIGKILLed parent cannot clean up,
    so its children must notice by themselves (vLLM's engine does the same with a parent
    death check). Returns the started thread."""
    t = threading.Thread(target=_exit_when_orphaned, args=(parent_pid, poll_s), daemon=True,
                         name="llmserve-parent-watch")
    t.start()
    return t
