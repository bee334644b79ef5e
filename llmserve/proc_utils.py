"""Process helpers shared by every child process llmserve starts (EngineCore, TP workers,
API servers of ``--api-server-count``)."""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional


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


def same_code_command(module: str, env: Optional[dict] = None) -> tuple[list[str], dict]:
    """``python -P -m module`` and an environment whose PYTHONPATH starts at the folder this
    llmserve was imported from, so a child process runs the parent's code. Without it ``-m``
    puts the working directory first on sys.path, and a ``llmserve/`` folder there (an old
    checkout) replaced the engine's code under an up-to-date front end (seen in a user trial:
    a start-up hung on a stale kernel-build lock of the old code, and beam search answered
    wrong). ``-P`` (Python 3.11) keeps the working directory off sys.path."""
    env = dict(os.environ if env is None else env)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder holding llmserve/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return [sys.executable, "-P", "-m", module], env
