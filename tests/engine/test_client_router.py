"""Several API servers over one engine (--api-server-count): the engine's ClientRouter
sends each output to the API server that sent its request, utility results to their
caller, stats/READY/DEAD to all; and the data-parallel flags' rules (vLLM's)."""
from __future__ import annotations

import argparse

import pytest

from llmserve.core.outputs import EngineCoreOutput, FinishReason
from llmserve.engine.client_router import ClientRouter
from llmserve.engine.messages import (EngineCoreDead, EngineCoreOutputs, EngineCoreRejection, EngineCoreRequest,
                                      UtilityOutput)
from llmserve.engine_args import EngineArgs
from llmserve.engine_config_builder import _parallel_config
from llmserve.entrypoints.openai.multi_api_server import check_multi_api_server_args


def _req(rid: str, client: int) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2], None, None, 0.0, client_index=client)


def test_outputs_go_to_the_client_that_sent_the_request():
    r = ClientRouter(3)
    for rid, c in (("a", 0), ("b", 2), ("c", 2), ("d", 1)):
        r.add(_req(rid, c))
    r.forget(["d"])  # aborted by its client
    outs = EngineCoreOutputs([EngineCoreOutput("a", [5]), EngineCoreOutput("b", [6], finish_reason=FinishReason.STOP),
                              EngineCoreOutput("c", [7]), EngineCoreOutput("d", [8])],
                             rejected=[EngineCoreRejection("c", "no")], timestamp=1.5)
    parts = dict(r.route(outs))
    assert sorted(parts) == [0, 2]
    assert [o.request_id for o in parts[0].outputs] == ["a"]
    assert [o.request_id for o in parts[2].outputs] == ["b", "c"]
    assert [x.request_id for x in parts[2].rejected] == ["c"] and parts[0].rejected is None
    assert parts[0].timestamp == parts[2].timestamp == 1.5
    assert r.req_client == {"a": 0}  # finished, rejected and aborted requests are forgotten


def test_utility_results_go_to_their_caller_and_events_to_everyone():
    r = ClientRouter(2)
    util = EngineCoreOutputs(utility_output=UtilityOutput(3, True))
    assert r.route((1, util)) == [(1, util)]
    dead = EngineCoreOutputs(dead=EngineCoreDead("boom"))
    assert r.route(dead) == [(0, dead), (1, dead)]


def _pc(**kw):
    return _parallel_config(EngineArgs(**kw))


def test_data_parallel_rank_means_external_lb_and_is_checked():
    pc = _pc(data_parallel_size=2, data_parallel_rank=1)
    assert pc.data_parallel_external_lb and pc.data_parallel_rank == 1 and pc.data_parallel_size_local == 2
    pc = _pc(data_parallel_size=4, data_parallel_external_lb=True, data_parallel_start_rank=2,
             data_parallel_size_local=2)
    assert (pc.data_parallel_rank, pc.data_parallel_size_local) == (2, 2)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        _pc(data_parallel_size=2, data_parallel_rank=2)
    with pytest.raises(ValueError, match="needs --data-parallel-address"):
        _pc(data_parallel_size=2, data_parallel_size_local=1)  # internal LB over several hosts: a head address
    assert not _pc(data_parallel_size=2).data_parallel_external_lb


def test_api_server_count_refuses_what_it_cannot_share():
    args = argparse.Namespace(api_server_count=2, extra_model=None, restart_engine_on_failure=False)

    class Cfg:
        parallel_config = _pc(data_parallel_size=2)

    check_multi_api_server_args(args, Cfg)  # internal-LB DP: the launcher starts the ranks
    Cfg.parallel_config = _pc(data_parallel_size=2, data_parallel_rank=0)
    check_multi_api_server_args(args, Cfg)  # one rank per server, several API servers on it: fine
    args.restart_engine_on_failure = True
    with pytest.raises(ValueError, match="restart-engine-on-failure"):
        check_multi_api_server_args(args, Cfg)
