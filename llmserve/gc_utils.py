"""Garbage-collector settings for long-running processes (the API server, EngineCore).

CPython's full (generation 2) collection walks every tracked object. After start-up an
API server holds ~250k of them (torch, transformers, pydantic, FastAPI), and one full
pass took 150-900 ms on the 2-core test machine: the event loop stood still for that
long, which was the cause of the /health latency spikes (issue 17), idle or not. The
objects alive after start-up live as long as the process, so they are moved to the
permanent generation (``gc.freeze``, as CPython's docs advise for servers, and as
vLLM's ``freeze_gc_heap`` does after start-up): later collections look only at objects
created while serving.
"""
from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_gc_heap(what: str) -> None:
    """Collect once, then freeze every surviving object out of future collections.
    Call once, when start-up is done (model loaded, app built); ``what`` names the
    process in the log line."""
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.debug("%s: froze %d start-up objects out of the GC in %.0f ms", what, gc.get_freeze_count(),
                 (time.perf_counter() - t) * 1000)
