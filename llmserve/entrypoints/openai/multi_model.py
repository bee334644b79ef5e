"""One server, several models (beyond vLLM, which needs one server per model).

``llmserve serve SmolLM2-135M-Instruct --extra-model all-MiniLM-L6-v2`` serves a chat
model and an embedding model from one process: each model has its own EngineCore
(AsyncLLM), renderer and handlers, and each request goes to the model its ``model``
field names.

- :func:`parse_extra_model` / :func:`extra_engine_args`: ``--extra-model`` values
  (``MODEL``, ``MODEL:RUNNER`` or a JSON dict of EngineArgs fields) -> AsyncEngineArgs;
  the extra engine shares the main one's resource flags (KV cache, batching, dtype...)
  but none of its model flags (:data:`MODEL_FIELDS`).
- :class:`ServedModel` and :class:`ModelRegistry`: served model name -> (engine client,
  handlers). A request without ``model`` goes to the first model that can serve its
  endpoint; an unknown name is a 404 listing every served name; a model that cannot
  serve the endpoint is a 400 naming ``model`` that points at the model that can (and at
  ``--runner generate`` / ``--runner pooling``).
- :class:`ModelRoutedHandler`: stands on ``app.state`` in place of one handler
  (``openai_serving_chat``...), so the endpoint routers stay unchanged.
- :class:`EngineGroup`: the engine clients as one for health, abort-all, death watch and
  the /metrics snapshot; :class:`MergedStatLoggers`: one /metrics exposition with every
  engine's series, told apart by the ``model_name`` label.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
from types import SimpleNamespace
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Optional, Sequence

from prometheus_client.metrics_core import Metric

from llmserve.engine_args import AsyncEngineArgs
from llmserve.entrypoints.openai.models.serving import BaseModelPath, ModelNotFoundError, OpenAIServingModels
from llmserve.entrypoints.openai.routed_admission import ModelRoutedAdmission
from llmserve.entrypoints.openai.tenants import watch_tenant_models
from llmserve.sampling_params import SamplingParamsError

# EngineArgs fields that describe a model, not the engine's resources: an extra model
# starts from their defaults, never from the main model's values. The LoRA fields are the
# main model's too (its --lora-modules, see per_model_args): copied, `--enable-lora
# --extra-model all-MiniLM-L6-v2` failed at start ("LoRA adapters run on the Llama family
# ..., not 'bert'"); an extra model's JSON may still set them for itself.
LORA_FIELDS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype")
MODEL_FIELDS = ("model", "served_model_name", "tokenizer", "tokenizer_mode", "revision", "tokenizer_revision",
                "max_model_len", "quantization", "load_format", "generation_config", "override_generation_config",
                "chat_template", "runner", "convert") + LORA_FIELDS
RUNNERS = ("auto", "generate", "pooling")

# Handler attribute on app.state -> (capability the model must have, the flag that gives it).
# "text" is generation from a text prompt: a speech model (Whisper) generates too, but only
# from audio, so chat/completions/responses must not be routed to it (they would fail with
# a chat-template or multi_modal_data error instead of naming `model`).
ROUTED_HANDLERS = {
    "openai_serving_chat": ("text", "--runner generate"),
    "openai_serving_completion": ("text", "--runner generate"),
    "openai_serving_responses": ("text", "--runner generate"),
    "openai_serving_embedding": ("embed", "--runner pooling"),
    "openai_serving_scores": ("score", "--runner pooling"),
    "openai_serving_classification": ("classify", "--convert classify"),
    "openai_serving_tokenization": (None, None),
    "openai_serving_transcription": ("transcription", "a Whisper model"),
}
# What a capability lets a model do, for the error message.
CAPABILITY_WORDS = {"text": "generate text from a text prompt", "embed": "pool (embeddings, score, rerank)",
                    "score": "score text pairs (score, rerank)", "classify": "classify text (a classification head)",
                    "transcription": "transcribe or translate audio"}


def capabilities_of(supported_tasks: Sequence[str]) -> tuple[str, ...]:
    """The endpoint capabilities (ROUTED_HANDLERS' names) of a model with vLLM's
    ``supported_tasks``: "transcription" (a speech model, which generates from audio
    only), else "text" for a generating model, plus "embed" for an embedding model,
    "classify" for a classification model and "score" for either that scores pairs
    (an embedding model or a one-label cross-encoder)."""
    caps = []
    if "transcription" in supported_tasks:
        caps.append("transcription")
    elif "generate" in supported_tasks:
        caps.append("text")
    if "embed" in supported_tasks:
        caps.append("embed")
    if "classify" in supported_tasks:
        caps.append("classify")
    if "embed" in supported_tasks or "score" in supported_tasks:
        caps.append("score")
    return tuple(caps)


# ----------------------------------------------------------------------------- flags
def parse_extra_model(value: str) -> dict[str, Any]:
    """One ``--extra-model`` value as EngineArgs overrides: ``MODEL``, ``MODEL:RUNNER``
    (RUNNER one of auto, generate, pooling) or a JSON object of EngineArgs fields with at
    least ``model`` (e.g. ``{"model": "SmolLM2-135M-Instruct", "runner": "pooling",
    "served_model_name": "smol-embed"}``). Raises argparse.ArgumentTypeError."""
    value = value.strip()
    if value.startswith("{"):
        try:
            spec = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON object: {value!r} ({e})") from e
        if not isinstance(spec, dict) or not isinstance(spec.get("model"), str) or not spec["model"]:
            raise argparse.ArgumentTypeError(f"a JSON --extra-model needs a string 'model', got {value!r}")
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown engine field(s) {unknown} in --extra-model {value!r}")
        return spec
    model, sep, runner = value.rpartition(":")
    if sep and runner in RUNNERS and model:
        return {"model": model, "runner": runner}
    if not value:
        raise argparse.ArgumentTypeError("--extra-model needs a model")
    return {"model": value}


def extra_engine_args(main: AsyncEngineArgs, spec: dict[str, Any]) -> AsyncEngineArgs:
    """The AsyncEngineArgs of one extra model: the main engine's resource fields, the
    defaults of :data:`MODEL_FIELDS`, then ``spec``. Raises ValueError for bad values."""
    defaults = AsyncEngineArgs()
    return dataclasses.replace(main, **{**{name: getattr(defaults, name) for name in MODEL_FIELDS}, **spec})


def per_model_args(args: argparse.Namespace, engine_args: AsyncEngineArgs) -> argparse.Namespace:
    """The server flags as seen by one model's handlers: its own model flags
    (``--chat-template``, names) instead of the main model's."""
    out = argparse.Namespace(**vars(args))
    for name in MODEL_FIELDS:
        setattr(out, name, getattr(engine_args, name))
    out.lora_modules = None  # --lora-modules are the main model's adapters
    return out


@contextlib.asynccontextmanager
async def build_extra_engine_clients(
        args: argparse.Namespace,
        build: Callable[[AsyncEngineArgs], Any]) -> AsyncIterator[list[tuple[Any, argparse.Namespace]]]:
    """Start one engine per ``args.extra_model`` (``build``: the async context manager
    factory of one engine client, api_server's ``build_async_engine_client_from_engine_args``)
    and yield ``[(engine_client, per-model args)]``; every engine is shut down on exit."""
    specs = getattr(args, "extra_model", None) or []
    main = AsyncEngineArgs.from_cli_args(args)
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for spec in specs:
            engine_args = extra_engine_args(main, spec)
            out.append((await stack.enter_async_context(build(engine_args)), per_model_args(args, engine_args)))
        yield out


# ----------------------------------------------------------------------------- registry
@dataclasses.dataclass
class ServedModel:
    """One model of the server: its engine client and the handlers built for it (a
    namespace filled by api_server's ``init_app_state``)."""

    engine_client: Any
    state: Any

    @property
    def names(self) -> list[str]:
        return self.state.openai_serving_models.model_names

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return tuple(getattr(self.engine_client.model_config, "supported_tasks", ("generate",)))

    @property
    def capabilities(self) -> tuple[str, ...]:
        """See :func:`capabilities_of`."""
        return capabilities_of(self.supported_tasks)


class ModelRegistry:
    """Served model name -> :class:`ServedModel`. Raises ValueError when two models
    share a name (give one ``served_model_name`` in its ``--extra-model`` JSON)."""

    def __init__(self, models: Sequence[ServedModel]):
        self.models = list(models)
        self.by_name: dict[str, ServedModel] = {}
        for m in self.models:
            for name in m.names:
                if name in self.by_name:
                    raise ValueError(f"--extra-model: two models are served as `{name}`; give one another name "
                                     "with '{\"model\": ..., \"served_model_name\": ...}'")
                self.by_name[name] = m

    @property
    def model_names(self) -> list[str]:
        return list(self.by_name)

    def resolve(self, name: Optional[str], task: Optional[str] = None, flag: Optional[str] = None) -> ServedModel:
        """The model a request names. ``name`` None or "": the first model with the
        capability ``task`` (see :func:`capabilities_of`). Raises ModelNotFoundError (404)
        for an unknown name, SamplingParamsError (400, param ``model``) naming the models
        that can when the named model cannot do ``task``."""
        if not name:
            return next((m for m in self.models if task is None or task in m.capabilities), self.models[0])
        model = self.by_name.get(name) or self._adapter_owner(name) or self._latest_owner(name)
        if model is None:
            raise ModelNotFoundError(name, self.model_names + self.serving_models().lora_names)
        if task is not None and task not in model.capabilities:
            raise SamplingParamsError(self._cannot_message(name, model, task, flag), "model")
        return model

    def _adapter_owner(self, name: str) -> Optional[ServedModel]:
        """The model whose engine serves the LoRA adapter ``name`` (loaded at any time)."""
        return next((m for m in self.models if m.state.openai_serving_models.lora_request(name) is not None), None)

    def _latest_owner(self, name: str) -> Optional[ServedModel]:
        """The model serving the name ``name`` differs from only by Ollama's default tag
        (``m:latest`` for ``m``: OpenAIServingModels.served_as), after exact names."""
        return next((m for m in self.models if m.state.openai_serving_models.served_as(name) is not None), None)

    def _cannot_message(self, name: str, model: ServedModel, task: str, flag: Optional[str]) -> str:
        able = [m.names[0] for m in self.models if task in m.capabilities]
        what = CAPABILITY_WORDS.get(task, task)
        can = ", ".join(f"`{a}`" for a in able)
        hint = (f" The models served here that can: {can} (send \"model\": \"{able[0]}\")." if able else
                " No model served here can.")
        does = ", ".join(CAPABILITY_WORDS.get(c, c) for c in model.capabilities) or "nothing this endpoint needs"
        return f"The model `{name}` cannot {what} (it can {does}).{hint} (A model for this endpoint: `{flag}`.)"

    def serving_models(self) -> OpenAIServingModels:
        """Every served name, for ``GET /v1/models`` (each card with its own context)."""
        paths = [BaseModelPath(p.name, p.model_path, m.state.openai_serving_models.max_model_len)
                 for m in self.models for p in m.state.openai_serving_models.base_model_paths]
        return OpenAIServingModels(paths, self.models[0].state.openai_serving_models.max_model_len,
                                   [a for m in self.models for a in m.state.openai_serving_models.lora])


class ModelRoutedHandler:
    """In place of one handler on ``app.state`` (``attr``, e.g. ``openai_serving_chat``):
    ``handler.method(request, ...)`` calls ``method`` on the handler of the model that
    ``request.model`` names (see :meth:`ModelRegistry.resolve`)."""

    def __init__(self, registry: ModelRegistry, attr: str):
        self._registry = registry
        self._attr = attr
        self._task, self._flag = ROUTED_HANDLERS[attr]

    def handler_for(self, request: Any, any_model: bool = False) -> Any:
        """The handler of the model ``request.model`` names; a 400 naming ``model`` when
        that model lacks this handler's capability, unless ``any_model`` (Ollama's
        embeddings, which a generating model serves from its hidden states)."""
        model = self._registry.resolve(getattr(request, "model", None), None if any_model else self._task,
                                       self._flag)
        return getattr(model.state, self._attr)

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)

        def call(request: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.handler_for(request), method)(request, *args, **kwargs)
        return call


# ----------------------------------------------------------------------------- engines, metrics
class EngineGroup:
    """Several engine clients seen as one by the server's lifecycle: ``check_health``
    and ``errored`` cover all, ``abort_all`` aborts in all, ``wait_for_engine_death``
    returns when the first one dies, ``get_engine_stats`` is a list (one per engine, for
    :class:`MergedStatLoggers`). Anything else is the main (first) engine's."""

    def __init__(self, engines: Sequence[Any]):
        self.engines = list(engines)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engines[0], name)

    @property
    def errored(self) -> bool:
        return any(e.errored for e in self.engines)

    async def check_health(self) -> None:
        for e in self.engines:
            await e.check_health()

    async def abort_all(self) -> int:
        return sum(await asyncio.gather(*(e.abort_all() for e in self.engines)))

    async def wait_for_engine_death(self) -> BaseException:
        tasks = [asyncio.ensure_future(e.wait_for_engine_death()) for e in self.engines]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            return next(iter(done)).result()
        finally:
            for t in tasks:
                t.cancel()

    async def get_engine_stats(self) -> list[dict]:
        return list(await asyncio.gather(*(e.get_engine_stats() for e in self.engines)))


class MergedStatLoggers:
    """The PrometheusStatLoggers of several engines as one /metrics exposition: each
    metric family once, with every engine's samples (labelled by ``model_name``)."""

    def __init__(self, loggers: Sequence[Any]):
        self.loggers = list(loggers)
        self.content_type = self.loggers[0].content_type

    @property
    def registry(self) -> Any:
        """The first engine's registry: server-wide families (the tenants' counters of
        ``tenant_quotas``) register there and :meth:`collect` shows them once."""
        return self.loggers[0].registry

    def set_engine_stats(self, stats: Sequence[dict]) -> None:
        """``stats``: one snapshot per engine, as :meth:`EngineGroup.get_engine_stats`."""
        for sl, s in zip(self.loggers, stats):
            sl.set_engine_stats(s)

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        seen: set = set()
        for sl in self.loggers:
            for fam in sl.registry.collect():
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    if key not in seen:  # label-less info gauges are the same in every engine
                        seen.add(key)
                        out.samples.append(s)
        return merged.values()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self)  # type: ignore[arg-type]  # anything with collect()


# ----------------------------------------------------------------------------- app state
async def init_multi_model_state(
        engines: Sequence[tuple[Any, argparse.Namespace]], state: Any,
        init_app_state: Callable[[Any, Any, argparse.Namespace], Awaitable[None]]) -> EngineGroup:
    """Build each model's handlers (``init_app_state`` into a namespace of its own) and
    put on ``state`` what the routers read: one :class:`ModelRoutedHandler` per handler,
    the merged model list, the engine group, the merged stat loggers, and
    ``served_models`` (each model's namespace, for shutdown). Returns the EngineGroup.
    Raises ValueError when two models share a served name."""
    served = []
    for engine_client, args in engines:
        ns = SimpleNamespace()
        await init_app_state(engine_client, ns, args)
        served.append(ServedModel(engine_client, ns))
    registry = ModelRegistry(served)
    group = EngineGroup([m.engine_client for m in served])
    for attr in ROUTED_HANDLERS:
        setattr(state, attr, ModelRoutedHandler(registry, attr))
    main = served[0].state
    state.model_registry = registry
    state.served_models = [m.state for m in served]
    state.engine_client = group
    state.openai_serving_models = registry.serving_models()
    state.openai_serving_render = main.openai_serving_render  # /tokenizer_info: the main model's template
    state.lora_adapters = main.lora_adapters  # /v1/load_lora_adapter loads into the main model's engine
    state.stat_logger = MergedStatLoggers([m.state.stat_logger for m in served])
    state.admission = ModelRoutedAdmission(registry, [m.state.admission for m in served])
    watch_tenant_models(state)  # allowed_models against every model's names (each ns above has no keyring)
    return group
