"""Sleep mode's figures (issue 31): the engine process's memory awake and asleep, and the
time to the first token of a request that wakes it, at sleep levels 1 and 2.

Starts ``llmserve serve --enable-sleep-mode`` (VLLM_SERVER_DEV_MODE=1; the default model,
SmolLM2-135M-Instruct Q4_1, unless extra serve flags say otherwise), warms it with one chat,
then for each round and level: a streamed greedy chat awake (its time to first token and
text), the engine's memory (``/proc/PID/status``: RssAnon, the anonymous pages the OS gets
back only when they are freed; RssFile, pages of mapped files such as the shared libraries,
reclaimable and mostly shared with other processes), POST /sleep?level=N, the memory
asleep (level 2 ends the engine process: every engine process the server has, so 0 when
none is left), ``/health``, ``/metrics`` and ``/is_sleeping`` while asleep (status and
seconds; they must not wake it), then the same chat again, whose time to first token
includes the wake, and whether its text equals the one before the sleep (greedy: it must).
The prefix cache is emptied by the sleep, so the second chat computes its prompt again.
Medians over ``--rounds``; the load average is printed beside each figure.

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


def _chat(url: str, prompt: str) -> tuple[float, str]:
    """(seconds to the first streamed content chunk, whole text) of a short greedy chat
    (the model listing before it is not timed)."""
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()  # after /v1/models: that call does not wake the engine
    ttft, text = None, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(delta["content"])
    if ttft is None:
        raise RuntimeError("no content streamed")
    return ttft, "".join(text)


def _engines(server: psutil.Process) -> list[psutil.Process]:
    """The engine processes: the server's descendants (none while a level-2 sleep has
    ended the engine)."""
    return server.children(recursive=True)


def _mem_mib(procs: list[psutil.Process]) -> dict[str, float]:
    """RSS and its kinds (``/proc/PID/status``: VmRSS, RssAnon, RssFile, RssShmem) in MiB,
    summed over ``procs`` (processes that exit meanwhile count 0)."""
    out = {"rss": 0.0, "anon": 0.0, "file": 0.0, "shmem": 0.0}
    keys = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    if k in keys:
                        out[keys[k]] += int(v.split()[0]) / 1024
        except OSError:
            pass
    return out


def _probe(url: str, path: str) -> tuple[int, float]:
    """(HTTP status, seconds) of a GET."""
    t0 = time.perf_counter()
    status = httpx.get(url + path, timeout=30).status_code
    return status, time.perf_counter() - t0


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


def _round(url: str, server: psutil.Process, level: int, i: int) -> dict:
    prompt = f"Round {i} level {level}: name three colours and say why you like them."
    awake_ttft, before = _chat(url, prompt)
    time.sleep(1.0)  # let the idle KV prefault settle
    awake = _mem_mib(_engines(server))
    api_awake = _mem_mib([server])
    t0 = time.perf_counter()
    httpx.post(url + f"/sleep?level={level}", timeout=60).raise_for_status()
    sleep_s = time.perf_counter() - t0
    time.sleep(0.5)
    asleep = _mem_mib(_engines(server))
    api_asleep = _mem_mib([server])
    health, health_s = _probe(url, "/health")
    metrics, metrics_s = _probe(url, "/metrics")
    still = httpx.get(url + "/is_sleeping", timeout=30).json()["is_sleeping"]
    wake_ttft, after = _chat(url, prompt)
    return dict(rss_awake=awake["rss"], rss_asleep=asleep["rss"], anon_awake=awake["anon"],
                anon_asleep=asleep["anon"], file_awake=awake["file"], file_asleep=asleep["file"],
                api_rss_awake=api_awake["rss"], api_rss_asleep=api_asleep["rss"], sleep_s=sleep_s,
                health=health, health_s=health_s, metrics=metrics, metrics_s=metrics_s,
                asleep_after_probes=still, awake_ttft=awake_ttft, wake_ttft=wake_ttft, same_text=before == after)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    args, extra = p.parse_known_args()
    proc, url = _start([a for a in extra if a != "--"])
    try:
        server = psutil.Process(proc.pid)
        _chat(url, "Warm up.")
        rows: dict[int, list[dict]] = {1: [], 2: []}
        for i in range(args.rounds):
            for level in (1, 2):
                rows[level].append(_round(url, server, level, i))
                r = {k: round(v, 3) if isinstance(v, float) else v for k, v in rows[level][-1].items()}
                print(f"round {i} level {level}: {r} load {os.getloadavg()[0]:.2f}", flush=True)
        print("| level | engine RSS awake MiB (anon / file) | asleep MiB (anon / file) | freed | API server RSS "
              "awake / asleep MiB | sleep s | /health asleep | TTFT awake s | TTFT after wake s | same text | load |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for level, rs in rows.items():
            m = {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], float)}
            health = "/".join(sorted({str(r["health"]) for r in rs})) + f" in {m['health_s'] * 1000:.0f} ms"
            same = sum(r["same_text"] for r in rs)
            print(f"| {level} | {m['rss_awake']:.0f} ({m['anon_awake']:.0f} / {m['file_awake']:.0f}) | "
                  f"{m['rss_asleep']:.0f} ({m['anon_asleep']:.0f} / {m['file_asleep']:.0f}) | "
                  f"{1 - m['rss_asleep'] / m['rss_awake']:.0%} | {m['api_rss_awake']:.0f} / {m['api_rss_asleep']:.0f} | "
                  f"{m['sleep_s']:.2f} | {health} | {m['awake_ttft']:.3f} | {m['wake_ttft']:.3f} | "
                  f"{same}/{len(rs)} | {os.getloadavg()[0]:.2f} |", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
