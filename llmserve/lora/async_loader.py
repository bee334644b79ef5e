"""Loading adapters off the engine's step loop (EngineCoreProc): a thread reads and
converts the files, then hands the weights to the loop through its input queue, where
they are swapped in between two steps - streams of other requests do not pause for the
read (the swap itself is a dict insert; slots are written when a step first needs them).

Two callers: the ``add_lora`` utility (its answer is sent once the swap is done) and a
request whose adapter is not loaded yet (the request is added after the swap)."""
from __future__ import annotations

import queue
import threading
from typing import Any

from llmserve.lora.request import LoRARequest

#: Input-queue item type of a finished read: ``(LORA_READY, LoRAReady)``.
LORA_READY = "lora_ready"


class LoRAReady:
    """A finished read: what to do next (``kind``: "utility" or "request", with its
    ``payload``), the request, the weights read (None on error) and the error."""

    __slots__ = ("kind", "payload", "lora_request", "weights", "error")

    def __init__(self, kind: str, payload: Any, lora_request: LoRARequest, weights: Any,
                 error: BaseException | None) -> None:
        self.kind, self.payload, self.lora_request = kind, payload, lora_request
        self.weights, self.error = weights, error


def read_in_thread(registry: Any, lora_request: LoRARequest, kind: str, payload: Any,
                   input_queue: queue.Queue) -> threading.Thread:
    """Start a daemon thread that reads ``lora_request``'s adapter with ``registry.read``
    and puts ``(LORA_READY, LoRAReady)`` on ``input_queue``."""
    def run() -> None:
        try:
            item = LoRAReady(kind, payload, lora_request, registry.read(lora_request), None)
        except Exception as e:  # noqa: BLE001 - reported to the caller, the engine goes on
            item = LoRAReady(kind, payload, lora_request, None, e)
        input_queue.put((LORA_READY, item))

    t = threading.Thread(target=run, daemon=True, name=f"lora-load-{lora_request.lora_int_id}")
    t.start()
    return t
