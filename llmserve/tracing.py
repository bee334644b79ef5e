"""OpenTelemetry traces of requests (vLLM's ``vllm/tracing.py``): with
``--otlp-traces-endpoint``, each finished request becomes one span ``llm_request`` (kind
SERVER) with vLLM's ``gen_ai.*`` attributes, a child of the caller's ``traceparent``
(its W3C trace context, carried in the request's ``trace_headers``), exported through
the OpenTelemetry SDK's batch processor and OTLP exporter (gRPC or http/protobuf).

The spans are made in the front-end process from the request's timeline
(engine/request_timeline.py), when it finishes; the engine process exports nothing.
The OpenTelemetry packages are optional: :func:`init_tracer` raises ValueError naming
them when they are missing.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional
from urllib.parse import urlparse

logger = logging.getLogger(__name__)

__all__ = ["SpanAttributes", "check_otel_installed", "init_tracer", "otlp_protocol", "RequestSpanExporter", "OTEL_INSTALL_HINT"]

OTEL_INSTALL_HINT = ("--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporters: "
                     "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http "
                     "opentelemetry-exporter-otlp-proto-grpc (or pip install 'llmserve[otel]')")
TRACER_NAME = "llmserve.llm_engine"
SPAN_NAME = "llm_request"


class SpanAttributes:
    """vLLM's span attribute names (``vllm.tracing.SpanAttributes``)."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_SCHEDULER = "gen_ai.latency.time_in_scheduler"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"


def otlp_protocol(endpoint: str) -> str:
    """``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` when set (``grpc`` or ``http/protobuf``);
    else ``http/protobuf`` for an endpoint whose path is OTLP/HTTP's ``/v1/traces`` and
    ``grpc`` (vLLM's default) for any other, e.g. ``http://jaeger:4317``."""
    proto = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    if proto:
        return proto
    return "http/protobuf" if urlparse(endpoint).path.rstrip("/").endswith("/v1/traces") else "grpc"


def check_otel_installed(otlp_traces_endpoint: str) -> None:
    """Raise ValueError (naming the packages to install) unless the OpenTelemetry SDK and
    the OTLP exporter of the endpoint's protocol import; called when the config is built,
    before any engine starts."""
    module = ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter" if otlp_protocol(otlp_traces_endpoint) == "grpc"
              else "opentelemetry.exporter.otlp.proto.http.trace_exporter")
    try:
        import importlib

        importlib.import_module("opentelemetry.sdk.trace")
        importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{OTEL_INSTALL_HINT} ({e})") from e


def init_tracer(instrumenting_module_name: str, otlp_traces_endpoint: str) -> Any:
    """A Tracer whose spans go to ``otlp_traces_endpoint`` (batched, in a background
    thread of the SDK). Raises ValueError when the OpenTelemetry packages are missing or
    the protocol is unknown."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ValueError(f"{OTEL_INSTALL_HINT} ({e})") from e
    proto = otlp_protocol(otlp_traces_endpoint)
    try:
        if proto == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            insecure = urlparse(otlp_traces_endpoint).scheme != "https"
            exporter = OTLPSpanExporter(endpoint=otlp_traces_endpoint, insecure=insecure)
        elif proto == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=otlp_traces_endpoint)
        else:
            raise ValueError(f"Unsupported OTLP traces protocol {proto!r}: use grpc or http/protobuf")
    except ImportError as e:
        raise ValueError(f"{OTEL_INSTALL_HINT} ({e})") from e
    provider = TracerProvider(resource=service_resource(Resource))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider.get_tracer(instrumenting_module_name)


DEFAULT_SERVICE_NAME = "llmserve"


def service_resource(resource_cls: Any) -> Any:
    """The Resource the spans carry: the SDK's from the environment (``OTEL_SERVICE_NAME``,
    ``OTEL_RESOURCE_ATTRIBUTES``: vLLM's OpenTelemetry guide sets ``OTEL_SERVICE_NAME``, and
    vLLM's bare TracerProvider honours it), with ``service.name`` "llmserve" only where the
    environment names no service (the SDK's ``unknown_service:...``). ``resource_cls``:
    ``opentelemetry.sdk.resources.Resource``."""
    env = resource_cls.create()
    if str(env.attributes.get("service.name", "")).startswith("unknown_service"):
        return env.merge(resource_cls({"service.name": DEFAULT_SERVICE_NAME}))
    return env


def extract_trace_context(headers: Optional[Mapping[str, str]]) -> Any:
    """The OpenTelemetry Context of W3C ``traceparent``/``tracestate`` headers (None
    without them: the span starts a new trace)."""
    if not headers:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(headers)


def _ns(t: float) -> int:
    return int(t * 1e9)


def span_attributes(rec: Any, model: Optional[str]) -> dict[str, Any]:
    """vLLM's attributes of one finished TimelineRecord (latencies in seconds)."""
    A = SpanAttributes
    p = rec.params
    attrs: dict[str, Any] = {A.GEN_AI_REQUEST_ID: rec.id, A.GEN_AI_RESPONSE_MODEL: rec.model or model or "",
                             A.GEN_AI_USAGE_PROMPT_TOKENS: rec.prompt_tokens,
                             A.GEN_AI_USAGE_COMPLETION_TOKENS: rec.generated_tokens,
                             A.GEN_AI_USAGE_CACHED_TOKENS: rec.cached_tokens,
                             A.GEN_AI_RESPONSE_FINISH_REASONS: [rec.finish_reason or ""],
                             A.GEN_AI_LATENCY_E2E: rec.finish_time - rec.arrival_time}
    for name, field in ((A.GEN_AI_REQUEST_MAX_TOKENS, "max_tokens"), (A.GEN_AI_REQUEST_TOP_P, "top_p"),
                        (A.GEN_AI_REQUEST_TEMPERATURE, "temperature"), (A.GEN_AI_REQUEST_N, "n")):
        value = getattr(p, field, None)
        if value is not None:
            attrs[name] = value
    attrs[A.GEN_AI_USAGE_NUM_SEQUENCES] = getattr(p, "n", 1) or 1
    if rec.first_token_time is not None:
        attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = rec.first_token_time - rec.arrival_time
    sched, first, last = rec.scheduled_time, rec.first_token_time, rec.last_token_time
    if rec.queued_time is not None and sched is not None:
        attrs[A.GEN_AI_LATENCY_TIME_IN_QUEUE] = sched - rec.queued_time
    if sched is not None and first is not None:
        attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = first - sched
        attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = last - first
        attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = last - sched
    return attrs


class RequestSpanExporter:
    """A ``RequestTimelines.on_finish`` hook: one span per finished request, from its
    arrival to its finish, with its timeline's events as span events.
    ``detailed``: ``--collect-detailed-traces`` modules: "model" adds
    ``time_in_model_forward``, "worker" ``time_in_model_execute`` ("all" both). Both are
    the wall time of the engine's ``execute_model`` (input preparation, forward, sampling)
    summed over the steps the request was in; this runner does not time its forward pass
    apart from the rest of the step."""

    def __init__(self, tracer: Any, model: Optional[str], detailed: tuple[str, ...] = ()) -> None:
        from opentelemetry.trace import SpanKind

        self.tracer = tracer
        self.model = model
        self.detailed = set(detailed)
        self._kind = SpanKind.SERVER

    @classmethod
    def from_config(cls, observability_config: Any, model: Optional[str]) -> "RequestSpanExporter":
        """From ObservabilityConfig (otlp_traces_endpoint, collect_detailed_traces)."""
        tracer = init_tracer(TRACER_NAME, observability_config.otlp_traces_endpoint)
        return cls(tracer, model, tuple(observability_config.collect_detailed_traces or ()))

    def __call__(self, rec: Any) -> None:
        attrs = span_attributes(rec, self.model)
        self._add_detailed(attrs, rec)
        span = self.tracer.start_span(SPAN_NAME, context=extract_trace_context(rec.trace_headers), kind=self._kind,
                                      start_time=_ns(rec.arrival_time), attributes=attrs)
        for ev in rec.events:
            extra = {k: v for k, v in ev.items() if k not in ("event", "time") and v is not None}
            span.add_event(ev["event"], attributes=extra, timestamp=_ns(ev["time"]))
        span.end(end_time=_ns(rec.finish_time))

    def _add_detailed(self, attrs: dict, rec: Any) -> None:
        seconds = rec.model_execute_time
        if not seconds:
            return
        if self.detailed & {"model", "all"}:
            attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD] = seconds
        if self.detailed & {"worker", "all"}:
            attrs[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE] = seconds
