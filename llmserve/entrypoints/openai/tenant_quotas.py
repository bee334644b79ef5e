"""Per-tenant quotas at the door (issue 34): before a generation request is parsed or
rendered, its tenant (``--api-keys-file``) must be under its own limits, else 429 with
``Retry-After`` from that tenant's own drain rate and the OpenAI error body naming the
limit; other tenants are not affected, and the refused request never reaches the global
admission queue (so a flooder's overload is answered to the flooder).

- ``max_concurrent_requests``: requests of the tenant in flight (admitted, response not
  ended). Retry-After: the time for one of them to end at the rate the tenant's requests
  ended per second of its busy time over the last 30 s (admission.py's DrainRate).
- ``max_tokens_per_second``: a token bucket of ``burst_tokens`` (default: one second's
  worth). A request costs, as OpenAI's rate limiter counts it, the tokens it may use:
  its ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` (256 when
  absent), times its fan-out (prompts × ``n``: each sequence may write that many), plus
  its body's bytes / 4 (a prompt estimate before any rendering). A request
  is admitted while the bucket is above zero and may take it into debt; Retry-After is
  the time to refill the debt at the tenant's rate.
- ``allowed_models``: another model answers 404, as if it did not exist. This is checked
  on the tracked routes and on every other route that names a model
  (:data:`MODEL_NAMING_PATHS`: tokenize, count_tokens, Ollama's show, adapter unload),
  whose requests are not counted against the quotas. A multipart body (speech to text)
  names its model in its form.

``/metrics``: ``vllm:tenant_requests_total{tenant,outcome}`` (admitted, or the refusal's
reason: a tenant quota's ``tenant_*`` one, or, for a request under its tenant's quotas that
the global admission refused, the admission's own reason, as in
``vllm:request_rejected_total``: ``queue_delay``, ``queue_full``, ...) and ``vllm:tenant_in_flight_requests{tenant}``; names come only from the keys
file and "default", so the label set is bounded.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from starlette.datastructures import Headers
from starlette.requests import Request

from llmserve.entrypoints.openai.admission import MAX_RETRY_AFTER_S, DrainRate, _buffered_body
from llmserve.entrypoints.openai.admission_precheck import Prechecks, malformed_response
from llmserve.entrypoints.openai.common.errors import error_response_from_exception, make_error
from llmserve.entrypoints.openai.fan_out import fan_out_of
from llmserve.entrypoints.ollama.names import match_name, not_found
from llmserve.entrypoints.openai.models.serving import ModelNotFoundError
from llmserve.sampling_params import SamplingParamsError
from llmserve.served_names import latest_match
from llmserve.entrypoints.openai.server_load import TRACKED_PATHS
from llmserve.entrypoints.openai.server_utils import json_response
from llmserve.entrypoints.openai.tenants import TENANT_IN_FLIGHT_KEY, TENANT_OUTCOME_KEY, Tenant, tenant_of

DEFAULT_OUTPUT_ESTIMATE = 256  # tokens counted for a request that sets no output limit
BYTES_PER_TOKEN = 4  # prompt estimate before rendering (~4 bytes of English per token)
_MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "num_predict")
# Routes outside TRACKED_PATHS whose body names a model, with the fields that name it
# (Ollama's /api/show still takes the older ``name``). They are checked against
# ``allowed_models`` only: the trial of stop 42 found /tokenize and count_tokens answering
# 200 on models the key may not call.
MODEL_NAMING_PATHS = {"/tokenize": ("model",), "/detokenize": ("model",), "/v1/messages/count_tokens": ("model",),
                      "/v1/responses/input_tokens": ("model",),
                      "/v1/completions/render": ("model",), "/v1/chat/completions/render": ("model",),
                      "/api/show": ("model", "name"), "/v1/unload_lora_adapter": ("lora_name",),
                      "/api/pull": ("model", "name"), "/api/push": ("model", "name"), "/api/delete": ("model", "name"),
                      "/api/copy": ("source",)}


@dataclass
class _TenantState:
    in_flight: int = 0
    level: Optional[float] = None  # token bucket (None: full, set on first use)
    stamp: float = 0.0
    drain: DrainRate = field(default_factory=DrainRate)


def request_cost(body: bytes, path: str = "") -> int:
    """Tokens a request may use (see the module docstring): output limit × its fan-out
    (prompts × n, fan_out.py: each sequence may write the limit) + bytes / 4."""
    limit = None
    try:
        parsed = json.loads(body) if body else {}
        if isinstance(parsed, dict):
            limit = next((parsed[k] for k in _MAX_TOKEN_FIELDS if isinstance(parsed.get(k), int)), None)
    except (ValueError, UnicodeDecodeError, RecursionError):
        pass  # the route answers the bad body with its own 400
    output = limit if limit is not None and limit > 0 else DEFAULT_OUTPUT_ESTIMATE
    return output * fan_out_of(body, path).sequences + len(body) // BYTES_PER_TOKEN


def callable_models(tenant: Tenant, state: Any) -> list[str]:
    """The served names (base models and LoRA adapters) ``tenant`` may call, for the 404's
    list: never a name the server does not serve."""
    serving = getattr(state, "openai_serving_models", None)
    served = (serving.model_names + serving.lora_names) if serving is not None else []
    return [n for n in served if tenant.allowed_models is None or latest_match(n, tenant.allowed_models) is not None]


def _default_model_allowed(tenant: Tenant, state: Any) -> bool:
    """Whether a request that names no model may run for a tenant with ``allowed_models``.
    Such a request goes to the default model (one model: any of its names; on an
    ``--extra-model`` server, the first that can serve the endpoint), so it may run
    only when the tenant may call every model it could reach."""
    allowed = tenant.allowed_models or ()

    def any_allowed(names: list[str]) -> bool:
        return any(latest_match(n, allowed) is not None for n in names)
    registry = getattr(state, "model_registry", None)
    if registry is not None:
        return all(any_allowed(m.names) for m in registry.models)
    serving = getattr(state, "openai_serving_models", None)
    return serving is not None and any_allowed(serving.model_names)


def model_refusal(tenant: Tenant, model: Optional[str], state: Any,
                  ollama_route: Optional[str] = None) -> Optional[Exception]:
    """The error for a request of ``tenant`` naming ``model`` (None or "": the default)
    when its ``allowed_models`` does not let it call that model: ModelNotFoundError
    (404, as if the model did not exist, listing what it may call), or, for a request
    that names no model where the default is not one it may call,
    SamplingParamsError (400, param ``model``) asking it to name one. None: allowed.
    Leaving ``model`` out must not reach a model the key is not allowed (trial of stop 42).
    ``ollama_route``: the path of an Ollama route (``/api/chat``...) the request is on,
    where names match by Ollama's rule (ollama/names.py: ``NAME:latest`` and ``name``
    call ``NAME``), so it is allowed when the name it calls is, and refused with Ollama's
    404 for that route."""
    if tenant.allowed_models is None:
        return None
    if model:
        if ollama_route is not None:
            if match_name(model, tenant.allowed_models) is not None:
                return None
            return not_found(model, ollama_route)
        if latest_match(model, tenant.allowed_models) is not None:  # m:latest is m (served_names)
            return None
        return ModelNotFoundError(model, callable_models(tenant, state))
    if _default_model_allowed(tenant, state):
        return None
    names = ", ".join(f"`{n}`" for n in callable_models(tenant, state))
    if not names:
        return SamplingParamsError("This API key may call none of the models served here.", "model")
    return SamplingParamsError(f"This API key may call only some of the models served here ({names}): "
                               "name one in `model`.", "model")


async def _model_of(scope: dict, body: bytes, fields: tuple[str, ...] = ("model",)) -> Optional[str]:
    """The model a request names: the first of ``fields`` in its JSON body, or the
    ``model`` field of a form body (multipart speech to text). None: names none."""
    content_type = Headers(scope=scope).get("content-type", "")
    if content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        return await _form_model(scope, body)
    try:
        parsed = json.loads(body) if body else {}
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    return next((parsed[f] for f in fields if isinstance(parsed.get(f), str) and parsed[f]), None)


async def _form_model(scope: dict, body: bytes) -> Optional[str]:
    """The ``model`` field of a form body, parsed by Starlette as the route will parse it
    (a body it cannot parse names no model: the route answers it with its own 400)."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}
    try:
        form = await Request(scope, receive).form()
    except Exception:  # noqa: BLE001 - malformed multipart: the route reports it
        return None
    try:
        model = form.get("model")
        return model if isinstance(model, str) and model else None
    finally:
        await form.close()


class TenantQuotas:
    """The tenants' quota state (per tenant name, kept across key reloads, so a reload
    never resets a tenant's count of requests in flight). ``clock``: monotonic seconds."""

    def __init__(self, registry: Any = None, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.states: dict[str, _TenantState] = {}
        self._metrics = _TenantMetrics(registry) if registry is not None else None

    def state(self, name: str) -> _TenantState:
        if name not in self.states:
            self.states[name] = _TenantState(drain=DrainRate(clock=self.clock))
        return self.states[name]

    def _refill(self, tenant: Tenant, st: _TenantState) -> float:
        rate = tenant.max_tokens_per_second
        burst = float(tenant.burst_tokens or max(rate, 1.0))
        now = self.clock()
        st.level = burst if st.level is None else min(burst, st.level + (now - st.stamp) * rate)
        st.stamp = now
        return st.level

    def check(self, tenant: Tenant, cost: int, count_admitted: bool = True) -> Optional[tuple[str, int, str]]:
        """``(reason, retry_after_s, message)`` when ``tenant`` is over a limit, else None
        (then the request is admitted: call :meth:`release` when its response ends).
        count_admitted: False leaves the "admitted" outcome to the caller
        (:meth:`outcome`: the global admission decides it)."""
        st = self.state(tenant.name)
        limit = tenant.max_concurrent_requests
        if limit is not None and st.in_flight >= limit:
            return ("tenant_max_concurrent_requests", st.drain.retry_after(st.in_flight - limit + 1),
                    f"Tenant {tenant.name!r} has {st.in_flight} requests in flight, its limit "
                    f"(max_concurrent_requests {limit}). Retry later.")
        if tenant.max_tokens_per_second is not None:
            level = self._refill(tenant, st)
            if level <= 0:
                wait = (1.0 - level) / tenant.max_tokens_per_second
                return ("tenant_max_tokens_per_second", int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(wait)))),
                        f"Tenant {tenant.name!r} is over its token rate (max_tokens_per_second "
                        f"{tenant.max_tokens_per_second:g}). Retry later.")
            st.level -= cost
        if st.in_flight == 0:
            st.drain.start_work()  # the tenant's busy time starts: its idle time is no drain
        st.in_flight += 1
        self._count(tenant.name, "admitted" if count_admitted else None, st)
        return None

    def outcome(self, tenant: Tenant, refusal: Optional[str]) -> None:
        """Count the outcome of a request that passed ``tenant``'s quotas
        (``check(count_admitted=False)``): "admitted", or ``refusal``, the reason the
        global admission refused it."""
        self._count(tenant.name, refusal or "admitted", self.state(tenant.name))

    def release(self, tenant: Tenant) -> None:
        """An admitted request's response ended: it counts toward the tenant's drain rate."""
        st = self.state(tenant.name)
        st.in_flight -= 1
        st.drain.record()
        if st.in_flight <= 0:
            st.drain.stop_work()
        self._count(tenant.name, None, st)

    def refused(self, tenant: Tenant, reason: str) -> None:
        self._count(tenant.name, reason, self.state(tenant.name))

    def _count(self, name: str, outcome: Optional[str], st: _TenantState) -> None:
        if self._metrics is not None:
            self._metrics.update(name, outcome, st.in_flight)


class _TenantMetrics:
    """The per-tenant Prometheus families, in the server's /metrics registry."""

    def __init__(self, registry: Any):
        from prometheus_client import Counter, Gauge
        self.requests = _family(registry, "vllm:tenant_requests", lambda: Counter(
            "vllm:tenant_requests", "Generation requests by tenant and outcome (admitted, or why it was "
            "refused: the tenant quota's reason or the global admission's).", ["tenant", "outcome"], registry=registry))
        self.in_flight = _family(registry, "vllm:tenant_in_flight_requests", lambda: Gauge(
            "vllm:tenant_in_flight_requests", "Requests of the tenant in flight.", ["tenant"],
            registry=registry, multiprocess_mode="livesum"))

    def update(self, name: str, outcome: Optional[str], in_flight: int) -> None:
        if outcome is not None:
            self.requests.labels(tenant=name, outcome=outcome).inc()
        self.in_flight.labels(tenant=name).set(in_flight)


def _family(registry: Any, name: str, make: Callable[[], Any]) -> Any:
    """The metric family ``name`` of ``registry``, made once (an app state rebuilt on the
    same stat logger reuses it: prometheus_client refuses a duplicate)."""
    existing = getattr(registry, "_names_to_collectors", {}).get(name)
    return existing if existing is not None else make()


class TenantQuotaMiddleware:
    """Pure ASGI middleware (inside authentication, outside admission control): the
    quotas of the module docstring for POSTs to :data:`TRACKED_PATHS`. ``state``: the
    app state; its ``tenant_quotas`` (a TenantQuotas) is made on first use, in the
    registry of ``state.stat_logger`` when there is one. A request over its tenant's
    quota is first checked as its route checks it (``prechecks`` with the app's
    ``router``: admission_precheck.py): a malformed one gets its own 400, not the 429."""

    def __init__(self, app: Any, state: Any, prechecks: Optional[Prechecks] = None, router: Any = None):
        self.app = app
        self.state = state
        self.prechecks = prechecks
        self.router = router

    def _quotas(self) -> TenantQuotas:
        quotas = getattr(self.state, "tenant_quotas", None)
        if quotas is None:
            logger = getattr(self.state, "stat_logger", None)
            quotas = self.state.tenant_quotas = TenantQuotas(getattr(logger, "registry", None))
        return quotas

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        path = _route_path(scope)
        if path in MODEL_NAMING_PATHS:
            return await self._check_model_only(scope, receive, send, MODEL_NAMING_PATHS[path])
        if path not in TRACKED_PATHS:
            return await self.app(scope, receive, send)
        tenant = tenant_of(scope)
        quotas = self._quotas()
        st = quotas.state(tenant.name)
        scope.setdefault("state", {})[TENANT_IN_FLIGHT_KEY] = lambda: st.in_flight
        # An empty allowed_models list is a limit too (no model), not "no limit".
        limited = (tenant.max_concurrent_requests or tenant.max_tokens_per_second
                   or tenant.allowed_models is not None)
        body = b""
        if limited:
            body, receive = await _buffered_body(receive)
        refused = model_refusal(tenant, await _model_of(scope, body), self.state, _ollama_route(path))
        if refused is not None:
            return await _refuse(refused, scope, receive, send)
        # The outcome waits for the global admission's verdict (admission.py reports it
        # through the scope), so a request it refuses is not counted "admitted".
        decided: list[Optional[str]] = []
        defer = getattr(self.state, "admission", None) is not None
        refusal = quotas.check(tenant, request_cost(body, path), count_admitted=not defer)
        if refusal is None and defer:
            def report(reason: Optional[str]) -> None:
                if not decided:
                    decided.append(reason)
                    quotas.outcome(tenant, reason)
            scope["state"][TENANT_OUTCOME_KEY] = report
        if refusal is not None:
            if self.prechecks is not None:  # validation first: a malformed request gets its own error
                own = await malformed_response(self.prechecks, self.router, self.state, scope, path, body,
                                               Headers(scope=scope).get("content-type"))
                if own is not None:
                    return await own(scope, receive, send)
            reason, retry, message = refusal
            quotas.refused(tenant, reason)
            response = json_response(make_error(message, 429, err_type="RateLimitError", param=reason), 429)
            response.headers["Retry-After"] = str(retry)
            return await response(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            if defer and not decided:  # no verdict (a 400 before admission): admitted, as before
                report(None)
            quotas.release(tenant)


    async def _check_model_only(self, scope: dict, receive: Any, send: Any, fields: tuple[str, ...]) -> None:
        """A route of :data:`MODEL_NAMING_PATHS`: ``allowed_models`` only, no quota."""
        tenant = tenant_of(scope)
        if tenant.allowed_models is None:
            return await self.app(scope, receive, send)
        body, receive = await _buffered_body(receive)
        refused = model_refusal(tenant, await _model_of(scope, body, fields), self.state,
                                _ollama_route(_route_path(scope)))
        if refused is not None:
            return await _refuse(refused, scope, receive, send)
        return await self.app(scope, receive, send)


async def _refuse(error: Exception, scope: dict, receive: Any, send: Any) -> None:
    status, body = error_response_from_exception(error)
    return await json_response(body, status)(scope, receive, send)


def _ollama_route(path: str) -> Optional[str]:
    """``path`` when it is one of Ollama's routes (``/api/...``), else None."""
    return path if path.startswith("/api/") else None


def _route_path(scope: dict) -> str:
    root = scope.get("root_path", "") or ""
    return scope["path"][len(root):] if root and scope["path"].startswith(root) else scope["path"]
