"""The service the OTLP spans name (tracing.service_resource): the environment's
``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` as the OpenTelemetry SDK reads them
(vLLM's OpenTelemetry guide exports ``OTEL_SERVICE_NAME=vllm-server`` and looks the traces
up by it), "llmserve" only when the environment names none. Before, ``service.name`` was
always "llmserve", so a collector's search for the configured service found nothing."""
import pytest

pytest.importorskip("opentelemetry.sdk.resources")

from opentelemetry.sdk.resources import Resource  # noqa: E402

from llmserve.tracing import init_tracer, service_resource  # noqa: E402


def _service(monkeypatch, **env) -> dict:
    for key in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return dict(service_resource(Resource).attributes)


def test_the_environment_names_the_service(monkeypatch):
    assert _service(monkeypatch)["service.name"] == "llmserve"
    assert _service(monkeypatch, OTEL_SERVICE_NAME="vllm-server")["service.name"] == "vllm-server"
    attrs = _service(monkeypatch, OTEL_RESOURCE_ATTRIBUTES="service.name=api,deployment.environment=prod")
    assert attrs["service.name"] == "api" and attrs["deployment.environment"] == "prod"


def test_the_tracer_carries_it(monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "vllm-server")
    tracer = init_tracer("llmserve.test", "http://127.0.0.1:9/v1/traces")  # nothing is sent
    assert tracer.resource.attributes["service.name"] == "vllm-server"
