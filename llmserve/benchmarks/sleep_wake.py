"""Sleep mode's figures (issue 31): the engine process's memory awake and asleep, and the
time to the first token of a request that wakes it, at sleep levels 1 and 2.

Starts ``llmserve serve --enable-sleep-mode`` (VLLM_SERVER_DEV_MODE=1; the default model,
SmolLM2-135M-Instruct Q4_1, unless extra serve flags say otherwise), warms it with one chat,
then for each round and level: RSS of the engine process awake (after a chat), POST
/sleep?level=N, RSS asleep, then a streamed chat whose time to first token includes the
wake. The awake TTFT of the same kind of chat (a new prompt each time: no prefix-cache
hit) is measured in the same round for the ratio. Medians over ``--rounds``; the load
average is printed beside each figure.

    python -m llmserve.benchmarks.sleep_wake [--rounds 3] [-- extra serve flags]

Needs psutil (the benchmarks' extra).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx
import psutil


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ttft(url: str, prompt: str) -> float:
    """Seconds to the first streamed content chunk of a short greedy chat (the model
    listing before it is not timed)."""
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()  # after /v1/models: that call does not wake the engine
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    return time.perf_counter() - t0
    raise RuntimeError("no content streamed")


def _engine(server: psutil.Process) -> psutil.Process:
    """The engine process: the server's child holding the most memory."""
    return max(server.children(recursive=True), key=lambda p: p.memory_info().rss)


def _mem_mib(p: psutil.Process) -> tuple[float, float]:
    """(RSS, anonymous RSS) in MiB: file-backed pages (shared libraries) are the rest."""
    m = p.memory_full_info()
    return m.rss / 2**20, (m.rss - m.shared) / 2**20


def _start(extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "serve", "--port", str(port),
           "--enable-sleep-mode", *extra]
    proc = subprocess.Popen(cmd, env=dict(os.environ, VLLM_SERVER_DEV_MODE="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def _round(url: str, engine: psutil.Process, level: int, i: int) -> dict:
    awake_ttft = _ttft(url, f"Round {i} level {level}: name three colours.")
    time.sleep(1.0)  # let the idle KV prefault settle
    rss_awake, anon_awake = _mem_mib(engine)
    httpx.post(url + f"/sleep?level={level}", timeout=60).raise_for_status()
    time.sleep(0.5)
    rss_asleep, anon_asleep = _mem_mib(engine)
    wake_ttft = _ttft(url, f"Round {i} level {level}: name three animals.")
    return dict(rss_awake=rss_awake, rss_asleep=rss_asleep, anon_awake=anon_awake, anon_asleep=anon_asleep,
                awake_ttft=awake_ttft, wake_ttft=wake_ttft)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    args, extra = p.parse_known_args()
    proc, url = _start([a for a in extra if a != "--"])
    try:
        engine = _engine(psutil.Process(proc.pid))
        _ttft(url, "Warm up.")
        rows: dict[int, list[dict]] = {1: [], 2: []}
        for i in range(args.rounds):
            for level in (1, 2):
                rows[level].append(_round(url, engine, level, i))
                print(f"round {i} level {level}: {rows[level][-1]} load {os.getloadavg()[0]:.2f}", flush=True)
        print("| level | engine RSS awake MiB | asleep MiB | freed | anon awake / asleep MiB | TTFT awake s "
              "| TTFT after wake s | load |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for level, rs in rows.items():
            m = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            print(f"| {level} | {m['rss_awake']:.0f} | {m['rss_asleep']:.0f} | "
                  f"{1 - m['rss_asleep'] / m['rss_awake']:.0%} | {m['anon_awake']:.0f} / {m['anon_asleep']:.0f} | "
                  f"{m['awake_ttft']:.3f} | {m['wake_ttft']:.3f} | {os.getloadavg()[0]:.2f} |", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
