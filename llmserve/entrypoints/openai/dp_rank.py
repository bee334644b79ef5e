"""vLLM's ``X-data-parallel-rank`` request header: pins a generation request to one
data-parallel engine (``AsyncLLM.generate(..., data_parallel_rank=)``), e.g. for a router
that tracks which rank holds a conversation's KV (issue 35 item 4).

The middleware keeps the header's raw value for the request's task (a context
variable, as ``deadline.py`` does for ``X-Request-Timeout``); the serving layer's
``generate`` (chat, completions, responses, infill) reads it through
:func:`requested_data_parallel_rank`, which checks it against the ranks this server
serves. vLLM ignores a value that is not an integer; here it is a 400 naming the header,
as is a rank this server does not serve (vLLM: a ValueError from the engine client).
"""
from __future__ import annotations

import contextvars
from typing import Any, Optional

from starlette.datastructures import Headers

from llmserve.sampling_params import SamplingParamsError

DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"

_RAW_RANK: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("llmserve_dp_rank_header", default=None)


class DataParallelRankMiddleware:
    """Pure ASGI middleware: the request's ``X-data-parallel-rank`` value (None when
    absent) for :func:`requested_data_parallel_rank`."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        value = Headers(scope=scope).get(DATA_PARALLEL_RANK_HEADER) if scope["type"] == "http" else None
        if value is None:
            return await self.app(scope, receive, send)
        token = _RAW_RANK.set(value)
        try:
            await self.app(scope, receive, send)
        finally:
            _RAW_RANK.reset(token)


def served_ranks(engine_client: Any) -> range:
    """The data-parallel ranks requests to ``engine_client`` may be pinned to: its own
    rank under external load balancing, this node's under hybrid, every rank under
    internal, rank 0 without DP."""
    pc = getattr(getattr(engine_client, "vllm_config", None), "parallel_config", None)
    if pc is None:
        return range(1)
    if pc.data_parallel_external_lb:
        return range(pc.data_parallel_rank, pc.data_parallel_rank + 1)
    if pc.data_parallel_hybrid_lb:
        start = pc.data_parallel_start_rank
        return range(start, start + (pc.data_parallel_size_local or pc.data_parallel_size))
    return range(pc.data_parallel_size)


def requested_data_parallel_rank(engine_client: Any) -> Optional[int]:
    """The current request's ``X-data-parallel-rank`` (None without the header).

    Raises SamplingParamsError (a 400, ``param`` the header) when the value is not an
    integer or not a rank ``engine_client`` serves."""
    raw = _RAW_RANK.get()
    if raw is None:
        return None
    try:
        rank = int(raw.strip())
    except ValueError:
        raise SamplingParamsError(f"{DATA_PARALLEL_RANK_HEADER} must be an integer data-parallel rank, "
                                  f"got {raw[:40]!r}.", DATA_PARALLEL_RANK_HEADER) from None
    ranks = served_ranks(engine_client)
    if rank not in ranks:
        raise SamplingParamsError(f"{DATA_PARALLEL_RANK_HEADER}={rank} is not a data-parallel rank of this "
                                  f"server (it serves ranks {ranks.start}..{ranks.stop - 1}).",
                                  DATA_PARALLEL_RANK_HEADER)
    return rank
