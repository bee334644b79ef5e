"""LoRA adapters served by name (the LoRA half of vLLM's ``OpenAIServingModels``).

``--lora-modules name=path`` (or vLLM's JSON ``{"name", "path", "base_model_name"}``)
loads adapters at start; ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``
(see ``lora_router.py``) add and remove them at run time. A request picks an adapter by
naming it in ``model``; :meth:`LoRAAdapters.get` gives its ``LoRARequest`` for
``engine_client.generate(..., lora_request=)``.

The engine does the loading and the math (``AsyncLLM.add_lora`` / ``remove_lora``, issue
28's engine half); this module keeps the names, the ids and the requests in flight: an
adapter unloaded (or replaced with ``load_inplace``) while requests use it leaves the
name at once (new requests get 404) and the engine only when its last request ends.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextvars
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from llmserve.engine.exceptions import EngineDeadError
from llmserve.entrypoints.openai.common.errors import NotFoundError
from llmserve.entrypoints.openai.models.protocol import (LoadLoRAAdapterRequest, ModelCard,
                                                         UnloadLoRAAdapterRequest)
from llmserve.sampling_params import SamplingParamsError
from llmserve.served_names import check_served_name

logger = logging.getLogger("llmserve.entrypoints.openai")

# The adapter the current HTTP request picked with ``model`` (its adapter table and
# LoRARequest), set by the handlers' ``_check_model`` and read where they call the
# engine: every endpoint then reaches the adapter without threading it through each
# handler's call chain (as ``deadline.py`` carries X-Request-Timeout). Each request runs
# in its own task, so its own context.
_CURRENT: contextvars.ContextVar[Optional[tuple["LoRAAdapters", Any]]] = contextvars.ContextVar(
    "llmserve_lora_request", default=None)


def select_lora(models: Any, name: Optional[str], supported: bool = True) -> None:
    """Remember which adapter (if any) the served name ``name`` is, for this request's
    engine calls (:func:`lora_call`). ``models``: the handler's OpenAIServingModels.
    Raises SamplingParamsError (param ``model``) when ``supported`` is False (an
    endpoint that cannot run an adapter): never the base model in its place."""
    adapters = models.adapters_of(name) if getattr(models, "lora", None) else None
    if adapters is not None and not supported:
        raise SamplingParamsError(f"The model `{name}` is a LoRA adapter, which this endpoint cannot run; "
                                  f"use the base model `{adapters.parents[name]}`.", "model")
    _CURRENT.set((adapters, adapters.get(name)) if adapters is not None else None)


def lora_call(start: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``start(*args, **kwargs)`` (``engine_client.generate`` / ``encode``) with this
    request's ``lora_request`` added when it picked an adapter, and the generator
    counted in flight for that adapter until it ends."""
    picked = _CURRENT.get()
    if picked is None:
        return start(*args, **kwargs)
    adapters, lora = picked
    return adapters.track(lora, start(*args, lora_request=lora, **kwargs))


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's): served ``name``, the adapter's ``path``
    (PEFT directory or GGUF LoRA file) and the base model it belongs to (``parent`` in
    ``/v1/models``; None: the first served name). Raises ValueError naming
    ``--lora-modules`` for an empty field or a ``name`` that breaks the served-name rule
    (``llmserve.served_names``), so a bad name stops the server at start-up."""

    name: str
    path: str
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        for field in ("name", "path"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise ValueError(f"--lora-modules: '{field}' must be a non-empty string, got {value!r}")
        check_served_name(self.name, "--lora-modules name")


def parse_lora_module(value: str) -> LoRAModulePath:
    """One ``--lora-modules`` value: ``name=path`` or a JSON object with ``name``,
    ``path`` and optionally ``base_model_name`` (vLLM's two forms). Raises
    argparse.ArgumentTypeError naming what is wrong."""
    value = value.strip()
    if value.startswith("{"):
        try:
            spec = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"invalid JSON for --lora-modules: {value!r} ({e})") from e
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"}) if isinstance(spec, dict) else None
        if unknown is None or unknown:
            raise argparse.ArgumentTypeError(f"--lora-modules JSON takes 'name', 'path' and 'base_model_name', "
                                             f"got {value!r}")
        try:
            return LoRAModulePath(**spec)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"invalid --lora-modules value {value!r}: expected 'name=path' or JSON "
                                         "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    try:
        return LoRAModulePath(name, path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _Tracked:
    """An engine generator that counts as one request in flight for its adapter until
    it ends, fails or is closed (``release`` runs once). A class, not an async
    generator function: a generator closed before its first ``__anext__`` never runs
    its ``finally``, which would leak the count."""

    def __init__(self, gen: Any, release: Callable[[], None]):
        self._gen = gen
        self._release: Optional[Callable[[], None]] = release

    def _done(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __aiter__(self) -> "_Tracked":
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._gen.__anext__()
        except BaseException:
            self._done()
            raise

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()
        finally:
            self._done()

    def __del__(self) -> None:
        self._done()


class LoRAAdapters:
    """The adapters of one engine, by served name.

    engine_client: the AsyncLLM (``add_lora(LoRARequest) -> bool``, ``remove_lora(id)``).
    base_names: the base model's served names (an adapter may not take one).
    Errors: SamplingParamsError (400, ``param`` the body field) for a bad or duplicate
    name and for anything the engine refuses (rank, shapes, a missing or corrupt file);
    NotFoundError (404) to unload an adapter that is not loaded.
    """

    def __init__(self, engine_client: Any, base_names: Sequence[str]):
        self.engine_client = engine_client
        self.base_names = list(base_names)
        self.lora_requests: dict[str, Any] = {}
        self.parents: dict[str, str] = {}
        self._next_id = 1
        self._in_flight: collections.Counter[int] = collections.Counter()
        self._retired: set[int] = set()  # ids out of the name table, removed when idle
        self._tasks: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()

    # ---- lookup
    def get(self, name: Optional[str]) -> Optional[Any]:
        """The LoRARequest served as ``name`` (None: not an adapter)."""
        return self.lora_requests.get(name) if name else None

    def cards(self, created: int, max_model_len: Optional[int]) -> list[ModelCard]:
        """``/v1/models`` entries (vLLM's): ``root`` the adapter's path, ``parent`` its base."""
        return [ModelCard(id=name, created=created, root=req.lora_path, parent=self.parents[name],
                          max_model_len=max_model_len) for name, req in self.lora_requests.items()]

    # ---- load / unload
    async def load_static(self, modules: Sequence[LoRAModulePath]) -> None:
        """Load each ``--lora-modules`` entry. Raises ValueError naming ``--lora-modules``."""
        seen: set[str] = set()
        for m in modules:
            if m.name in seen:
                raise ValueError(f"--lora-modules: the name {m.name!r} is given twice (each adapter needs "
                                 "its own name)")
            seen.add(m.name)
            try:
                await self.load(LoadLoRAAdapterRequest(lora_name=m.name, lora_path=m.path), m.base_model_name)
            except (ValueError, NotFoundError) as e:
                raise ValueError(f"--lora-modules {m.name!r}={m.path!r}: {e}") from e

    async def load(self, request: LoadLoRAAdapterRequest, base_model_name: Optional[str] = None) -> str:
        """Load an adapter into the engine and serve it as ``request.lora_name``; returns
        vLLM's success text. Raises SamplingParamsError (400) naming the field, also for a
        name that breaks the served-name rule (``llmserve.served_names``). Names and paths
        are quoted with ``repr`` in messages and logs: a path is the client's text too."""
        from llmserve.lora.request import LoRARequest

        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise SamplingParamsError("Both 'lora_name' and 'lora_path' must be provided.",
                                      "lora_name" if not name else "lora_path")
        check_served_name(name, "lora_name")
        if name in self.base_names:
            raise SamplingParamsError(f"The lora adapter name {name!r} is the base model's served name.", "lora_name")
        if base_model_name is not None and base_model_name not in self.base_names:
            raise SamplingParamsError(f"base_model_name {base_model_name!r} is not served here (served: "
                                      f"{', '.join(self.base_names)}).", "base_model_name")
        async with self._lock:
            old = self.lora_requests.get(name)
            if old is not None and not request.load_inplace:
                raise SamplingParamsError(
                    f"The lora adapter {name!r} has already been loaded. If you want to load the adapter in "
                    "place, set 'load_inplace' to True.", "lora_name")
            parent = base_model_name or self.base_names[0]
            lora = LoRARequest(lora_name=name, lora_int_id=self._next_id, lora_path=path, base_model_name=parent)
            self._next_id += 1
            await self._add_to_engine(lora)
            self.lora_requests[name] = lora
            self.parents[name] = parent
            if old is not None:
                await self._retire(old.lora_int_id)
        logger.info("Loaded LoRA adapter %r (id %d) from %r", name, lora.lora_int_id, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def _add_to_engine(self, lora: Any) -> None:
        """``add_lora``; whatever the engine refuses is a 400 (vLLM's), the field its
        typed error names (``LoRAAdapterError.param``) or ``lora_path``."""
        try:
            # False: the engine has this id already (another API server of --api-server-count
            # loaded the same --lora-modules entry under the same id first): fine.
            await self.engine_client.add_lora(lora)
        except EngineDeadError:
            raise
        except Exception as e:
            raise SamplingParamsError(f"Cannot load the LoRA adapter {lora.lora_name!r}: {e}",
                                      getattr(e, "param", None) or "lora_path") from e

    async def unload(self, request: UnloadLoRAAdapterRequest) -> str:
        """Stop serving an adapter (vLLM's ``unload_lora_adapter``); the engine drops it
        when its last request ends. Raises NotFoundError (404) / SamplingParamsError."""
        name = request.lora_name
        if not name:
            raise SamplingParamsError("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        async with self._lock:
            lora = self.lora_requests.get(name)
            if lora is None:
                raise NotFoundError(f"The lora adapter {name!r} cannot be found.", "lora_name")
            if request.lora_int_id is not None and request.lora_int_id != lora.lora_int_id:
                raise SamplingParamsError(f"The lora adapter {name!r} has id {lora.lora_int_id}, not "
                                          f"{request.lora_int_id}.", "lora_int_id")
            del self.lora_requests[name], self.parents[name]
            await self._retire(lora.lora_int_id)
        logger.info("Unloaded LoRA adapter %r (id %d)", name, lora.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def _retire(self, lora_id: int) -> None:
        if self._in_flight[lora_id]:
            self._retired.add(lora_id)
        else:
            await self.engine_client.remove_lora(lora_id)

    # ---- requests in flight
    def track(self, lora: Any, gen: Any) -> Any:
        """``gen`` (an engine generator for ``lora``) counted in flight until it ends."""
        lora_id = lora.lora_int_id
        self._in_flight[lora_id] += 1
        return _Tracked(gen, lambda: self._release(lora_id))

    def in_flight(self, lora_id: int) -> int:
        """Requests of this server running on the adapter ``lora_id`` now."""
        return self._in_flight[lora_id]

    def _release(self, lora_id: int) -> None:
        self._in_flight[lora_id] -= 1
        if self._in_flight[lora_id] > 0:
            return
        del self._in_flight[lora_id]
        if lora_id in self._retired:
            self._retired.discard(lora_id)
            try:
                task = asyncio.get_running_loop().create_task(self.engine_client.remove_lora(lora_id))
            except RuntimeError:  # no loop (interpreter exit): the engine goes with it
                return
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


async def start_lora_adapters(engine_client: Any, base_names: Sequence[str],
                              modules: Optional[Sequence[LoRAModulePath]]) -> Optional[LoRAAdapters]:
    """The adapters of a server's engine, with ``--lora-modules`` loaded; None when the
    engine runs without ``--enable-lora``. Raises ValueError for ``--lora-modules``
    without ``--enable-lora`` or an adapter that does not load."""
    config = getattr(engine_client, "vllm_config", None)
    enabled = getattr(config, "lora_config", None) is not None
    if not enabled:
        if modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    adapters = LoRAAdapters(engine_client, base_names)
    await adapters.load_static(modules or ())
    return adapters

