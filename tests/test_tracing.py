"""llmserve/tracing.py without a server: the span of a finished timeline (the SDK's
in-memory exporter), the OTLP protocol rule, and the error when the packages are missing.
The real OTLP/HTTP export is tests/e2e/test_request_timelines.py."""
import sys

import pytest

from llmserve.engine.request_timeline import RequestLabels, RequestTimelines, current_request_labels
from llmserve.sampling_params import SamplingParams
from llmserve.tracing import OTEL_INSTALL_HINT, RequestSpanExporter, check_otel_installed, otlp_protocol

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _finished_record(exporter):
    store = RequestTimelines(max_finished=2, default_model="m")
    store.on_finish.append(exporter)
    token = current_request_labels.set(RequestLabels("alice", ["x-1"], {"e-1": "cmpl-1"},
                                                     trace_headers={"traceparent": TRACEPARENT}))
    try:
        rec = store.start("e-1", 1000.0, 5, SamplingParams(max_tokens=3, temperature=0.5, top_p=0.9))
    finally:
        current_request_labels.reset(token)
    rec.queued_time, rec.scheduled_time = 1000.01, 1000.02
    rec.events += [{"event": "queued", "time": 1000.01},
                   {"event": "scheduled", "time": 1000.02, "num_tokens": 5, "cached_tokens": 0}]
    store.observe(rec, None, 1, 0, None)
    rec.first_token_time = rec.last_token_time = 1000.1
    rec.generated_tokens = 3
    rec.model_execute_time = 0.07
    store.finish(rec, "length", 1000.3)
    return store, rec


def test_span_from_a_finished_timeline():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    store, rec = _finished_record(RequestSpanExporter(provider.get_tracer("t"), "m", ("all",)))
    (span,) = mem.get_finished_spans()
    a = span.attributes
    assert span.name == "llm_request" and span.parent.span_id == 0xb7ad6b7169203331
    assert span.context.trace_id == 0x0af7651916cd43dd8448eb211c80319c
    assert a["gen_ai.request.id"] == "cmpl-1" and a["gen_ai.response.model"] == "m"
    assert a["gen_ai.request.max_tokens"] == 3 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.usage.prompt_tokens"] == 5 and a["gen_ai.usage.completion_tokens"] == 3
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(0.01)
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(0.1)
    assert a["gen_ai.latency.e2e"] == pytest.approx(0.3)
    assert a["gen_ai.latency.time_in_model_forward"] == a["gen_ai.latency.time_in_model_execute"] == 0.07
    assert (span.start_time, span.end_time) == (1000 * 10**9, 1000300 * 10**6)
    assert [e.name for e in span.events] == ["arrived", "queued", "scheduled", "first_token", "finished"]
    # the record is found by its ids, by its tenant only
    assert store.get("cmpl-1", "alice") is rec and store.get("x-1", "alice") is rec and store.get("e-1", "alice")
    assert store.get("cmpl-1", "bob") is None and store.list("bob") == []


def test_ring_drops_the_oldest_and_their_ids():
    store = RequestTimelines(max_finished=2)
    recs = [store.start(f"r{i}", float(i), 1) for i in range(3)]
    for rec in recs:
        store.finish(rec, "stop")
    assert [r.request_id for r in store.list()] == ["r2", "r1"] and store.get("r0") is None
    with pytest.raises(ValueError, match="max_finished_request_timelines"):
        RequestTimelines(max_finished=0)


def test_protocol_rule(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    assert otlp_protocol("http://collector:4318/v1/traces") == "http/protobuf"
    assert otlp_protocol("http://jaeger:4317") == "grpc"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert otlp_protocol("http://jaeger:4317") == "http/protobuf"


def test_missing_packages_are_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import raises ImportError
    with pytest.raises(ValueError, match="pip install") as e:
        check_otel_installed("http://collector:4318/v1/traces")
    assert str(e.value).startswith(OTEL_INSTALL_HINT)
