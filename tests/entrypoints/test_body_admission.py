"""Request bodies and admission at the ASGI level (issue 26, point 1): the body middleware
receives a body whole before admission control counts the request, a drip is cut by the
whole-body deadline or the rate floor (408, Connection: close), one client address's
unfinished bodies are bounded (its longest-unfinished body is cut, not a newer one), and
the admission queue shows on /metrics. Real AdmissionController and middlewares; the
clients are scripted ASGI ``receive`` callables (short real timeouts, nothing timed)."""
import asyncio
import json
from types import SimpleNamespace

import pytest

from llmserve.config import AdmissionConfig
from llmserve.entrypoints.openai import http_edges
from llmserve.entrypoints.openai.admission import AdmissionController, AdmissionMiddleware
from llmserve.entrypoints.openai.http_edges import BodyLimitMiddleware
from llmserve.metrics.prometheus import PrometheusStatLogger

BODY = json.dumps({"model": "m", "prompt": "hi"}).encode()


def _stack(controller, **limits):
    """BodyLimit -> Admission -> an app that reads its body and answers it back."""
    state = SimpleNamespace(admission=controller)

    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    return BodyLimitMiddleware(AdmissionMiddleware(app, state), max_body_bytes=1 << 20, state=state, **limits)


def _scope(length: int = len(BODY), client: str = "127.0.0.1"):
    return {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "", "client": (client, 40000),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(length).encode())]}


def _client(chunks, gap: float = 0.0, then_stall: bool = True):
    """A receive that sends ``chunks`` ``gap`` seconds apart (the last ends the body unless
    ``then_stall``: then it never ends) and a send that records the answer."""
    out = {"status": None, "headers": {}, "body": b""}
    pending = list(chunks)

    async def receive():
        if not pending:
            await asyncio.Event().wait()  # the client sends nothing more
        await asyncio.sleep(gap)
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending) or then_stall}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}
        else:
            out["body"] += message.get("body", b"")

    return receive, send, out


def _controller(waiting=2, stat_logger=None):
    return AdmissionController(AdmissionConfig(waiting, 0.0, 0.0), max_num_seqs=128, stat_logger=stat_logger)


def test_unfinished_bodies_hold_no_waiting_slot_and_a_whole_body_is_replayed():
    async def run():
        controller = _controller(waiting=2)
        mw = _stack(controller, body_timeout_s=0.5)
        stalled = []
        for _ in range(5):  # more unfinished bodies than waiting slots
            receive, send, out = _client([BODY[:5]])
            stalled.append((asyncio.ensure_future(mw(_scope(), receive, send)), out))
        await asyncio.sleep(0.05)
        counts = (controller.in_flight, controller.receiving)
        receive, send, out = _client([BODY[:7], BODY[7:]], then_stall=False)  # a whole body, in two parts
        await mw(_scope(), receive, send)
        await asyncio.gather(*(t for t, _ in stalled))
        return counts, out, [o for _, o in stalled], controller

    counts, out, stalled, controller = asyncio.run(run())
    assert counts == (0, 5)  # none admitted while their bodies are arriving
    assert out["status"] == 200 and out["body"] == BODY  # admitted, and the app read the same bytes
    for o in stalled:  # each cut by the deadline, the connection closed
        assert o["status"] == 408 and o["headers"]["connection"] == "close"
        assert "--timeout-request-body" in json.loads(o["body"])["error"]["message"]
    assert (controller.in_flight, controller.receiving) == (0, 0)


def test_a_drip_is_cut_by_the_whole_body_deadline_not_per_read():
    async def run():
        mw = _stack(_controller(), body_timeout_s=0.3)
        receive, send, out = _client([b"x"] * 1000, gap=0.05)  # each read well within 0.3 s
        await asyncio.wait_for(mw(_scope(length=1000), receive, send), 30)  # a guard, not a timing assertion
        return out

    out = asyncio.run(run())
    err = json.loads(out["body"])["error"]
    assert out["status"] == 408 and out["headers"]["connection"] == "close" and err["code"] == 408
    assert "--timeout-request-body" in err["message"]


def test_a_body_below_the_rate_floor_is_cut(monkeypatch):
    monkeypatch.setattr(http_edges, "BODY_RATE_GRACE_S", 0.1)

    async def run():
        mw = _stack(_controller(), body_timeout_s=60.0, min_body_rate=100.0)
        receive, send, out = _client([b"x"] * 1000, gap=0.05)  # 20 bytes/s
        await asyncio.wait_for(mw(_scope(length=1000), receive, send), 30)
        return out

    out = asyncio.run(run())
    assert out["status"] == 408 and out["headers"]["connection"] == "close"
    assert "--min-request-body-rate" in json.loads(out["body"])["error"]["message"]


def test_one_address_bounds_its_unfinished_bodies_by_cutting_the_oldest():
    now = [0.0]  # the middleware's clock: the drips are past the cut grace when the next comes

    async def run():
        mw = _stack(_controller(waiting=100), max_bodies_per_client=2, clock=lambda: now[0])
        drips = []
        for _ in range(3):
            receive, send, out = _client([BODY[:3]])
            drips.append((asyncio.ensure_future(mw(_scope(), receive, send)), out))
            await asyncio.sleep(0.02)
            now[0] += http_edges.BODY_CUT_GRACE_S + 1.0
        other_receive, other_send, other = _client([BODY[:3]])  # another address is not counted with them
        other_task = asyncio.ensure_future(mw(_scope(client="10.0.0.2"), other_receive, other_send))
        await asyncio.sleep(0.02)
        first = dict(drips[0][1])
        receive, send, honest = _client([BODY[:4], BODY[4:]], gap=0.01, then_stall=False)
        await mw(_scope(), receive, send)  # its own arrival cuts the next-oldest drip
        await asyncio.sleep(0.02)
        states = [o["status"] for _, o in drips] + [other["status"]]
        for task, _ in drips + [(other_task, other)]:
            task.cancel()
        await asyncio.gather(*(t for t, _ in drips), other_task, return_exceptions=True)
        return first, honest, states

    first, honest, states = asyncio.run(run())
    assert first["status"] == 429 and first["headers"]["retry-after"] == "1"  # the third cut the first
    assert "--max-request-bodies-per-client" in json.loads(first["body"])["error"]["message"]
    assert honest["status"] == 200 and honest["body"] == BODY
    assert states == [429, 429, None, None]  # the newest drip and the other address still receive


def test_a_burst_of_fresh_bodies_past_the_limit_is_not_cut_but_an_old_drip_is():
    # Every body counts as unfinished until its task runs, so 128 honest requests sent at
    # once from one address passed a limit of 64 and about half were cut with 429.
    now = [0.0]

    async def run():
        mw = _stack(_controller(waiting=100), max_bodies_per_client=2, clock=lambda: now[0])
        receive, send, drip = _client([BODY[:3]])
        drip_task = asyncio.ensure_future(mw(_scope(), receive, send))
        await asyncio.sleep(0.02)
        now[0] += http_edges.BODY_CUT_GRACE_S + 1.0  # the drip is now old enough to cut
        burst = [_client([BODY[:4], BODY[4:]], gap=0.02, then_stall=False) for _ in range(6)]
        await asyncio.gather(*(mw(_scope(), r, s) for r, s, _ in burst))
        drip_task.cancel()
        await asyncio.gather(drip_task, return_exceptions=True)
        return drip, [out for _, _, out in burst]

    drip, burst = asyncio.run(run())
    assert [out["status"] for out in burst] == [200] * 6  # 6 fresh bodies at once, limit 2: none cut
    assert all(out["body"] == BODY for out in burst)
    assert drip["status"] == 429  # the old drip is cut by the first fresh body past the limit
    assert "--max-request-bodies-per-client" in json.loads(drip["body"])["error"]["message"]


def test_requests_without_a_body_pass_untouched():
    async def run():
        controller = _controller()
        mw = _stack(controller, body_timeout_s=0.1)
        receive, send, out = _client([b""], then_stall=False)
        scope = dict(_scope(), method="GET", headers=[])
        await mw(scope, receive, send)
        return out, controller.receiving

    out, receiving = asyncio.run(run())
    assert out["status"] == 200 and receiving == 0


def test_the_admission_queue_is_on_metrics():
    prom = PrometheusStatLogger(SimpleNamespace(model_config=SimpleNamespace(max_model_len=64, model="m",
                                                                             served_model_name=("m",))))
    controller = _controller(waiting=10, stat_logger=prom)
    controller.max_num_seqs = 1  # a batch of one: of two admitted, one waits behind it

    async def run():
        mw = _stack(controller, body_timeout_s=5.0)
        receive, send, _ = _client([BODY[:5]])
        task = asyncio.ensure_future(mw(_scope(), receive, send))
        await asyncio.sleep(0.05)
        assert controller.admit() is None and controller.admit() is None  # two admitted, one batch slot
        text = prom.render().decode()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return text

    text = asyncio.run(run())
    labels = '{engine="0",model_name="m"}'
    assert f"vllm:admission_receiving_requests{labels} 1.0" in text
    assert f"vllm:admission_waiting_requests{labels} 1.0" in text
    assert f"vllm:admission_in_flight_requests{labels} 2.0" in text
    assert "vllm:admission_receiving_requests" + labels + " 0.0" in prom.render().decode()


@pytest.mark.parametrize("flag", ["--min-request-body-rate", "--max-request-bodies-per-client",
                                  "--max-connections-per-client"])
def test_negative_limits_are_refused_naming_the_flag(flag):
    import argparse

    from llmserve.entrypoints.openai.cli_args import make_arg_parser
    from llmserve.entrypoints.openai.frontend import check_http_edge_args

    args = make_arg_parser(argparse.ArgumentParser()).parse_args([flag, "-1"])
    with pytest.raises(ValueError, match=flag):
        check_http_edge_args(args)
