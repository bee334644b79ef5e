"""Sequence numbers of the KV event stream that outlive an engine process.

A server's engine process can end and start again while the server runs: sleep level 2
ends it and the wake-up starts a fresh one (engine/sleep_process.py), and
``--restart-engine-on-failure`` replaces a dead one (engine/self_heal.py). Each fresh
process makes a fresh ``ZmqEventPublisher``; if it counted from 0 again, a subscriber
(vllm-router, llm-d's indexer, vLLM's example subscriber) would see the sequence go
backwards and drop the new batches as already seen, or ask to replay them.

So the process that spawns the engines keeps, for the life of its EngineConfig, a small
directory (``attach_seq_dir``, called before each spawn) whose path travels to the engine
inside the pickled config; each data-parallel rank's publisher keeps there the next
sequence number it will send (``SeqFile``: 8 bytes, big-endian, rewritten after every
send), and a fresh publisher of the same rank starts from it. An engine in the caller's
own process (offline ``LLM``) never restarts: it has no directory and counts from 0.
No torch, no zmq here.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Any, Optional

__all__ = ["attach_seq_dir", "seq_file_path", "SeqFile"]

_ATTR = "_seq_dir"  # set on the KVEventsConfig instance, not a dataclass field (no CLI flag)


def attach_seq_dir(kv_events_config: Any) -> Optional[str]:
    """The sequence directory of ``kv_events_config`` (a KVEventsConfig), made at the first
    call (a private temporary directory, removed when the config object is collected or
    the process exits); None when it publishes nothing. Call it in the process that
    spawns the engines, before pickling the config to them."""
    if kv_events_config is None or not kv_events_config.publishes:
        return None
    path = kv_events_config.__dict__.get(_ATTR)
    if path is None:
        path = tempfile.mkdtemp(prefix="llmserve-kv-events-seq-")
        object.__setattr__(kv_events_config, _ATTR, path)  # a frozen dataclass: not a field
        weakref.finalize(kv_events_config, shutil.rmtree, path, True)
    return path


def seq_file_path(kv_events_config: Any, data_parallel_rank: int) -> Optional[str]:
    """The sequence file of one rank's publisher, or None when the config carries no
    directory (an engine in its creator's process)."""
    path = getattr(kv_events_config, "__dict__", {}).get(_ATTR)
    if path is None or not os.path.isdir(path):
        return None
    return os.path.join(path, f"rank{int(data_parallel_rank)}")


class SeqFile:
    """The next sequence number of one publisher, kept in a file (``path``; None: kept
    nowhere, every publisher counts from 0). ``start``: the number to send first (0 for a
    new file). ``store(next_seq)`` records the number after a sent batch (one pwrite of
    8 bytes; an engine killed at any point leaves the last sent batch's successor)."""

    def __init__(self, path: Optional[str]) -> None:
        self.start = 0
        self._fd: Optional[int] = None
        if path is None:
            return
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            raw = os.pread(self._fd, 8, 0)
        except OSError:
            self.close()
            return
        if len(raw) == 8:
            self.start = int.from_bytes(raw, "big")

    def store(self, next_seq: int) -> None:
        if self._fd is not None:
            try:
                os.pwrite(self._fd, int(next_seq).to_bytes(8, "big"), 0)
            except OSError:
                pass

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
