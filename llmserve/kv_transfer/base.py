"""The KV connector seam (vLLM v1's ``KVConnectorBase_V1``,
``vllm/distributed/kv_transfer/kv_connector/v1/base.py``).

A connector has two halves, built from the same ``VllmConfig`` with a role:

- the **scheduler** side (``KVConnectorRole.SCHEDULER``, in the EngineCore, no tensors):
  ``get_num_new_matched_tokens`` says how many tokens of a waiting request past its
  in-RAM prefix-cache hit an external store holds; ``update_state_after_alloc`` learns
  the KV blocks allocated for them; ``build_connector_meta`` turns this step's loads and
  saves into a ``KVConnectorMetadata`` that travels to the workers inside the
  ``SchedulerOutput``; ``request_finished`` is told when a request's blocks are freed.
- the **worker** side (``KVConnectorRole.WORKER``, in the model runner's process, owns
  the KV tensors): ``register_kv_caches`` once, then per step ``bind_connector_metadata``,
  ``start_load_kv`` (before the forward), ``wait_for_layer_load`` / ``save_kv_layer`` (per
  layer), ``wait_for_save`` (after the forward), ``clear_connector_metadata``.

This module imports no torch: the scheduler side must not.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from llmserve.core.request import Request
    from llmserve.core.sched_output import SchedulerOutput


class KVConnectorRole(enum.Enum):
    """Which half of a connector an object is (vLLM's ``KVConnectorRole``)."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step (vLLM's
    ``KVConnectorMetadata``); each connector subclasses it. Must pickle (a worker may live
    in another process)."""


class KVConnectorBase_V1:  # noqa: N801 (vLLM's name)
    """Base of every connector. Args: vllm_config (the engine's ``VllmConfig``), role.

    Scheduler-side methods run in the EngineCore and see requests and block ids only;
    worker-side methods run where the KV caches are (one tensor per layer,
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype).
    Defaults do nothing, so a connector overrides only what it uses.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole) -> None:
        self.vllm_config = vllm_config
        self.role = role
        self._connector_metadata: Optional[KVConnectorMetadata] = None

    @classmethod
    def check_config(cls, kv_transfer_config: Any) -> None:
        """Raise ValueError naming the field when ``kv_transfer_config`` (its
        ``kv_connector_extra_config``) is unusable; called when the engine config is built."""

    # ---- scheduler side ----------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens of ``request`` past ``num_computed_tokens`` (its local prefix-cache hit,
        a multiple of the block size) that this connector can load, and whether the load
        is asynchronous (always False here: loads finish before the step's forward)."""
        return 0, False

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        """The scheduler allocated ``block_ids`` (the request's new blocks, in order) and
        counts ``num_external_tokens`` of them as loaded by this connector."""

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's loads and saves for the workers; resets the step's state."""
        return KVConnectorMetadata()

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        """The request finished (or was aborted) and its blocks are being freed. Returns
        (delay_free, kv_transfer_params) as vLLM; this engine never delays the free."""
        return False, None

    def get_stats(self) -> dict[str, int]:
        """Counters since the last call (tokens and bytes), for the scheduler's stats."""
        return {}

    # ---- worker side -------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """The worker's KV cache tensors, one per layer."""

    def bind_connector_metadata(self, connector_metadata: Optional[KVConnectorMetadata]) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def start_load_kv(self, **kwargs: Any) -> None:
        """Start loading this step's external KV into the paged cache (before the forward)."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids of this step whose external KV failed to load (after ``start_load_kv``);
        the scheduler computes their requests again from the first failed block."""
        return set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until layer ``layer_name``'s KV is loaded."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, **kwargs: Any) -> None:
        """Start saving layer ``layer_name``'s KV of this step's save set."""

    def wait_for_save(self) -> None:
        """Block until this step's saves no longer need the KV cache (after the forward)."""

    def shutdown(self) -> None:
        """Release resources (flush pending writes)."""
