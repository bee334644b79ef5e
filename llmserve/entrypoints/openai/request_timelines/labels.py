"""Labels each HTTP request for the engine's request timelines and traces: the caller's
tenant (``tenant_name_of``), its X-Request-Id, its W3C ``traceparent``/``tracestate``,
set as engine/request_timeline.py's ``current_request_labels`` for the whole request
(the handlers' ``AsyncLLM.generate`` calls run inside it and inherit the context). The
generation handlers add the response id they send back (``add_response_id``)."""
from __future__ import annotations

import time
from typing import Any

from starlette.datastructures import Headers

from llmserve.engine.request_timeline import RequestLabels, current_request_labels
from llmserve.entrypoints.openai.server_utils import REQUEST_ID_SCOPE_KEY
from llmserve.entrypoints.openai.tenants import tenant_name_of

TRACE_HEADERS = ("traceparent", "tracestate")


class RequestLabelsMiddleware:
    """Pure ASGI middleware, inside the authentication middleware (which names the
    tenant) and the X-Request-Id middleware."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        trace = {k: headers[k] for k in TRACE_HEADERS if k in headers}
        rid = scope.get(REQUEST_ID_SCOPE_KEY)
        labels = RequestLabels(tenant_name_of(scope), [rid] if rid else [], trace_headers=trace or None,
                               arrival_time=time.time())
        token = current_request_labels.set(labels)
        try:
            await self.app(scope, receive, send)
        finally:
            current_request_labels.reset(token)


def add_response_id(engine_request_id: str, response_id: str) -> None:
    """The engine request ``engine_request_id`` answers the response ``response_id``
    (``chatcmpl-...``, ``cmpl-...``, ``resp_...``): its timeline is found by that id,
    which is also the id shown in ``GET /v1/requests``."""
    labels = current_request_labels.get()
    if labels is not None:
        labels.response_ids[engine_request_id] = response_id
