"""Multi-node data parallel (issue 35 item 1), the cheap twin of
tests/e2e/test_multinode_dp.py (own basename: pytest collects both dirs): vLLM's flag rules (each error names the flag), the fixed
address layout both sides compute, the EngineHandshake frame, and the head's NodeWatch
reporting a node's ranks lost when its connection closes."""
from __future__ import annotations

import dataclasses
import socket
import threading

import pytest

from llmserve.engine.messages import EngineHandshake
from llmserve.engine.multinode import (NodeWatch, encode_handshake, recv_answer, recv_handshake,
                                       remote_rank_addresses)
from llmserve.engine_args import EngineArgs
from llmserve.engine_config_builder import _parallel_config

NODE = dict(data_parallel_size=2, data_parallel_size_local=1, data_parallel_address="127.0.0.1",
            data_parallel_rpc_port=29550)


def test_head_and_headless_configs_carry_the_topology():
    pc = _parallel_config(EngineArgs(**NODE))
    assert (pc.data_parallel_size, pc.data_parallel_size_local, pc.data_parallel_start_rank) == (2, 1, 0)
    assert (pc.data_parallel_address, pc.data_parallel_rpc_port, pc.data_parallel_external_lb) == \
        ("127.0.0.1", 29550, False)
    pc = _parallel_config(EngineArgs(**NODE, headless=True, data_parallel_start_rank=1))
    assert pc.data_parallel_start_rank == 1 and pc.data_parallel_rank is None


@pytest.mark.parametrize("kw, flag", [
    (dict(NODE, data_parallel_start_rank=1, headless=True, data_parallel_size_local=2), "--data-parallel-start-rank 1"),
    (dict(NODE, data_parallel_address=None), "needs --data-parallel-address"),
    (dict(NODE, data_parallel_rpc_port=None), "needs --data-parallel-rpc-port"),
    (dict(NODE, headless=True, data_parallel_address=None, data_parallel_start_rank=1), "--headless needs"),
    (dict(NODE, headless=True), "--headless needs --data-parallel-start-rank"),
    (dict(NODE, data_parallel_start_rank=1), "must be 0 on the head"),
    (dict(data_parallel_size=2, data_parallel_start_rank=1), "--data-parallel-start-rank"),
    (dict(NODE, data_parallel_hybrid_lb=True, headless=True, data_parallel_start_rank=1), "drop --headless"),
    (dict(NODE, data_parallel_hybrid_lb=True, data_parallel_address=None), "hybrid-lb .* needs --data-parallel-address"),
    (dict(NODE, data_parallel_hybrid_lb=True, data_parallel_rank=1), "exclude each other"),
    (dict(NODE, data_parallel_hybrid_lb=True, data_parallel_backend="ray"), "use --data-parallel-backend mp"),
    (dict(NODE, data_parallel_hybrid_lb=True, data_parallel_start_rank=2), "exceeds --data-parallel-size 2"),
    (dict(NODE, data_parallel_rpc_port=65534), "--data-parallel-rpc-port 65534: the head uses ports"),
    (dict(NODE, data_parallel_backend="ray"), "ray places every rank .* drop --headless and --data-parallel-size-local"),
    (dict(data_parallel_size=2, data_parallel_rank=1, data_parallel_backend="ray"), "each server runs its own rank: use mp"),
    (dict(data_parallel_size=2, data_parallel_backend="slurm"), "--data-parallel-backend must be 'mp' or 'ray', got 'slurm'"),
])
def test_bad_topologies_name_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        _parallel_config(EngineArgs(**kw))


def test_a_head_address_of_another_host_is_a_clear_error():
    with pytest.raises(ValueError, match="--data-parallel-address 192.0.2.77 --data-parallel-rpc-port 29550: "
                                         "the head cannot listen there"):
        NodeWatch("192.0.2.77", 29550, range(1, 2), lambda ranks, why: None)


def test_address_layout_and_handshake_round_trip():
    assert remote_rank_addresses("127.0.0.1", 29550, 1) == {"input_address": "tcp://127.0.0.1:29553",
                                                             "output_address": "tcp://127.0.0.1:29554"}
    assert remote_rank_addresses("::1", 5000, 0)["input_address"] == "tcp://[::1]:5001"
    a, b = socket.socketpair()
    with a, b:
        hs = EngineHandshake(start_rank=2, size_local=2, host="127.0.0.2")
        a.sendall(encode_handshake(hs))
        assert recv_handshake(b) == hs
        a.sendall(b"\x00\x00\x00\x03abc")
        with pytest.raises(ValueError, match="malformed EngineHandshake"):
            recv_handshake(b)


def _join(port: int, start: int, size: int) -> socket.socket:
    node = socket.create_connection(("127.0.0.1", port))
    node.sendall(encode_handshake(EngineHandshake(start_rank=start, size_local=size, host="127.0.0.2")))
    return node


def test_node_watch_reports_a_lost_node_and_only_its_remote_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lost = []
    done = threading.Event()
    watch = NodeWatch("127.0.0.1", port, range(1, 3), lambda ranks, why: (lost.append((ranks, why)), done.set()))
    try:
        node = _join(port, 1, 3)
        assert recv_answer(node, 5) is None  # accepted
        twin = _join(port, 2, 1)  # rank 2 is served already
        assert "ranks [2] are served by another node already" in recv_answer(twin, 5)
        assert not done.wait(0.3)  # alive while the connection is open
        node.close()
        assert done.wait(5)
        assert lost[0][0] == [1, 2] and "127.0.0.2" in lost[0][1]
        # The lost ranks do not come back: a node restarted with them is refused (it exits).
        again = _join(port, 1, 1)
        assert "ranks [1] were lost earlier" in recv_answer(again, 5)
        assert "not among this head's remote ranks" in recv_answer(_join(port, 5, 1), 5)
        for conn in (twin, again):
            conn.close()
    finally:
        watch.close()


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """The fields of EngineConfig the DP client reads."""

    parallel_config: object
    num_threads: int = 1


class _FakeRank:
    """One rank's client: records requests, never answers (a remote rank gone quiet)."""

    def __init__(self, config, executor_class, log_stats, addresses, client_index):
        self.rank = config.parallel_config.data_parallel_rank
        self.num_blocks, self.ready, self.engine_pid = 10, None, None
        self.added: list[str] = []
        self.aborted: list[str] = []

    async def get_output_async(self):
        import asyncio
        await asyncio.Event().wait()

    async def add_request_async(self, request):
        self.added.append(request.request_id)

    async def abort_requests_async(self, ids):
        self.aborted += ids

    async def call_utility_async(self, method, *args):
        return {"num_running_reqs": self.rank + 1}

    def shutdown(self, timeout=None):
        pass


def test_a_lost_ranks_requests_fail_naming_it_and_the_rest_keep_serving():
    import asyncio
    from types import SimpleNamespace

    from llmserve.engine.dp_client import DPLBAsyncMPClient

    pc = _parallel_config(EngineArgs(data_parallel_size=2))
    client = DPLBAsyncMPClient(_Cfg(pc), rank_client=_FakeRank)

    async def run():
        await client.add_request_async(SimpleNamespace(request_id="a", data_parallel_rank=1))
        await client.add_request_async(SimpleNamespace(request_id="b", data_parallel_rank=0))
        client._on_node_lost([1], "data parallel node 10.0.0.2 (ranks [1]) was lost")
        outs = await asyncio.wait_for(client.get_output_async(), 5)
        assert [r.request_id for r in outs.rejected] == ["a"] and "rank 1" in outs.rejected[0].message
        # its gauges drop to zero (nothing runs there any more), under its rank
        assert outs.engine_index == 1 and outs.scheduler_stats.num_running_reqs == 0
        assert outs.rejected[0].engine_lost  # the node failed, not the request: a 500, not a 400
        assert client.dead_ranks == {1} and not client.engine_dead
        with pytest.raises(ValueError, match="data_parallel_rank=1 was lost"):
            await client.add_request_async(SimpleNamespace(request_id="c", data_parallel_rank=1))
        await client.add_request_async(SimpleNamespace(request_id="d", data_parallel_rank=None))
        await client.abort_requests_async(["a", "b"])  # nothing is sent to the lost rank
        assert (client.cores[0].added, client.cores[1].added) == (["b", "d"], ["a"])
        assert client.cores[0].aborted == ["b"] and client.cores[1].aborted == []
        assert (await client.call_utility_async("get_stats"))["num_running_reqs"] == 1  # rank 0 only
        client._drop_ranks([0], "node lost")
        assert client.engine_dead
        client.shutdown()

    asyncio.run(run())


def test_a_hybrid_lb_node_balances_only_its_ranks_under_their_global_numbers():
    import asyncio
    from types import SimpleNamespace

    from llmserve.engine.dp_client import DPLBAsyncMPClient
    from llmserve.entrypoints.openai.dp_rank import served_ranks

    pc = _parallel_config(EngineArgs(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2,
                                     data_parallel_hybrid_lb=True, data_parallel_address="127.0.0.1"))
    assert pc.data_parallel_hybrid_lb and pc.data_parallel_start_rank == 2
    client = DPLBAsyncMPClient(_Cfg(pc), rank_client=_FakeRank)
    assert client.node_watch is None  # no node joins another under hybrid LB
    assert [c.rank for c in client.cores] == [2, 3]  # what each engine publishes under
    assert served_ranks(SimpleNamespace(vllm_config=_Cfg(pc))) == range(2, 4)

    async def run():
        await client.add_request_async(SimpleNamespace(request_id="a", data_parallel_rank=3))
        await client.add_request_async(SimpleNamespace(request_id="b", data_parallel_rank=None))
        assert (client.cores[0].added, client.cores[1].added) == (["b"], ["a"])
        assert (client.engine_index_of("a"), client.engine_index_of("b"), client.engine_index_of("z")) == (3, 2, None)
        for rank in (0, 1, 4):
            with pytest.raises(ValueError, match=f"data_parallel_rank={rank} is out of range \\[2, 4\\) "
                                                 "\\(the other ranks are served by other nodes"):
                await client.add_request_async(SimpleNamespace(request_id="c", data_parallel_rank=rank))
        client.shutdown()

    asyncio.run(run())


def test_a_lost_engines_rejection_is_an_engine_error_not_a_bad_request():
    from llmserve.engine.exceptions import EngineGenerateError
    from llmserve.engine.messages import EngineCoreRejection, EngineCoreRequest
    from llmserve.engine.output_processor import OutputProcessor, RequestOutputCollector, register_incarnations
    from llmserve.entrypoints.openai.common.errors import error_response_from_exception
    from llmserve.sampling_params import RequestOutputKind, SamplingParams

    from llmserve.tokenizer import get_tokenizer

    op = OutputProcessor(get_tokenizer("SmolLM2-135M-Instruct"), log_stats=False)
    got = {}
    for rid, lost in (("bad", False), ("lost", True)):
        collector = RequestOutputCollector(RequestOutputKind.FINAL_ONLY)
        (req,) = register_incarnations(op, [(EngineCoreRequest(rid, [1, 2], SamplingParams(max_tokens=2), 2, 0.0),
                                             None)], None, collector)
        op.reject_requests([EngineCoreRejection(req.request_id, f"{rid}: rank 1 gone", engine_lost=lost)])
        with pytest.raises(Exception) as e:  # the collector raises the error to its consumer
            collector.get_nowait()
        got[rid] = e.value
    assert type(got["bad"]) is ValueError and isinstance(got["lost"], EngineGenerateError)
    assert error_response_from_exception(got["lost"])[0] == 500


def test_headless_refuses_api_server_count_before_starting_anything(monkeypatch):
    """vLLM's run_headless refuses it; it was dropped silently (the node ran engines only)."""
    import argparse

    from llmserve.engine import core_process
    from llmserve.entrypoints.headless import run_headless

    monkeypatch.setattr(core_process, "spawn_engine_process", lambda *a, **kw: pytest.fail("an engine started"))
    args = argparse.Namespace(**NODE, headless=True, data_parallel_start_rank=1, api_server_count=2)
    with pytest.raises(ValueError, match="api_server_count can't be set in headless mode"):
        run_headless(args)
