"""The scheduler's LoRA rules (no torch): a step holds requests of at most ``max_loras``
distinct adapters (vLLM's scheduler check), and the stats name the adapters of the
running and waiting requests (vLLM's ``vllm:lora_requests_info`` labels)."""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional


def lora_name_of(request) -> Optional[str]:
    lora = getattr(request, "lora_request", None)
    return lora.lora_name if lora is not None else None


def active_lora_ids(requests: Iterable) -> set[int]:
    """Adapter ids of ``requests`` (the running ones: adapters already in the step)."""
    return {r.lora_request.lora_int_id for r in requests if getattr(r, "lora_request", None) is not None}


def admits(request, active: set[int], max_loras: int) -> bool:
    """Whether ``request`` may join a step whose adapters are ``active`` (a base-model
    request always may); when it may, its adapter is added to ``active``."""
    lora = getattr(request, "lora_request", None)
    if lora is None or lora.lora_int_id in active:
        return True
    if len(active) >= max_loras:
        return False
    active.add(lora.lora_int_id)
    return True


def adapter_counts(requests: Iterable) -> dict[str, int]:
    """Adapter name -> number of ``requests`` that run it."""
    return dict(Counter(n for n in map(lora_name_of, requests) if n is not None))
