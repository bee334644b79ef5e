"""Served model names and ``GET /v1/models`` (vLLM's ``OpenAIServingModels``)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from llmserve.entrypoints.openai.models.protocol import ModelCard, ModelList
from llmserve.served_names import MAX_SERVED_NAME_CHARS, latest_match

if TYPE_CHECKING:  # lora.py imports common.errors, which imports this module
    from llmserve.entrypoints.openai.models.lora import LoRAAdapters


@dataclass(frozen=True)
class BaseModelPath:
    """One name the API accepts (``name``) for the model loaded from ``model_path``;
    ``max_model_len``: its context in tokens (None: the server's)."""

    name: str
    model_path: str
    max_model_len: Optional[int] = None


class ModelNotFoundError(LookupError):
    """The request named a model this server does not serve (HTTP 404, NotFoundError)."""

    def __init__(self, model: str, served: Sequence[str]):
        listed = ", ".join(f"`{n}`" for n in served)
        # a served name is at most MAX_SERVED_NAME_CHARS long, so a longer one is unknown
        # for sure; echoed whole, a 100,000-character name made a 100 kB error body
        shown = model if len(model) <= MAX_SERVED_NAME_CHARS else \
            f"{model[:MAX_SERVED_NAME_CHARS]}... ({len(model)} characters)"
        super().__init__(f"The model `{shown}` does not exist. " +
                         (f"Models served here: {listed}." if listed else "No model served here can be called."))
        self.model = model


class OpenAIServingModels:
    """The names under which the loaded model (or, on a multi-model server, every
    model: see ``multi_model``) is served.

    ``base_model_paths``: every ``--served-model-name`` (the first is the default used when
    a request leaves ``model`` out). ``max_model_len``: context limit in tokens.
    ``lora``: the LoRA adapters served by name next to the base model (``--enable-lora``;
    on a multi-model server, every model's), see ``models/lora.py``.
    """

    def __init__(self, base_model_paths: Sequence[BaseModelPath], max_model_len: int,
                 lora: Sequence["LoRAAdapters"] = ()):
        if not base_model_paths:
            raise ValueError("served_model_name: at least one model name is required")
        self.base_model_paths = list(base_model_paths)
        self.max_model_len = max_model_len
        self.created = int(time.time())
        self.lora = list(lora)

    def lora_request(self, model_name: Optional[str]) -> Optional[Any]:
        """The LoRARequest of the adapter served as ``model_name`` (None: not an adapter)."""
        return next((r for a in self.lora if (r := a.get(model_name)) is not None), None)

    def adapters_of(self, model_name: Optional[str]) -> Optional["LoRAAdapters"]:
        """The adapter table serving ``model_name`` (None: not an adapter)."""
        return next((a for a in self.lora if a.get(model_name) is not None), None)

    @property
    def lora_names(self) -> list[str]:
        """The served adapter names (they change with /v1/load_lora_adapter)."""
        return [n for a in self.lora for n in a.lora_requests]

    @property
    def model_names(self) -> list[str]:
        return [p.name for p in self.base_model_paths]

    def is_base_model(self, model_name: Optional[str]) -> bool:
        return any(p.name == model_name for p in self.base_model_paths)

    def served_as(self, model_name: Optional[str]) -> Optional[str]:
        """The served name (base model or adapter) that ``model_name`` calls: itself, or
        the name it differs from only by Ollama's default tag (``m:latest`` for ``m``,
        ``served_names.latest_match``: /api/tags lists ``m:latest`` and VS Code Copilot
        sends that to the OpenAI routes); None for an unknown name."""
        return latest_match(model_name, self.model_names + self.lora_names)

    def resolve(self, model_name: Optional[str]) -> str:
        """The served name to report for a request's ``model`` field.

        None or "" (field left out) means the default model, as in vLLM; ``name:latest``
        calls ``name`` (:meth:`served_as`), and the served name is reported.
        Raises ModelNotFoundError for any other unknown name.
        """
        if not model_name:
            return self.base_model_paths[0].name
        served = self.served_as(model_name)
        if served is not None:
            return served
        raise ModelNotFoundError(model_name, self.model_names + self.lora_names)

    def _card(self, p: BaseModelPath) -> ModelCard:
        return ModelCard(id=p.name, created=self.created, root=p.model_path,
                         max_model_len=p.max_model_len or self.max_model_len)

    def show_available_models(self) -> ModelList:
        """The body of ``GET /v1/models``."""
        adapters = [c for a in self.lora for c in a.cards(self.created, self.max_model_len)]
        return ModelList(data=[self._card(p) for p in self.base_model_paths] + adapters)

    def show_model(self, model_id: str) -> ModelCard:
        """The body of ``GET /v1/models/{model_id}`` (``name:latest`` gives ``name``'s
        card, :meth:`served_as`). Raises ModelNotFoundError (404)."""
        model_id = self.served_as(model_id) or model_id
        for p in self.base_model_paths:
            if p.name == model_id:
                return self._card(p)
        for card in self.show_available_models().data:
            if card.id == model_id:
                return card
        raise ModelNotFoundError(model_id, self.model_names + self.lora_names)
