"""The engine's adapters (vLLM's ``add_lora`` / ``remove_lora`` / ``list_loras`` /
``pin_lora`` utilities): which are loaded, which are pinned, and removals deferred while
requests still use the adapter.

Up to ``max_cpu_loras`` adapters stay loaded; loading one more unloads the least recently
used adapter that is neither pinned nor used by a request (when every one is, the bound
is exceeded until their requests finish). The weights live in the workers (the executor's
``read_lora`` / ``add_lora`` / ``remove_lora``); ``read`` may run in a thread (it touches no
engine state), ``add`` runs between steps."""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Any, Callable

from llmserve.lora.config import LoRAConfig
from llmserve.lora.errors import LoRAAdapterError
from llmserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRARegistry:
    """``executor``: the engine's executor; ``in_use``: the set of adapter ids of the
    scheduler's unfinished requests (called when deciding evictions and removals)."""

    def __init__(self, config: LoRAConfig, executor: Any, in_use: Callable[[], set[int]]) -> None:
        self.config = config
        self.executor = executor
        self.in_use = in_use
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()  # LRU first
        self.pinned: set[int] = set()
        self.removing: set[int] = set()  # removed while in use: unloaded when idle
        self.evicted: set[int] = set()  # unloaded for room (max_cpu_loras): re-read when next used

    def read(self, request: LoRARequest) -> Any:
        """Read the adapter's files (safe off the step loop). Raises LoRAAdapterError
        (:meth:`explain`'s, for an evicted adapter whose files are gone)."""
        try:
            return self.executor.read_lora(request)
        except LoRAAdapterError as e:
            raise self.explain(request, e) from None

    def explain(self, request: LoRARequest, error: LoRAAdapterError) -> LoRAAdapterError:
        """``error`` as the client of a request for ``request``'s adapter should read it:
        an adapter unloaded to make room (max_cpu_loras) is re-read from its path when
        next used; when that path is gone the request names the model (``param``
        "model") and says the files are gone, rather than a ``lora_path`` it never sent.
        Any other error unchanged."""
        if request.lora_int_id not in self.evicted or error.param != "lora_path" \
                or os.path.exists(request.lora_path or ""):
            return error
        return LoRAAdapterError(
            f"The model {request.lora_name!r} (a LoRA adapter) cannot be used: it was unloaded to make room "
            f"(--max-cpu-loras) and its files at {request.lora_path!r} are gone, so it cannot be reloaded. "
            "Load it again from a path that exists, or unload it.",
            "model")

    def add(self, request: LoRARequest, weights: Any = None) -> bool:
        """Load (or with ``load_inplace`` / a new path, reload) ``request``'s adapter.
        Returns False when it is already loaded as is (vLLM)."""
        lid = request.lora_int_id
        old = self.loaded.get(lid)
        if old is not None and old.lora_path == request.lora_path and not request.load_inplace \
                and lid not in self.removing:
            self.loaded.move_to_end(lid)
            return False
        if old is None:
            self._make_room()
        try:
            self.executor.add_lora(request, weights)
        except LoRAAdapterError as e:
            raise self.explain(request, e) from None
        self.evicted.discard(lid)
        self.removing.discard(lid)
        self.loaded[lid] = request
        self.loaded.move_to_end(lid)
        logger.info("LoRA adapter %r (id %d) loaded from %r", request.lora_name, lid, request.lora_path)
        return True

    def _make_room(self, room: int = 1) -> None:
        """Unload least recently used idle adapters until ``room`` more fit in
        max_cpu_loras. Adapters that requests use (or that are pinned) stay: the bound is
        then exceeded until they finish (``release_idle`` trims it), rather than a
        request being refused for a full cache."""
        excess = len(self.loaded) + room - self.config.cpu_capacity
        if excess <= 0:
            return
        busy = self.in_use()
        for lid in [i for i in self.loaded if i not in self.pinned and i not in busy][:excess]:
            self._unload(lid)
            self.evicted.add(lid)

    def _unload(self, lid: int) -> None:
        self.loaded.pop(lid, None)
        self.pinned.discard(lid)
        self.removing.discard(lid)
        self.executor.remove_lora(lid)

    def remove(self, lora_id: int) -> bool:
        """Unload an adapter (once its requests finish); False when it is not loaded."""
        if lora_id not in self.loaded or lora_id in self.removing:
            return False
        if lora_id in self.in_use():
            self.removing.add(lora_id)
        else:
            self._unload(lora_id)
        return True

    def release_idle(self) -> None:
        """Unload the removed adapters whose requests have all finished, and idle ones
        past max_cpu_loras (after a step)."""
        if self.removing:
            busy = self.in_use()
            for lid in [i for i in self.removing if i not in busy]:
                self._unload(lid)
        if len(self.loaded) > self.config.cpu_capacity:
            self._make_room(0)

    def list(self) -> set[int]:
        return {i for i in self.loaded if i not in self.removing}

    def pin(self, lora_id: int) -> bool:
        """Keep an adapter loaded whatever the LRU says (vLLM's pin_lora)."""
        if lora_id not in self.loaded:
            raise LoRAAdapterError(f"LoRA adapter {lora_id} is not loaded", "lora_int_id")
        self.pinned.add(lora_id)
        return True

    def is_ready(self, request: LoRARequest) -> bool:
        """Whether a new request's adapter is loaded under this id (else it must be)."""
        old = self.loaded.get(request.lora_int_id)
        return old is not None and request.lora_int_id not in self.removing and old.lora_path == request.lora_path
