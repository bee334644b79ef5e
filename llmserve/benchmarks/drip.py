"""Slow-drip attack against the request-body limits (issue 26): ``python -m llmserve.benchmarks.drip``.

``--drips`` connections each send a request's headers (a ``Content-Length`` body that
never completes) and then one body byte every ``--drip-interval`` seconds, reconnecting
when the server cuts them, for ``--duration`` seconds; meanwhile ``--clients`` real
clients (closed loop) stream completions. At the end every drip connection still open is
given until the server's body deadline (``--cut-wait``) to be cut. Reports, for the drips,
how each connection ended (the server's status and the flag its message names:
``--timeout-request-body``, ``--min-request-body-rate``, ``--max-request-bodies-per-client``,
``--max-connections-per-client``), how many were never cut, and the seconds from connect
to cut; for the real clients, the status counts, refusals and the median time to first
token. All traffic goes to ``--base-url`` only; counts and time are bounded.

    python -m llmserve.benchmarks.drip --base-url http://127.0.0.1:8000 --drips 200 --clients 32 --duration 30
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from llmserve.benchmarks.overload import _one

_FLAGS = ("--timeout-request-body", "--min-request-body-rate", "--max-request-bodies-per-client",
          "--max-connections-per-client", "--timeout-request-headers")


def _cut_reason(raw: bytes) -> str:
    """``"<status> <flag>"`` of a server's answer to a drip ("closed" when it said nothing)."""
    if not raw:
        return "closed without an answer"
    head, _, body = raw.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1].decode() if b" " in head else "?"
    text = body.decode("utf-8", "replace")
    return f"{status} " + next((f for f in _FLAGS if f in text), "other")


async def _drip_once(host: str, port: int, head: bytes, interval: float, stop_at: float, stats: dict) -> None:
    """One drip connection, until the server answers or closes it (or ``stop_at``)."""
    start = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as e:
        stats["connect_errors"].append(str(e)[:100])
        return
    stats["opened"] += 1
    try:
        writer.write(head + b" ")
        while True:
            try:
                raw = await asyncio.wait_for(reader.read(65536), timeout=max(0.0, min(interval,
                                                                                     stop_at - time.monotonic())))
            except asyncio.TimeoutError:
                if time.monotonic() >= stop_at:
                    stats["not_cut"] += 1
                    return
                writer.write(b" ")  # one more body byte
                continue
            rest = raw
            while raw:  # the whole answer, until the server closes
                raw = await reader.read(65536)
                rest += raw
            stats["cut"][_cut_reason(rest)] += 1
            stats["cut_after_s"].append(time.monotonic() - start)
            return
    except (ConnectionError, OSError):
        stats["cut"]["reset"] += 1
        stats["cut_after_s"].append(time.monotonic() - start)
    finally:
        writer.close()


async def _drips(args: argparse.Namespace, end: float, stats: dict) -> None:
    url = urlsplit(args.base_url)
    auth = f"authorization: Bearer {args.api_key}\r\n" if args.api_key else ""
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: {url.hostname}\r\ncontent-type: application/json\r\n"
            f"{auth}content-length: 100000\r\n\r\n").encode()
    hard_stop = end + args.cut_wait

    async def one_slot() -> None:
        while True:
            await _drip_once(url.hostname, url.port or 80, head, args.drip_interval, hard_stop, stats)
            if time.monotonic() >= end or args.no_reconnect:
                return
            await asyncio.sleep(args.reconnect_delay)  # reconnect: keep the attack up

    await asyncio.gather(*(one_slot() for _ in range(args.drips)))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """The attack and the real clients together; returns the summary dict."""
    drip_stats: dict[str, Any] = {"opened": 0, "cut": collections.Counter(), "not_cut": 0, "cut_after_s": [],
                                  "connect_errors": []}
    real: dict[str, Any] = {"status": collections.Counter(), "no_retry_after": 0, "timeouts": 0, "errors": [],
                            "ttft": []}
    url = args.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    body = {"model": args.model, "prompt": args.prompt, "max_tokens": args.max_tokens, "ignore_eos": True,
            "stream": True}
    end = time.monotonic() + args.duration

    async def client(session: aiohttp.ClientSession) -> None:
        await asyncio.sleep(args.clients_delay)  # the drips are in place first
        while time.monotonic() < end:
            wait = await _one(session, url, body, headers, args.timeout, real)
            if wait:
                await asyncio.sleep(min(wait, max(0.0, end - time.monotonic())))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(_drips(args, end, drip_stats), *(client(session) for _ in range(args.clients)))
    cut_after = sorted(drip_stats["cut_after_s"])
    ttft = sorted(real["ttft"])
    return {"drips": {"connections": args.drips, "opened": drip_stats["opened"], "cut": dict(drip_stats["cut"]),
                      "not_cut": drip_stats["not_cut"], "connect_errors": len(drip_stats["connect_errors"]),
                      "cut_after_s_median": statistics.median(cut_after) if cut_after else None,
                      "cut_after_s_max": cut_after[-1] if cut_after else None},
            "real": {"clients": args.clients, "status": dict(real["status"]),
                     "refused": sum(n for s, n in real["status"].items() if s != 200),
                     "timeouts": real["timeouts"], "errors": real["errors"][:5],
                     "ttft_median_s": statistics.median(ttft) if ttft else None}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--drips", type=int, default=200, help="Drip connections kept open at once.")
    parser.add_argument("--drip-interval", type=float, default=20.0, help="Seconds between two body bytes.")
    parser.add_argument("--no-reconnect", action="store_true", help="Each drip connects once (no reconnect).")
    parser.add_argument("--reconnect-delay", type=float, default=1.0, help="Seconds before a cut drip reconnects.")
    parser.add_argument("--clients", type=int, default=32, help="Real clients (closed loop).")
    parser.add_argument("--clients-delay", type=float, default=1.0, help="Seconds before the real clients start.")
    parser.add_argument("--duration", type=float, default=30.0, help="Seconds of attack and load.")
    parser.add_argument("--cut-wait", type=float, default=60.0,
                        help="Seconds after --duration a drip still open may wait to be cut (then: not cut).")
    parser.add_argument("--prompt", default="Write a short story about a robot learning to paint.")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0, help="Client timeout per real request (s).")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args)), indent=1))


if __name__ == "__main__":
    main()
