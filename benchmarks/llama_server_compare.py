"""Issue 16's side-by-side table: `llmserve serve` against llama.cpp's `llama-server` on the
same GGUF file (the default model's, SmolLM2-135M-Instruct Q4_1), in one run, as ratios.

1. Start-up: seconds from launching each server to its first completed chat, cold (the
   GGUF file evicted from the page cache and, for llmserve, its start-up cache emptied:
   ``llmserve.model_loader.startup_cache``) then warm (started again at once).
2. Idle RSS of each process tree (llmserve: API server + engine), a few seconds after start.
3. ``llmserve bench serve --compare-url`` at each concurrency (128-token chat prompts,
   128 output tokens, ignore_eos, temperature 0): llmserve first, then llama-server, on the
   same requests; ``--rounds`` > 1 alternates the order and reports medians. Each level and
   round draws its own prompts (its own ``--seed``): with the same prompts again, each
   server's prompt cache (llmserve's prefix cache, llama-server's slots) turned the later
   rounds' TTFT into a cache measurement (llmserve, Q4_K_M, c=32: 743-785 tok/s and 0.6 s
   TTFT on repeated prompts against 515-532 tok/s and 1.9-2.6 s on fresh ones). Before a
   level's rounds each server runs one untimed wave at that concurrency (c requests, prompts
   of their own), so no measured round is a server's first at that batch size. Peak RSS and
   CPU seconds of both trees are sampled per level; failed requests are printed per level.
   The server not being measured stays up but idle: 0.00 CPU s for llama-server during a
   llmserve run, 0.15-0.25 s for llmserve during a llama-server one (per-thread /proc stat).
4. RSS after the load.

Both hold K/V in 16 bits by default: llama-server's cache type is float16, llmserve's
``--kv-cache-dtype auto`` is float16 for a GGUF model under float32 activations (bfloat16
where the model runs in bfloat16); ``--kv-cache-dtype float32`` measures a float32 cache.

llama-server runs with ``--parallel`` slots (default 32), ``-c`` = slots x 512 tokens (each
slot holds a 128-token prompt + chat template + 128 output tokens) and the same thread count
as llmserve's engine (``-t``/``-tb``, default: the cores). Load averages are printed beside
each figure; run it under ``flock /tmp/measure.lock`` on a shared machine:

    flock /tmp/measure.lock env PYTHONPATH=. python benchmarks/llama_server_compare.py \
        [--llama-server PATH] [--concurrency 1 4 16 32] [--rounds 1] [--startup-rounds 1]
        [--startup-only] [--gguf FILE] [-- extra llmserve serve flags]

Without the llama-server binary it measures llmserve's start-up and idle RSS only.

Needs psutil.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from llmserve.benchmarks.proc_stats import tree_cpu_s, tree_rss_mib

MODEL = "SmolLM2-135M-Instruct"
DEFAULT_LLAMA = ("/work/llama-build/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server")


class Sampler(threading.Thread):
    """Peak RSS (MiB) of a process tree, sampled every 0.2 s until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self._stop_event = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, tree_rss_mib(self.pid))
            time.sleep(0.2)

    def stop(self) -> float:
        self._stop_event.set()
        self.join()
        return self.peak


def _chat_once(url: str) -> None:
    # llmserve answers 404 to a model name it does not serve; llama-server takes any
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        json.load(r)


def start_server(cmd: list[str], url: str) -> tuple[subprocess.Popen, float]:
    """Start a server; returns it and the seconds until its first chat completion returned."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
        try:
            _chat_once(url)
            return proc, time.perf_counter() - t0
        except Exception:
            time.sleep(0.1)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def evict_page_cache(path: str) -> None:
    """Drop a file's pages from the page cache (no root needed: POSIX_FADV_DONTNEED)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def clear_llmserve_startup_cache(gguf_path: str) -> None:
    """Remove llmserve's start-up cache entry for this file, where that cache exists."""
    try:
        from llmserve.model_loader.startup_cache import entry_dir
    except ImportError:
        return
    shutil.rmtree(entry_dir(gguf_path), ignore_errors=True)


def _bench(ours_url: str, other_url: str, c: int, n: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "bench", "serve", "--base-url", ours_url,
               "--compare-url", other_url, "--endpoint", "/v1/chat/completions",
               "--num-prompts", str(n), "--max-concurrency", str(c), "--seed", str(seed),
               "--random-input-len", "128", "--random-output-len", "128", "--temperature", "0",
               "--model", MODEL, "--tokenizer", MODEL, "--save-result", "--result-dir", d,
               "--result-filename", "r.json"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(d, "r.json")) as f:
            r = json.load(f)
    return r


def run_level(ours, llama, urls: tuple[str, str], c: int, n: int, rounds: int) -> dict:
    """One untimed warm-up wave (c requests) on each server, then ``rounds`` bench runs at
    concurrency c (odd rounds llmserve first, even rounds llama-server first); medians of
    each figure, peak RSS and CPU seconds of both trees (the measured rounds only)."""
    _bench(urls[0], urls[1], c, c, seed=1000 * c + 999)  # untimed warm-up wave on each server
    samplers = (Sampler(ours.pid), Sampler(llama.pid))
    for s in samplers:
        s.start()
    cpu0 = (tree_cpu_s(ours.pid), tree_cpu_s(llama.pid))
    figs: dict[str, list[float]] = {}
    for i in range(rounds):
        if i % 2 == 0:
            r = _bench(urls[0], urls[1], c, n, seed=1000 * c + i)
            a, b = r, r["compare"]
        else:
            r = _bench(urls[1], urls[0], c, n, seed=1000 * c + i)
            a, b = r["compare"], r
        for key in ("output_throughput", "median_ttft_ms", "median_tpot_ms"):
            figs.setdefault("ours_" + key, []).append(a[key])
            figs.setdefault("llama_" + key, []).append(b[key])
        if a["failed"] or b["failed"]:
            print(f"c={c} round {i}: failed requests llmserve {a['failed']}, llama-server {b['failed']} of {n}",
                  flush=True)
    cpu1 = (tree_cpu_s(ours.pid), tree_cpu_s(llama.pid))
    out = {k: statistics.median(v) for k, v in figs.items()}
    out.update(c=c, load=os.getloadavg()[0], peak_ours=samplers[0].stop(), peak_llama=samplers[1].stop(),
               cpu_ours=cpu1[0] - cpu0[0], cpu_llama=cpu1[1] - cpu0[1])
    return out


def _print_row(row: dict) -> None:
    g = row.get
    print(f"| {row['c']} | {g('ours_output_throughput'):.1f} | {g('llama_output_throughput'):.1f} | "
          f"{g('ours_output_throughput') / g('llama_output_throughput'):.2f}x | "
          f"{g('ours_median_ttft_ms'):.0f} / {g('llama_median_ttft_ms'):.0f} ms "
          f"({g('ours_median_ttft_ms') / g('llama_median_ttft_ms'):.2f}x) | "
          f"{g('ours_median_tpot_ms'):.1f} / {g('llama_median_tpot_ms'):.1f} ms "
          f"({g('ours_median_tpot_ms') / g('llama_median_tpot_ms'):.2f}x) | "
          f"{g('peak_ours'):.0f} / {g('peak_llama'):.0f} ({g('peak_ours') / g('peak_llama'):.2f}x) | "
          f"{g('cpu_ours'):.0f} / {g('cpu_llama'):.0f} | {g('load'):.1f} |", flush=True)


def _start_both(args, serve_extra: list[str], gguf_path: str) -> tuple:
    """Cold then warm start of each server (``--startup-rounds`` times, medians); returns
    the warm-started servers (llama-server: None without its binary), the times and urls."""
    ours_url, llama_url = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.llama_port}"
    threads = str(args.threads or os.cpu_count())
    # the K-quant file served under the default name: the bench and the first chat ask for MODEL
    model = ["--model", gguf_path, "--served-model-name", MODEL] if args.gguf else []
    kv = ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else []
    ours_cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "serve", "--port", str(args.port), *model, *kv,
                *[a for a in serve_extra if a != "--"]]
    llama_cmd = [args.llama_server, "-m", gguf_path, "-t", threads, "-tb", threads, "-np", str(args.parallel),
                 "-c", str(args.parallel * 512), "--port", str(args.llama_port)]
    servers = [("llmserve", ours_cmd, ours_url)]
    if os.path.isfile(args.llama_server):
        servers.append(("llama-server", llama_cmd, llama_url))
    else:
        print(f"no llama-server at {args.llama_server}: llmserve only", flush=True)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in servers}
    procs: dict[str, subprocess.Popen] = {}
    for i in range(args.startup_rounds):
        for name, cmd, url in servers:  # alternate the servers round by round
            evict_page_cache(gguf_path)
            if name == "llmserve":
                clear_llmserve_startup_cache(gguf_path)
            proc, cold = start_server(cmd, url)
            stop_server(proc)
            proc, warm = start_server(cmd, url)
            times[name].append((cold, warm))
            print(f"{name}: start -> first chat cold {cold:.1f} s, warm {warm:.1f} s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
            if i + 1 < args.startup_rounds:
                stop_server(proc)
            else:
                procs[name] = proc
    medians = {name: (statistics.median(c for c, _ in t), statistics.median(w for _, w in t))
               for name, t in times.items()}
    return procs.get("llmserve"), procs.get("llama-server"), medians, (ours_url, llama_url)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", default=DEFAULT_LLAMA)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--prompts-per-level", type=int, default=2, help="requests = max(8, this x concurrency)")
    p.add_argument("--rounds", type=int, default=1, help="bench runs per level, alternating which server goes first")
    p.add_argument("--parallel", type=int, default=32, help="llama-server --parallel slots")
    p.add_argument("--threads", type=int, default=None, help="llama-server threads (default: all cores, as llmserve)")
    p.add_argument("--startup-rounds", type=int, default=1, help="cold + warm starts of each server (medians)")
    p.add_argument("--startup-only", action="store_true", help="measure start-up and idle RSS only")
    p.add_argument("--port", type=int, default=8931)
    p.add_argument("--gguf", default=None, help="another GGUF file for both servers (e.g. a Q4_K_M re-encoding of "
                                                "the default model); default: the default model's Q4_1 file")
    p.add_argument("--llama-port", type=int, default=8932)
    p.add_argument("--kv-cache-dtype", default=None,
                   help="llmserve's --kv-cache-dtype (default: its own, 16-bit for a GGUF model as llama-server's f16 "
                        "cache); float32 measures a float32 cache on CPUs without bfloat16")
    args, serve_extra = p.parse_known_args()
    from llmserve.benchmarks.hf_backend import resolve_model_files
    path, gguf = resolve_model_files("SmolLM2-135M-Instruct")
    gguf_path = os.path.abspath(args.gguf) if args.gguf else os.path.join(path, gguf)
    ours, llama, times, urls = _start_both(args, serve_extra, gguf_path)
    rows = []
    if args.startup_only or llama is None:
        time.sleep(5)
        print(f"idle RSS MiB: llmserve {tree_rss_mib(ours.pid):.0f}"
              + (f", llama-server {tree_rss_mib(llama.pid):.0f}" if llama else ""))
        for proc in (ours, llama):
            if proc is not None:
                stop_server(proc)
        for name, (cold, warm) in times.items():
            print(f"{name}: start -> first completed chat (median of {args.startup_rounds}): "
                  f"cold {cold:.1f} s, warm {warm:.1f} s (load {os.getloadavg()[0]:.1f})")
        return
    try:
        time.sleep(5)
        idle = (tree_rss_mib(ours.pid), tree_rss_mib(llama.pid))
        print(f"idle RSS MiB: llmserve {idle[0]:.0f}, llama-server {idle[1]:.0f}", flush=True)
        print("| c | llmserve out tok/s | llama-server out tok/s | ratio | median TTFT (llmserve / llama) "
              "| median TPOT (llmserve / llama) | peak RSS MiB (llmserve / llama) | CPU s | load |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
        for c in args.concurrency:
            rows.append(run_level(ours, llama, urls, c, max(8, args.prompts_per_level * c), args.rounds))
            _print_row(rows[-1])
        time.sleep(5)
        after = (tree_rss_mib(ours.pid), tree_rss_mib(llama.pid))
    finally:
        stop_server(ours)
        stop_server(llama)
    print(f"\nRSS MiB (llmserve server+engine / llama-server): idle {idle[0]:.0f} / {idle[1]:.0f}, "
          f"after the load {after[0]:.0f} / {after[1]:.0f}")
    for name, (cold, warm) in times.items():
        print(f"{name}: start -> first completed chat: cold {cold:.1f} s, warm {warm:.1f} s")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
