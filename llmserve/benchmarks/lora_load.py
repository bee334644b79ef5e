"""Loading LoRA adapters over HTTP while other requests stream (issue 28):

    python -m llmserve.benchmarks.lora_load [--model SmolLM2-135M-Instruct] [--streams 4]
        [--loads 8] [--rank 16] [--output-len 160] [--repeats 3] [--dtype float32]

Starts ``llmserve serve --enable-lora --allow-runtime-lora-updating`` on a free port, then,
``--repeats`` times: ``--streams`` streamed completions on the base model (``ignore_eos``,
``--output-len`` tokens each); once every stream has its first tokens, ``--loads``
random rank-``--rank`` PEFT adapters (all seven projections, ``benchmarks/lora.py``) are
loaded one after another with ``POST /v1/load_lora_adapter`` (timed) and unloaded again.
Per stream: the median gap between its chunks over the whole stream, and the largest gap
that overlaps a load call; their ratio says whether the loads paused the streams. A
control window of the same length after them gives the ratio with no load.
Last, each adapter is loaded once more with no stream running (``idle_load_ms``).
Prints JSON: load latency (median, max, ms), the worst ratios (during loads, control).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional, Sequence

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, log: Any) -> subprocess.Popen:
    """``llmserve serve`` with LoRA and run-time loading on; returns once /health is 200."""
    cmd = [sys.executable, "-m", "llmserve.entrypoints.openai.api_server", "--model", args.model, "--host",
           "127.0.0.1", "--port", str(port), "--dtype", args.dtype, "--enable-lora", "--max-lora-rank",
           str(args.rank), "--max-loras", "2", "--max-cpu-loras", str(args.loads + 1),
           "--allow-runtime-lora-updating", "--disable-uvicorn-access-log", "--kv-cache-memory", "512MiB"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server not ready")


def _stream(client: httpx.Client, model: str, output_len: int, times: list[float], ready: threading.Event) -> None:
    body = {"model": model, "prompt": "Tell me a long story about a lighthouse keeper.", "max_tokens": output_len,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if len(times) == 8:
                    ready.set()
    ready.set()


def _max_gap_in(times: list[float], windows: list[tuple[float, float]]) -> float:
    """The largest gap between consecutive chunks that overlaps one of ``windows``."""
    gaps = [b - a for a, b in zip(times, times[1:]) if any(a < end and b > start for start, end in windows)]
    return max(gaps, default=0.0)


def one_round(client: httpx.Client, model: str, adapters: list[str], args: argparse.Namespace) -> dict:
    """Streams on the base model; the adapters loaded (and unloaded) while they run."""
    times: list[list[float]] = [[] for _ in range(args.streams)]
    ready = [threading.Event() for _ in range(args.streams)]
    threads = [threading.Thread(target=_stream, args=(client, model, args.output_len, t, e))
               for t, e in zip(times, ready)]
    for t in threads:
        t.start()
    for e in ready:
        e.wait(300)
    loads, windows = [], []
    control_start = time.perf_counter()
    for i, path in enumerate(adapters):
        t0 = time.perf_counter()
        r = client.post("/v1/load_lora_adapter", json={"lora_name": f"bench-{i}", "lora_path": path})
        t1 = time.perf_counter()
        if r.status_code != 200:
            raise RuntimeError(f"load failed: {r.status_code} {r.text}")
        loads.append(t1 - t0)
        windows.append((t0, t1))
    spent = time.perf_counter() - control_start
    for i in range(len(adapters)):
        client.post("/v1/unload_lora_adapter", json={"lora_name": f"bench-{i}"})
    control = [(time.perf_counter(), time.perf_counter() + spent)]  # as long, after the loads, no load call
    time.sleep(spent)
    for t in threads:
        t.join(600)
    ratios, control_ratios = [], []
    for ts in times:
        median = statistics.median(b - a for a, b in zip(ts, ts[1:]))
        ratios.append(_max_gap_in(ts, windows) / median)
        control_ratios.append(_max_gap_in(ts, control) / median)
    return {"load_ms": [x * 1000 for x in loads], "max_ratio": max(ratios), "control_max_ratio": max(control_ratios),
            "median_itl_ms": statistics.median(statistics.median(b - a for a, b in zip(ts, ts[1:])) for ts in times)
            * 1000}


def _idle_loads(client: httpx.Client, adapters: list[str]) -> list[float]:
    """Load (then unload) each adapter with nothing else running: ms per load."""
    out = []
    for i, path in enumerate(adapters):
        t0 = time.perf_counter()
        r = client.post("/v1/load_lora_adapter", json={"lora_name": f"idle-{i}", "lora_path": path})
        out.append((time.perf_counter() - t0) * 1000)
        if r.status_code != 200:
            raise RuntimeError(f"load failed: {r.status_code} {r.text}")
        client.post("/v1/unload_lora_adapter", json={"lora_name": f"idle-{i}"})
    return out


def run(args: argparse.Namespace) -> dict:
    from llmserve.benchmarks.lora import write_random_adapter
    from llmserve.engine_args import EngineArgs

    hf_config = EngineArgs(model=args.model, dtype=args.dtype).create_engine_config().model_config.hf_config
    root = tempfile.mkdtemp(prefix="llmserve-lora-load-")
    adapters = [write_random_adapter(hf_config, os.path.join(root, f"a{i}"), args.rank, seed=i)
                for i in range(args.loads)]
    port = _free_port()
    with tempfile.NamedTemporaryFile(prefix="llmserve-lora-load-", suffix=".log", delete=False) as log:
        proc = start_server(args, port, log)
        try:
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
            model = client.get("/v1/models").json()["data"][0]["id"]
            rounds = []
            for _ in range(args.repeats):
                rounds.append(one_round(client, model, adapters, args))
                print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)  # each round as it ends
            idle = _idle_loads(client, adapters)
        finally:
            proc.terminate()
            proc.wait(60)
    loads = [x for r in rounds for x in r["load_ms"]]
    return {"model": args.model, "rank": args.rank, "streams": args.streams, "loads_per_round": args.loads,
            "repeats": args.repeats, "load_ms_median": statistics.median(loads), "load_ms_max": max(loads),
            "idle_load_ms": idle, "idle_load_ms_median": statistics.median(idle),
            "gap_ratio_during_loads_max_per_round": [r["max_ratio"] for r in rounds],
            "gap_ratio_control_max_per_round": [r["control_max_ratio"] for r in rounds],
            "median_itl_ms_per_round": [r["median_itl_ms"] for r in rounds]}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m llmserve.benchmarks.lora_load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--loads", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    print(json.dumps(run(parser.parse_args(argv)), indent=1))


if __name__ == "__main__":
    main()
