"""Admission with several models in one server (``--extra-model``): each request is
admitted by the controller of the engine that will serve it.

Every model has its own AdmissionController (its own engine, batch and KV cache), so a
burst of embeddings to a pooling model must not refuse chats to the chat model, and the
limits (``--max-waiting-requests``, ``--max-queue-delay``, the KV-cache rule,
``X-Request-Timeout``) hold per engine as on a one-model server. The request's model is
read from the JSON body's top-level ``model`` (the body has already arrived whole:
BodyLimitMiddleware buffers it) with msgspec, which skips every other field; the
endpoint's capability (text, embed, transcription) comes from its path, as
:class:`~llmserve.entrypoints.openai.multi_model.ModelRegistry` resolves it for the handler.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import msgspec

from llmserve.entrypoints.openai.admission import AdmissionController, Rejection

# Path prefix -> the capability its handler needs (multi_model.ROUTED_HANDLERS' names).
_CAPABILITY_PREFIXES = (("/v1/audio/", "transcription"), ("/v1/embeddings", "embed"), ("/pooling", "embed"),
                        ("/score", "score"), ("/v1/score", "score"), ("/rerank", "score"), ("/v1/rerank", "score"),
                        ("/v2/rerank", "score"), ("/classify", "classify"), ("/v1/classify", "classify"),
                        ("/api/embed", "embed"), ("/embedding", "embed"))


class _ModelField(msgspec.Struct):
    model: Optional[str] = None


def capability_of_path(path: str) -> str:
    """The capability a tracked route needs: "transcription", "embed", "score", "classify" or "text"."""
    return next((cap for prefix, cap in _CAPABILITY_PREFIXES if path.startswith(prefix)), "text")


def model_of_body(body: bytes) -> Optional[str]:
    """The top-level ``model`` of a JSON body, or None (absent, not JSON, not a string)."""
    try:
        return msgspec.json.decode(body, type=_ModelField).model
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class ModelRoutedAdmission:
    """Stands on ``app.state.admission`` in a several-model server.

    registry: the ModelRegistry; controllers: each served model's AdmissionController, in
    the registry's order. :meth:`controller_for` picks the one of a request; the rest of
    the controller interface (readiness, liveness, draining) covers every engine: the
    server is ready while the main model admits, stalled when any engine is.
    """

    def __init__(self, registry: Any, controllers: Sequence[AdmissionController]):
        self.registry = registry
        self.controllers = list(controllers)
        self._by_model = {id(m): c for m, c in zip(registry.models, self.controllers)}
        self.config = self.controllers[0].config

    def controller_for(self, path: str, body: bytes) -> AdmissionController:
        """The controller of the engine that will serve this request (the main model's
        when the name is unknown or does not fit: the handler then answers 404/400)."""
        try:
            model = self.registry.resolve(model_of_body(body), capability_of_path(path))
        except (LookupError, ValueError):
            return self.controllers[0]
        return self._by_model.get(id(model), self.controllers[0])

    @property
    def is_draining(self) -> Callable[[], bool]:
        return self.controllers[0].is_draining

    @is_draining.setter
    def is_draining(self, fn: Callable[[], bool]) -> None:
        for c in self.controllers:
            c.is_draining = fn

    def check(self) -> Optional[Rejection]:
        """The main model's answer (what /ready reports)."""
        return self.controllers[0].check()

    def stalled_for(self) -> float:
        """The longest stall of any engine (0 when none is stalled)."""
        return max(c.stalled_for() for c in self.controllers)

    def __getattr__(self, name: str) -> Any:  # anything else: the main model's controller
        return getattr(self.controllers[0], name)
