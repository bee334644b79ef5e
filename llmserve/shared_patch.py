"""One module attribute replaced while any holder needs it (re-entrant, thread-safe): the
GGUF reads swap a function or class of a library for the span of a read, and a model's
config and tokenizer load in two threads at once, so the first holder in sets it and the
last one out restores it. Imports nothing of llmserve (torch_hiding uses it before
transformers is imported)."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator


class SharedPatch:
    """``applied(obj, name, value)``: ``obj.name`` is ``value`` while any holder is inside
    the block (a depth count under a lock), then what it was before the first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: Any = None

    @contextlib.contextmanager
    def applied(self, obj: Any, name: str, value: Any) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._saved = getattr(obj, name)
                setattr(obj, name, value)
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    setattr(obj, name, self._saved)
                    self._saved = None
