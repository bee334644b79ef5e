"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request``).

A msgspec Struct, so it crosses the process boundary on ``EngineCoreRequest`` as is.
Two requests with the same ``lora_name`` are the same adapter (vLLM's equality);
``lora_int_id`` (>= 1) is the engine's key for it: its KV blocks, its weight slot.
"""
from __future__ import annotations

from typing import Optional

import msgspec

from llmserve.served_names import check_served_name


class LoRARequest(msgspec.Struct, omit_defaults=True, array_like=True, gc=False):
    """An adapter for one request (vLLM's fields and order).

    lora_name: the adapter's name (what ``model`` names in the API); lora_int_id: a
    unique id >= 1; lora_path: a PEFT directory (``adapter_config.json`` +
    ``adapter_model.safetensors``/``.bin``) or a llama.cpp GGUF LoRA file.
    base_model_name: the model it was trained on (shown as ``parent`` by /v1/models).
    long_lora_max_len, tensorizer_config_dict, load_inplace: vLLM's, kept for
    compatibility (load_inplace: a load under a live id replaces its weights).
    Raises ValueError for an id below 1 (vLLM's rule) and for a ``lora_name`` that breaks
    the served-name rule (``llmserve.served_names``: the name reaches logs and metric
    labels), so the offline API refuses it as the server does."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_local_path: Optional[str] = msgspec.field(default=None)
    long_lora_max_len: Optional[int] = None
    base_model_name: Optional[str] = msgspec.field(default=None)
    tensorizer_config_dict: Optional[dict] = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        check_served_name(self.lora_name, "lora_name")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not self.lora_path and self.lora_local_path:
            self.lora_path = self.lora_local_path
        if not self.lora_path:
            raise ValueError("lora_path must be set (a PEFT adapter directory or a GGUF LoRA file)")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def local_path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, self.__class__) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)


def as_lora_request(value: object) -> Optional[LoRARequest]:
    """A LoRARequest from itself, None, or its wire form (a list as msgspec's array_like
    encoding decodes under ``Any``, or a dict of its fields). Raises ValueError (the field
    ``lora_request``) for anything else."""
    if value is None or isinstance(value, LoRARequest):
        return value
    try:
        if isinstance(value, (list, tuple)):
            return LoRARequest(*value)
        if isinstance(value, dict):
            return LoRARequest(**value)
    except TypeError as e:
        raise ValueError(f"lora_request: {e}") from None
    raise ValueError(f"lora_request must be a LoRARequest, got {type(value).__name__}")


def check_lora_request(lora_request: object, lora_config: object) -> Optional[LoRARequest]:
    """The request's adapter, checked on the front end (vLLM's InputProcessor): a
    LoRARequest (or None), and LoRA enabled. Raises LoRAAdapterError naming
    ``lora_request``."""
    from llmserve.lora.errors import LoRAAdapterError

    if lora_request is None:
        return None
    if not isinstance(lora_request, LoRARequest):
        raise LoRAAdapterError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}",
                               "lora_request")
    if lora_config is None:
        raise LoRAAdapterError(f"Got lora_request {lora_request} but LoRA is not enabled!", "lora_request")
    return lora_request
