"""Hostile request chat templates against a server run with ``--trust-request-chat-template``
(issue 26 item 3): ``python -m llmserve.benchmarks.hostile_templates``.

Each case sends one chat whose ``chat_template`` is hostile (a 10^9-character string, a
2x10^8-step loop, a 2x10^8 ``range``), with ``X-Request-Timeout: --request-timeout`` and
once without it (then the server's ``--request-chat-template-timeout`` bounds it), while
one client keeps sending ordinary chats. Reports per case: the status, the error's
``param``, the seconds until the answer, the peak RSS of the API-server process
(``--server-pid``, sampled every 10 ms with psutil) and of its template workers, and how
the ordinary chats fared meanwhile. A last case hangs up after 1 s and reports how long
the busy worker lived on. All traffic goes to ``--base-url`` only; counts and time are
bounded.

    python -m llmserve.benchmarks.hostile_templates --base-url http://127.0.0.1:8000 --server-pid PID
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any, Optional

import httpx
import psutil

CASES = {
    "big-string": "{% set x = 'a' * 1000000000 %}",
    "2e8-loop": "{% for i in range(20000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
    "2e8-range": "{% for i in range(200000000) %}{% endfor %}",
}
ENDLESS = "{% for i in range(100000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}"
MSGS = [{"role": "user", "content": "Name a colour."}]


class Sampler:
    """Peak RSS (bytes) of the server process and of its template workers while running."""

    def __init__(self, pid: int) -> None:
        self.proc, self.stop = psutil.Process(pid), threading.Event()
        self.server_peak = self.worker_peak = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def workers(self) -> list[psutil.Process]:
        out = []
        for c in self.proc.children():
            try:
                if "template_sandbox" in " ".join(c.cmdline()):
                    out.append(c)
            except psutil.Error:  # killed (a zombie until reaped)
                pass
        return out

    def _run(self) -> None:
        while not self.stop.is_set():
            self.server_peak = max(self.server_peak, self.proc.memory_info().rss)
            for w in self.workers():
                try:
                    self.worker_peak = max(self.worker_peak, w.memory_info().rss)
                except psutil.Error:  # killed meanwhile
                    pass
            time.sleep(0.01)

    def __enter__(self) -> "Sampler":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()


def ordinary_loop(client: httpx.Client, path: str, body: Optional[dict], stop: threading.Event, out: list) -> None:
    """Back-to-back ordinary requests (chats with the server's own template, or /health
    probes every 50 ms) until ``stop``."""
    while not stop.is_set():
        t0 = time.perf_counter()
        r = client.request("POST" if body else "GET", path, json=body)
        out.append((path, r.status_code, time.perf_counter() - t0))
        if body is None:
            time.sleep(0.05)


def one_case(client: httpx.Client, args: argparse.Namespace, model: str, template: str,
             timeout: Optional[float]) -> dict[str, Any]:
    headers = {"X-Request-Timeout": str(timeout)} if timeout else {}
    stop, ordinary = threading.Event(), []
    with Sampler(args.server_pid) as sampler:
        chat = {"model": model, "messages": MSGS, "max_tokens": 4}
        loops = [threading.Thread(target=ordinary_loop, args=(client, path, body, stop, ordinary))
                 for path, body in (("/v1/chat/completions", chat), ("/health", None))]
        for loop in loops:
            loop.start()
        t0 = time.perf_counter()
        r = client.post("/v1/chat/completions", headers=headers,
                        json={"model": model, "messages": MSGS, "max_tokens": 4, "chat_template": template})
        elapsed = time.perf_counter() - t0
        stop.set()
        for loop in loops:
            loop.join()
    err = r.json().get("error") or {}
    return {"status": r.status_code, "param": err.get("param"), "seconds": round(elapsed, 3),
            "server_peak_rss_mib": sampler.server_peak >> 20, "worker_peak_rss_mib": sampler.worker_peak >> 20,
            "others": {path: {"ok": sum(s == 200 for p, s, _ in ordinary if p == path),
                              "not_ok": sum(s != 200 for p, s, _ in ordinary if p == path),
                              "max_s": round(max((t for p, _, t in ordinary if p == path), default=0.0), 3)}
                       for path in ("/v1/chat/completions", "/health")},
            "message": (err.get("message") or "")[:120]}


def disconnect_case(client: httpx.Client, args: argparse.Namespace, model: str) -> dict[str, Any]:
    """Hang up after 1 s on an endless template: seconds until its worker is gone."""
    sampler = Sampler(args.server_pid)
    before = {w.pid for w in sampler.workers()}
    t0 = time.perf_counter()
    try:
        client.post("/v1/chat/completions", timeout=1.0,
                    json={"model": model, "messages": MSGS, "max_tokens": 4, "chat_template": ENDLESS})
    except httpx.TimeoutException:
        pass
    hung_up = time.perf_counter() - t0
    while before <= {w.pid for w in sampler.workers()} and time.perf_counter() - t0 < 60:
        time.sleep(0.01)
    return {"hung_up_after_s": round(hung_up, 3), "worker_gone_after_s": round(time.perf_counter() - t0, 3)}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--server-pid", type=int, required=True, help="The API server's process id.")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--request-timeout", type=float, default=2.0, help="X-Request-Timeout of the cases.")
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.base_url, headers=headers, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        client.post("/v1/chat/completions", json={"model": model, "messages": MSGS, "max_tokens": 1})  # warm
        report: dict[str, Any] = {}
        for name, template in CASES.items():
            for timeout in (args.request_timeout, None):
                key = f"{name} X-Request-Timeout={timeout}" if timeout else f"{name} (no header)"
                report[key] = one_case(client, args, model, template, timeout)
                print(key, json.dumps(report[key]), flush=True)
        report["disconnect"] = disconnect_case(client, args, model)
        print("disconnect", json.dumps(report["disconnect"]), flush=True)


if __name__ == "__main__":
    main()
