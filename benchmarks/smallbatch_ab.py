"""A/B of an environment switch on `llmserve bench latency` (batch 1) and
`llmserve bench throughput`, alternating rounds in one run, medians reported with the load
average beside each figure (issue 16: the machine is shared, so only side-by-side ratios
mean something).

    python benchmarks/smallbatch_ab.py --rounds 3 --env LLMSERVE_PACKED_WEIGHTS=0 \
        [--skip-throughput] [--latency-args "..."] [--throughput-args "..."]

A = the current environment, B = with ``--env`` set. Prints one line per round and the
medians and B/A ratios at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile


def _run(kind: str, extra: str, env: dict) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "bench", kind, "--output-json", path,
           *shlex.split(extra)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(path) as f:
        out = json.load(f)
    os.unlink(path)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--env", required=True, help="NAME=VALUE set for the B runs")
    p.add_argument("--latency-args", default="--num-iters 3 --num-iters-warmup 1 --temperature 0 "
                                              "--output-len 64 --ceiling-iters 1 --kv-cache-memory 256MiB")
    p.add_argument("--throughput-args", default="--num-prompts 64 --input-len 128 --output-len 128 "
                                                 "--kv-cache-memory 1GiB --temperature 0 --ceiling-tokens-per-step")
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args()
    name, _, value = args.env.partition("=")
    envs = {"A": dict(os.environ), "B": {**os.environ, name: value}}
    res: dict[str, dict[str, list[float]]] = {k: {"tpot_ms": [], "tok_s": []} for k in envs}
    for r in range(args.rounds):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")
        for k in order:
            lat = _run("latency", args.latency_args, envs[k])
            res[k]["tpot_ms"].append(lat["decode_time_per_token_s"] * 1e3)
            line = f"round {r} {k}: batch-1 decode {res[k]['tpot_ms'][-1]:.2f} ms/token"
            if not args.skip_throughput:
                thr = _run("throughput", args.throughput_args, envs[k])
                tok_s = thr["llmserve"]["output_tokens_per_s"]
                res[k]["tok_s"].append(float(tok_s))
                line += f", throughput {tok_s:.1f} out tok/s"
            print(f"{line}  (load {os.getloadavg()[0]:.1f})", flush=True)
    for metric in ("tpot_ms", "tok_s"):
        if res["A"][metric]:
            a, b = statistics.median(res["A"][metric]), statistics.median(res["B"][metric])
            print(f"median {metric}: A {a:.2f}  B({args.env}) {b:.2f}  B/A {b / a:.3f}")
    print(f"load average now: {os.getloadavg()}")


if __name__ == "__main__":
    main()
