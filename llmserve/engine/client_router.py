"""Which API server gets each engine output, when several share one engine
(``--api-server-count K``; vLLM routes by ``EngineCoreRequest.client_index`` the same way,
``vllm/v1/engine/core.py``).

The engine's main thread records each new request's ``client_index`` (``add``) and
forgets aborted ones (``forget``); the engine's output thread splits every
``EngineCoreOutputs`` by client (``route``), so the step loop pays nothing for it. With
one client the engine never builds a router.
"""
from __future__ import annotations

from typing import Union

from llmserve.engine.messages import EngineCoreOutputs, EngineCoreRequest


class ClientRouter:
    """Request id -> API-server index, and the split of outputs by it.

    Args: num_clients (> 1). ``route(item)`` takes what the engine queued for sending:
    an ``EngineCoreOutputs``, or ``(client_index, EngineCoreOutputs)`` for a utility
    result, and returns ``[(client_index, EngineCoreOutputs), ...]``.
    """

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.req_client: dict[str, int] = {}

    def add(self, request: EngineCoreRequest) -> None:
        self.req_client[request.request_id] = request.client_index

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.req_client.pop(rid, None)

    def route(self, item: Union[EngineCoreOutputs, tuple[int, EngineCoreOutputs]]) -> list[tuple[int, EngineCoreOutputs]]:
        if isinstance(item, tuple):
            return [item]
        outs = item
        if not outs.outputs and not outs.rejected:
            # Stats only, READY, ENGINE_CORE_DEAD: every front end needs them.
            return [(i, outs) for i in range(self.num_clients)]
        parts: dict[int, EngineCoreOutputs] = {}

        def part(idx: int) -> EngineCoreOutputs:
            p = parts.get(idx)
            if p is None:
                p = parts[idx] = EngineCoreOutputs(outputs=[], scheduler_stats=outs.scheduler_stats,
                                                   timestamp=outs.timestamp)
            return p

        for o in outs.outputs:
            idx = self.req_client.get(o.request_id)
            if idx is None:  # aborted by its client meanwhile: nobody waits for it
                continue
            if o.finish_reason is not None:
                del self.req_client[o.request_id]
            part(idx).outputs.append(o)
        for rej in outs.rejected or ():
            idx = self.req_client.pop(rej.request_id, None)
            if idx is not None:
                p = part(idx)
                p.rejected = (p.rejected or []) + [rej]
        return list(parts.items())
