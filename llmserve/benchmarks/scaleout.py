"""Scale-out figures (issue 14), one subcommand each, for re-running quietly:

    python -m llmserve.benchmarks.scaleout tp-equal [--backends mp,ray] [--prompts 16] [--tokens 32]
        greedy tokens with TP=2 (each backend) vs TP=1, float32, on SmolLM2-135M-Instruct
    python -m llmserve.benchmarks.scaleout dp-vs-threads [--rounds 2] [--concurrency 32]
        `llmserve bench serve` against DP=2 x 1 thread and DP=1 x 2 threads, alternating
        rounds (one server at a time), medians and the ratio
    python -m llmserve.benchmarks.scaleout api-servers [--rounds 2] [--concurrency 64] [--output-len 4]
        `llmserve bench serve` against --api-server-count 2 and 1 (short outputs: front-end
        bound), alternating rounds, medians and the requests/s ratio
    python -m llmserve.benchmarks.scaleout kill-rank [--concurrency 16]
        SIGKILL one DP rank under load: seconds until every client has its answer or error;
        processes and socket dirs left after shutdown
"""
from __future__ import annotations

import argparse
import json
import os
import time


def _prompts(n: int) -> list[str]:
    topics = ["the sea", "a robot", "winter", "coffee", "the moon", "rivers", "a library", "trains",
              "music", "bees", "mountains", "a city at night", "bread", "the wind", "chess", "clocks"]
    return [f"Write one sentence about {topics[i % len(topics)]} (#{i}):" for i in range(n)]


def tp_equal(args) -> dict:
    """Greedy token ids of TP=1 (uni) and TP=2 per backend; returns the comparison."""
    from llmserve import LLM, SamplingParams

    prompts = _prompts(args.prompts)
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    runs = [("uni", 1)] + [(b, 2) for b in args.backends.split(",") if b]
    tokens, secs = {}, {}
    for backend, tp in runs:
        t0 = time.perf_counter()
        llm = LLM(args.model, dtype="float32", tensor_parallel_size=tp, distributed_executor_backend=backend,
                  kv_cache_memory="256MiB", max_model_len=512)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        secs[f"{backend}_tp{tp}"] = round(time.perf_counter() - t1, 2)
        tokens[f"{backend}_tp{tp}"] = [list(o.outputs[0].token_ids) for o in outs]
        llm.shutdown()
        print(f"{backend} tp={tp}: start {t1 - t0:.1f} s, generate {secs[f'{backend}_tp{tp}']} s", flush=True)
    ref = tokens["uni_tp1"]
    result = {"prompts": len(prompts), "tokens": args.tokens, "generate_s": secs, "loadavg": os.getloadavg()}
    for k, v in tokens.items():
        if k != "uni_tp1":
            result[f"{k}_equal_prompts"] = sum(a == b for a, b in zip(ref, v))
    return result


def _start_server(model: str, port: int, extra: list[str]):
    import subprocess
    import sys
    import urllib.request

    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "serve", model, "--port", str(port),
           "--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--disable-log-stats", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not start")


def _stop_server(proc) -> None:
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _bench(port: int, args) -> dict:
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "llmserve.entrypoints.cli", "bench", "serve", "--port", str(port),
                        "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
                        "--random-output-len", str(args.output_len), "--max-concurrency", str(args.concurrency),
                        "--ignore-eos", "--num-warmups", "2", "--save-result", "--result-dir", d,
                        "--result-filename", "r.json"], check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(d, "r.json")) as f:
            r = json.load(f)
    return {"output_tok_s": float(r["output_throughput"]), "req_s": float(r["request_throughput"])}


def _free_port() -> int:
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def _ab(configs: dict[str, list[str]], args) -> dict:
    """``llmserve bench serve`` against one server per config, configs alternating for
    ``args.rounds`` rounds (one server at a time); medians and the 1-minute load average
    at the start of each run. Also lists any ``llmserve-*`` socket dir a stopped server left."""
    import glob
    import statistics

    port = args.port or _free_port()
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    loads = []
    before = set(glob.glob("/tmp/llmserve-*"))
    for rnd in range(args.rounds):
        for name, extra in configs.items():
            proc = _start_server(args.model, port, extra)
            try:
                loads.append(round(os.getloadavg()[0], 1))
                runs[name].append(_bench(port, args))
            finally:
                _stop_server(proc)
            r = runs[name][-1]
            print(f"round {rnd} {name}: {r['output_tok_s']:.1f} output tok/s, {r['req_s']:.2f} req/s "
                  f"(load {loads[-1]})", flush=True)
    time.sleep(1)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("output_tok_s", "req_s")} for k, v in runs.items()}
    return {"runs": runs, "median": med, "loadavg_1m": loads,
            "socket_dirs_left": sorted(d for d in set(glob.glob("/tmp/llmserve-*")) - before
                                        if os.path.isdir(d))}  # other users' live servers show too


def dp_vs_threads(args) -> dict:
    """Output tok/s of DP=2 (1 thread per rank) and DP=1 (2 threads), alternating rounds."""
    out = _ab({"dp2x1": ["--data-parallel-size", "2", "--num-threads", "1"], "dp1x2": ["--num-threads", "2"]}, args)
    m = out["median"]
    out["ratio_dp2x1_over_dp1x2"] = m["dp2x1"]["output_tok_s"] / m["dp1x2"]["output_tok_s"]
    return out


def api_servers(args) -> dict:
    """Requests/s of 2 API servers vs 1 over the same engine, short outputs (front-end bound)."""
    out = _ab({"api2": ["--api-server-count", "2"], "api1": []}, args)
    m = out["median"]
    out["ratio_api2_over_api1_req_s"] = m["api2"]["req_s"] / m["api1"]["req_s"]
    return out


def kill_rank(args) -> dict:
    """SIGKILL rank 1 of a DP=2 AsyncLLM under ``concurrency`` streams; seconds from the kill
    until the last client had its answer or error; engine pids and socket dirs left."""
    import asyncio
    import signal

    from llmserve import AsyncEngineArgs, AsyncLLM, RequestOutputKind, SamplingParams
    from llmserve.engine.exceptions import EngineDeadError

    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(model=args.model, kv_cache_memory="256MiB", max_model_len=1024,
                                                    data_parallel_size=2, disable_log_stats=True))
    client = eng.engine_core
    pids = client.engine_pids
    dirs = [c.resources.tmpdir for c in client.cores]
    done_at: list[float] = []

    async def one(i: int) -> str:
        sp = SamplingParams(max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        try:
            async for _ in eng.generate(f"Tell a long story, number {i}.", sp, f"r{i}"):
                pass
            res = "finished"
        except EngineDeadError:
            res = "EngineDeadError"
        done_at.append(time.monotonic())
        return res

    async def run():
        tasks = [asyncio.create_task(one(i)) for i in range(args.concurrency)]
        await asyncio.sleep(5)
        t_kill = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        return results, max(done_at) - t_kill

    results, secs = asyncio.new_event_loop().run_until_complete(run())
    eng.shutdown()
    time.sleep(0.5)
    import psutil

    left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    return {"clients": len(results), "outcomes": {r: results.count(r) for r in set(results)},
            "last_answer_after_kill_s": round(secs, 3), "engine_pids_left": left,
            "socket_dirs_left": [d for d in dirs if os.path.exists(d)], "loadavg": os.getloadavg()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m llmserve.benchmarks.scaleout")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tp-equal", help="greedy tokens TP=2 == TP=1 (float32)")
    t.add_argument("--model", default="SmolLM2-135M-Instruct")
    t.add_argument("--backends", default="mp")
    t.add_argument("--prompts", type=int, default=16)
    t.add_argument("--tokens", type=int, default=32)
    d = sub.add_parser("dp-vs-threads", help="DP=2x1 thread vs DP=1x2 threads, bench serve")
    d.add_argument("--model", default="SmolLM2-135M-Instruct")
    d.add_argument("--port", type=int, default=0, help="0: a free port")
    d.add_argument("--rounds", type=int, default=2)
    d.add_argument("--concurrency", type=int, default=32)
    d.add_argument("--num-prompts", type=int, default=96)
    d.add_argument("--input-len", type=int, default=128)
    d.add_argument("--output-len", type=int, default=64)
    a = sub.add_parser("api-servers", help="--api-server-count 2 vs 1, short outputs, bench serve")
    a.add_argument("--model", default="SmolLM2-135M-Instruct")
    a.add_argument("--port", type=int, default=0, help="0: a free port")
    a.add_argument("--rounds", type=int, default=2)
    a.add_argument("--concurrency", type=int, default=64)
    a.add_argument("--num-prompts", type=int, default=256)
    a.add_argument("--input-len", type=int, default=32)
    a.add_argument("--output-len", type=int, default=4)
    k = sub.add_parser("kill-rank", help="SIGKILL one DP rank under load")
    k.add_argument("--model", default="SmolLM2-135M-Instruct")
    k.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args(argv)
    result = {"tp-equal": tp_equal, "dp-vs-threads": dp_vs_threads, "api-servers": api_servers,
              "kill-rank": kill_rank}[args.cmd](args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
