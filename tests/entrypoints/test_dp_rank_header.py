"""X-data-parallel-rank (issue 35 item 4): which ranks a server accepts (every rank with
internal load balancing, its own with external, 0 without DP) and the 400 naming the
header otherwise. The DP server test (tests/e2e/test_data_parallel_server.py) checks
that a pinned request runs on its rank."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from llmserve.config import ParallelConfig
from llmserve.entrypoints.openai.dp_rank import DataParallelRankMiddleware, requested_data_parallel_rank
from llmserve.sampling_params import SamplingParamsError


def _client(**pc) -> SimpleNamespace:
    return SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=ParallelConfig(**pc)))


def _rank_seen(header, client):
    """What a handler behind the middleware reads for a request with ``header``."""
    seen = []

    async def app(scope, receive, send):
        try:
            seen.append(requested_data_parallel_rank(client))
        except SamplingParamsError as e:
            seen.append(e)

    headers = [] if header is None else [(b"x-data-parallel-rank", header.encode())]
    asyncio.run(DataParallelRankMiddleware(app)({"type": "http", "headers": headers}, None, None))
    return seen[0]


@pytest.mark.parametrize("pc, header, want", [
    ({}, None, None),
    ({}, "0", 0),
    ({"data_parallel_size": 4}, " 3 ", 3),
    ({"data_parallel_size": 4, "data_parallel_external_lb": True, "data_parallel_rank": 2}, "2", 2),
])
def test_served_rank_is_passed_on(pc, header, want):
    assert _rank_seen(header, _client(**pc)) == want


@pytest.mark.parametrize("pc, header", [
    ({}, "1"),
    ({"data_parallel_size": 2}, "2"),
    ({"data_parallel_size": 2}, "-1"),
    ({"data_parallel_size": 2}, "1.0"),
    ({"data_parallel_size": 2}, "rank1"),
    ({"data_parallel_size": 4, "data_parallel_external_lb": True, "data_parallel_rank": 2}, "1"),
])
def test_bad_or_unserved_rank_is_a_400_naming_the_header(pc, header):
    err = _rank_seen(header, _client(**pc))
    assert isinstance(err, SamplingParamsError) and err.param == "X-data-parallel-rank"
