"""The disk KV tier (issue 32, llmserve/kv_transfer): time to first token of a long prompt
computed cold, found in the RAM prefix cache, restored into the RAM prefix cache by an
engine started again over the same tier (``restore_on_start``, the default), and loaded
from disk on demand (``restore_on_start`` false); then a replay of a prefix set larger
than the RAM cache, with and without the tier.

    python -m llmserve.benchmarks.kv_tier --prompt-len 4000 --reps 3 --rounds 3
    python -m llmserve.benchmarks.kv_tier --rounds 0 --server-rounds 3   # the same through `llmserve serve`
    python -m llmserve.benchmarks.kv_tier --replay-prompts 12 --replay-len 1000 \\
        --replay-kv-cache 64MiB     # 12,000 prompt tokens over ~2,800 tokens of RAM KV (bf16)

Each TTFT is one ``LLM.generate`` of ``max_tokens=1`` (the prefill and one sampled token),
in-process; cold prompts are distinct (no shared block), so each one prefills fully.
Engine A (warm RAM hits) lives beside the engine under test, so each ratio comes from
alternating pairs in one run (a loaded machine shifts both): B, started again for each
round over A's tier, restores it at start, and each prompt's first hit on it is paired
with A's; C, started over the tier with the restore off, loads from disk on demand (its
RAM prefix cache reset before each hit). Prints one JSON line: medians (seconds), the
ratios the issue asks for, the restore's blocks, bytes and seconds per start, the tier
bytes a restored hit loaded on the request path (0 expected), cached tokens seen, the
bytes written, and ``uptime``'s load. ``--server-rounds`` does the issue's literal case
with ``llmserve serve`` processes (``server_restart``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def _llm(args: argparse.Namespace, tier: str | None, restore: bool = True, **kw):
    from llmserve import LLM

    extra = {} if tier is None else {"kv_transfer_config": {
        "kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": tier, "restore_on_start": restore}}}
    kw.setdefault("max_model_len", args.max_model_len)
    return LLM(args.model, dtype=args.dtype, multiprocess_mode=False, **extra, **kw)


def _ttft(llm, prompt: list[int]) -> tuple[float, int]:
    """Seconds of a max_tokens=1 request, and its cached prompt tokens."""
    from llmserve import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1),
                       use_tqdm=False)[0]
    return time.perf_counter() - t0, out.num_cached_tokens


def _phase(llm, prompts: list[list[int]]) -> dict:
    runs = [_ttft(llm, p) for p in prompts]
    return {"ttft_s": round(statistics.median(t for t, _ in runs), 4), "cached_tokens": [c for _, c in runs]}


def _core(llm):
    return llm.llm_engine.engine_core.engine_core


def _flush(llm) -> None:
    """Wait for the in-process engine's tier writer."""
    _core(llm).model_runner.kv_connector.flush()


def _count_loads(llm) -> dict:
    """Bytes the scheduler-side connector loads from the tier for requests, summed from
    here on (each engine step takes the connector's counters)."""
    conn, total = _core(llm).scheduler.connector, {"bytes_loaded": 0}
    take = conn.get_stats

    def spy():
        st = take()
        total["bytes_loaded"] += st.get("bytes_loaded", 0)
        return st
    conn.get_stats = spy
    return total


def _tier_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _pairs(a, other, prompts: list[list[int]], r: int, before_other=None) -> list[tuple]:
    """One hit per prompt on ``a`` (warm RAM) and on ``other``, alternating which runs
    first; ``before_other()`` runs before each hit on ``other``. ((warm s, cached), (other
    s, cached)) per prompt."""
    out = []
    for i, p in enumerate(prompts):
        pair = {}
        for side in (("warm", "other") if (r + i) % 2 == 0 else ("other", "warm")):
            if side == "other" and before_other is not None:
                before_other()
            pair[side] = _ttft(a if side == "warm" else other, p)
        out.append((pair["warm"], pair["other"]))
    return out


def persistence(args: argparse.Namespace, tier: str) -> dict:
    """Cold TTFT of ``--reps`` distinct long prompts on engine A (which writes them to the
    tier). Restored: ``--rounds`` times, engine B starts over the tier (a restart: its
    restore loads the tier into its RAM prefix cache), and each prompt's first hit on it
    is paired with a warm hit on A. On demand: engine C starts over the tier with the
    restore off; its first hit per prompt (``restart_disk``: fresh KV pages), then
    ``--rounds`` pairs per prompt of A's warm hit against C's load from disk (C's RAM
    prefix cache reset before each). Ratios: medians of the per-pair ratios."""
    prompts = _prompts(args.reps, args.prompt_len, args.seed)
    a = _llm(args, tier)
    _ttft(a, _prompts(1, 64, args.seed + 1)[0])  # warm the kernels
    cold = _phase(a, prompts)
    t0 = time.perf_counter()
    _flush(a)  # the cold prompts' blocks written (the writer thread shares the cores)
    flush_s = time.perf_counter() - t0
    written = _tier_bytes(tier)
    restored, starts, request_path_bytes = [], [], 0
    for r in range(args.rounds):
        t0 = time.perf_counter()
        b = _llm(args, tier)  # a restart: restores the tier at start
        start_s = time.perf_counter() - t0
        done = _core(b).tier_restore_done
        starts.append({"engine_start_s": round(start_s, 3), "restored_blocks": done.blocks if done else 0,
                       "restored_mib": round(done.nbytes / 2**20, 1) if done else 0,
                       "restore_s": round(done.seconds, 3) if done else None})
        _ttft(b, _prompts(1, 64, args.seed + 2 + r)[0])  # warm the kernels (a prompt the tier lacks)
        loads = _count_loads(b)
        restored += _pairs(a, b, prompts, r)
        request_path_bytes += loads["bytes_loaded"]
        b.shutdown()
    c = _llm(args, tier, restore=False)
    _ttft(c, _prompts(1, 64, args.seed + 100)[0])
    restart = _phase(c, prompts)
    disk = []
    for r in range(args.rounds):
        disk += _pairs(a, c, prompts, r, c.reset_prefix_cache)
    a.shutdown()
    c.shutdown()
    med = lambda runs: round(statistics.median(t for t, _ in runs), 4)
    ratio = lambda pairs: round(statistics.median(o[0] / w[0] for w, o in pairs), 3)
    warm_all = [w for w, _ in restored + disk]
    return {"prompt_len": args.prompt_len, "cold": cold,
            "warm_ram_ttft_s": med(warm_all),
            "restored_ttft_s": med([o for _, o in restored]),
            "restored_over_warm": ratio(restored),
            "restored_pairs_s": [[round(w[0], 4), round(o[0], 4)] for w, o in restored],
            "restored_over_cold": round(med([o for _, o in restored]) / cold["ttft_s"], 3),
            "restored_request_path_bytes_loaded": request_path_bytes,
            "restore_at_start": starts,
            "restart_disk": restart, "disk_ttft_s": med([o for _, o in disk]),
            "disk_over_warm": ratio(disk),
            "disk_pairs_s": [[round(w[0], 4), round(o[0], 4)] for w, o in disk],
            "disk_over_cold": round(med([o for _, o in disk]) / cold["ttft_s"], 3),
            "restart_disk_over_warm": round(restart["ttft_s"] / med(warm_all), 3),
            "cached_tokens": {"warm": sorted({w[1] for w in warm_all}),
                              "restored": sorted({o[1] for _, o in restored}),
                              "disk": sorted({o[1] for _, o in disk})},
            "tier_bytes": written, "writes_pending_after_cold_s": round(flush_s, 3)}


def replay(args: argparse.Namespace, tier: str | None) -> dict:
    """A prefix set larger than the RAM KV cache, run twice: the second pass's hit rate
    (cached / prompt tokens) and median TTFT."""
    prompts = _prompts(args.replay_prompts, args.replay_len, args.seed + 10)
    llm = _llm(args, tier, kv_cache_memory=args.replay_kv_cache, max_model_len=2 * args.replay_len)
    for p in prompts:
        _ttft(llm, p)
    runs = [_ttft(llm, p) for p in prompts]
    llm.shutdown()
    return {"hit_rate": round(sum(c for _, c in runs) / (len(prompts) * args.replay_len), 3),
            "ttft_s": round(statistics.median(t for t, _ in runs), 4)}


def _serve(args: argparse.Namespace, tier: str, restore: bool, port: int, log) -> subprocess.Popen:
    """``llmserve serve`` over ``tier`` on ``port`` (this process's niceness), once its
    /health answers. Raises RuntimeError when it exits or is not up in 600 s."""
    from llmserve.benchmarks.router_trace import wait_healthy

    cfg = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": tier, "restore_on_start": restore}}
    proc = subprocess.Popen([sys.executable, "-m", "llmserve.entrypoints.cli", "serve", "--model", args.model,
                             "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--port", str(port),
                             "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(cfg)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:  # 600 s: a fresh machine builds the CPU kernels first (~4 min)
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=600)
    except RuntimeError as e:
        _stop(proc)
        raise RuntimeError(f"llmserve serve did not come up on port {port} ({e}); see its log {log.name}") from None
    return proc


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server flushes the tier's writer), then wait."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)


def _http_ttft(port: int, model: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds of a max_tokens=1 completion (not streamed: the prefill and one token) and
    its usage.prompt_tokens_details.cached_tokens."""
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=600, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _metric(port: int, name: str) -> float:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


def server_restart(args: argparse.Namespace, tier: str) -> dict:
    """The issue's case through ``llmserve serve``: one server serves a ``--prompt-len``
    prompt cold and is stopped (SIGTERM); then, ``--server-rounds`` times, a server started
    again over the tier idles ``--server-idle`` s (its restore runs then) and gets the
    prompt again (its first hit), followed by ``--reps`` hits on the same server (warm RAM
    hits); and the same with ``restore_on_start`` false (the first hit loads from disk).
    Ratios: per round, the first hit over the median of the warm hits after it; medians."""
    prompt = _prompts(1, args.prompt_len, args.seed + 200)[0]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    runs: dict = {"restored": [], "disk": []}
    with open(os.path.join(tempfile.gettempdir(), "kv_tier_serve.log"), "w") as log:
        proc = _serve(args, tier, True, port, log)
        try:
            _http_ttft(port, args.model, prompt[:64])  # warm the kernels (cached: its 4 blocks)
            cold = _http_ttft(port, args.model, prompt)
        finally:
            _stop(proc)
        for _ in range(args.server_rounds):
            for restore, key in ((True, "restored"), (False, "disk")):
                proc = _serve(args, tier, restore, port, log)
                try:
                    time.sleep(args.server_idle)
                    first = _http_ttft(port, args.model, prompt)
                    warm = [_http_ttft(port, args.model, prompt)[0] for _ in range(args.reps)]
                    runs[key].append({"first_s": round(first[0], 4), "cached_tokens": first[1],
                                      "warm_s": [round(t, 4) for t in warm],
                                      "ratio": round(first[0] / statistics.median(warm), 3),
                                      "blocks_restored": _metric(port, "vllm:kv_connector_blocks_restored_total"),
                                      "disk_hit_tokens": _metric(port, "vllm:external_prefix_cache_hits_total")})
                finally:
                    _stop(proc)
    ratio = lambda key: round(statistics.median(r["ratio"] for r in runs[key]), 3) if runs[key] else None
    return {"prompt_len": args.prompt_len, "cold_s": round(cold[0], 4), "restored_over_warm": ratio("restored"),
            "disk_over_warm": ratio("disk"), **runs}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--reps", type=int, default=3, help="distinct long prompts")
    p.add_argument("--rounds", type=int, default=3,
                   help="engine B restarts (restored hits), and alternating warm/disk rounds on engine C")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay-prompts", type=int, default=0, help="0: no replay phase")
    p.add_argument("--replay-len", type=int, default=1000)
    p.add_argument("--replay-kv-cache", default="64MiB")
    p.add_argument("--server-rounds", type=int, default=0,
                   help="restarts of `llmserve serve` over the tier, restore on and off each (0: none)")
    p.add_argument("--server-idle", type=float, default=3.0, help="seconds a restarted server idles first")
    args = p.parse_args(argv)
    result: dict = {"uptime_before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    if args.rounds:
        with tempfile.TemporaryDirectory(prefix="kv_tier_") as tier:
            result["persistence"] = persistence(args, tier)
    if args.server_rounds:
        with tempfile.TemporaryDirectory(prefix="kv_tier_serve_") as tier:
            result["server_restart"] = server_restart(args, tier)
    if args.replay_prompts:
        with tempfile.TemporaryDirectory(prefix="kv_tier_replay_") as tier:
            result["replay_with_tier"] = replay(args, tier)
        result["replay_without_tier"] = replay(args, None)
    result["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
