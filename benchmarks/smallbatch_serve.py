"""Issue 16's side-by-side run: `llmserve serve` against `llama-server` on the same GGUF
file, one run, ratios. Starts both servers (timing start -> first completed chat), samples
the RSS of each process tree (idle, peak during the load, after), and runs `llmserve bench
serve --compare-url` at each concurrency (128-token chat prompts, 128 output tokens,
temperature 0). Prints one table; the load average is printed beside each row.

    PYTHONPATH=. python benchmarks/smallbatch_serve.py --llama-server /tmp/lcp/.../llama-server \
        [--concurrency 1 4 16 32] [--prompts-per-level 2] [-- extra llmserve serve flags]

Needs psutil. The GGUF file is the default model's (SmolLM2-135M-Instruct Q4_1).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import psutil


def _tree_rss_mib(pid: int) -> float:
    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


class Sampler(threading.Thread):
    """Peak RSS (MiB) of a process tree, sampled every 0.2 s until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _tree_rss_mib(self.pid))
            time.sleep(0.2)

    def stop(self) -> float:
        self._stop.set()
        self.join()
        return self.peak


def _chat_once(url: str) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        json.load(r)


def _start(cmd: list[str], url: str) -> tuple[subprocess.Popen, float]:
    """Start a server; seconds until its first chat completion returned."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
        try:
            _chat_once(url)
            return proc, time.perf_counter() - t0
        except Exception:
            time.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--prompts-per-level", type=int, default=2, help="requests = this x concurrency")
    p.add_argument("--port", type=int, default=8931)
    p.add_argument("--llama-port", type=int, default=8932)
    args, serve_extra = p.parse_known_args()
    from llmserve.benchmarks.hf_backend import resolve_model_files
    path, gguf = resolve_model_files("SmolLM2-135M-Instruct")
    gguf_path = os.path.join(path, gguf)
    ours_url, llama_url = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.llama_port}"
    ours, ours_start = _start([sys.executable, "-m", "llmserve.entrypoints.cli", "serve", "--port",
                               str(args.port), *[a for a in serve_extra if a != "--"]], ours_url)
    llama, llama_start = _start([args.llama_server, "-m", gguf_path, "-t", "2", "-c", "8192", "-np", "16",
                                 "--port", str(args.llama_port)], llama_url)
    print(f"start -> first chat: llmserve {ours_start:.1f} s, llama-server {llama_start:.1f} s")
    time.sleep(3)
    idle = (_tree_rss_mib(ours.pid), _tree_rss_mib(llama.pid))
    print(f"idle RSS MiB: llmserve {idle[0]:.0f}, llama-server {idle[1]:.0f}")
    rows = []
    s_ours, s_llama = Sampler(ours.pid), Sampler(llama.pid)
    s_ours.start(), s_llama.start()
    try:
        for c in args.concurrency:
            with tempfile.TemporaryDirectory() as d:
                cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "bench", "serve", "--base-url", ours_url,
                       "--compare-url", llama_url, "--endpoint", "/v1/chat/completions",
                       "--num-prompts", str(args.prompts_per_level * c), "--max-concurrency", str(c),
                       "--random-input-len", "128", "--random-output-len", "128", "--temperature", "0",
                       "--tokenizer", "SmolLM2-135M-Instruct", "--save-result", "--result-dir", d,
                       "--result-filename", "r.json"]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                with open(os.path.join(d, "r.json")) as f:
                    r = json.load(f)
            o = r["compare"]
            rows.append((c, r, o, os.getloadavg()[0]))
            print(f"c={c}: {r['output_throughput']:.1f} / {o['output_throughput']:.1f} tok/s "
                  f"({r['output_throughput'] / o['output_throughput']:.2f}x), TTFT {r['median_ttft_ms']:.0f} / "
                  f"{o['median_ttft_ms']:.0f} ms, TPOT {r['median_tpot_ms']:.1f} / {o['median_tpot_ms']:.1f} ms "
                  f"(load {rows[-1][3]:.1f})", flush=True)
    finally:
        peak = (s_ours.stop(), s_llama.stop())
        time.sleep(2)
        after = (_tree_rss_mib(ours.pid), _tree_rss_mib(llama.pid))
        for proc in (ours, llama):
            proc.terminate()
            proc.wait(timeout=60)
    print("| c | llmserve out tok/s | llama-server out tok/s | ratio | median TTFT (llmserve / llama) "
          "| median TPOT (llmserve / llama) | load |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c, r, o, load in rows:
        print(f"| {c} | {r['output_throughput']:.1f} | {o['output_throughput']:.1f} | "
              f"{r['output_throughput'] / o['output_throughput']:.2f}x | {r['median_ttft_ms']:.0f} ms / "
              f"{o['median_ttft_ms']:.0f} ms | {r['median_tpot_ms']:.1f} ms / {o['median_tpot_ms']:.1f} ms | {load:.1f} |")
    print(f"RSS MiB (llmserve server+engine / llama-server): idle {idle[0]:.0f} / {idle[1]:.0f}, "
          f"peak {peak[0]:.0f} / {peak[1]:.0f} ({peak[0] / peak[1]:.2f}x), after {after[0]:.0f} / {after[1]:.0f}")
    print(f"start -> first chat: llmserve {ours_start:.1f} s, llama-server {llama_start:.1f} s")


if __name__ == "__main__":
    main()
