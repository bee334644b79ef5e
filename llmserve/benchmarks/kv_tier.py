"""The disk KV tier (issue 32, llmserve/kv_transfer): time to first token of a long prompt
computed cold, found in the RAM prefix cache, and loaded from disk by an engine started
again over the same tier; then a replay of a prefix set larger than the RAM cache, with
and without the tier.

    python -m llmserve.benchmarks.kv_tier --prompt-len 4000 --reps 3 --rounds 3
    python -m llmserve.benchmarks.kv_tier --replay-prompts 12 --replay-len 1000 \\
        --replay-kv-cache 64MiB     # 12,000 prompt tokens over ~2,800 tokens of RAM KV (bf16)

Each TTFT is one ``LLM.generate`` of ``max_tokens=1`` (the prefill and one sampled token),
in-process; cold prompts are distinct (no shared block), so each one prefills fully. Two
engines live side by side (A: warm RAM hits; B: started over A's tier, hits from disk) so
the warm/disk ratio comes from alternating pairs in one run (a loaded machine shifts both).
Prints one JSON line: medians (seconds), the ratios the issue asks for, cached tokens
seen, the bytes written, and ``uptime``'s load.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def _llm(args: argparse.Namespace, tier: str | None, **kw):
    from llmserve import LLM

    extra = {} if tier is None else {"kv_transfer_config": {
        "kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": tier}}}
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


def _flush(llm) -> None:
    """Wait for the in-process engine's tier writer."""
    llm.llm_engine.engine_core.engine_core.model_runner.kv_connector.flush()


def _tier_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def persistence(args: argparse.Namespace, tier: str) -> dict:
    """Cold TTFT of ``--reps`` distinct long prompts on engine A (which writes them to the
    tier); engine B started over the same tier (a restart: empty RAM prefix cache, fresh KV
    pages) serves each once (``restart_disk``: the first hit after the restart); then
    ``--rounds`` alternating A/B rounds per prompt: A's warm RAM hit against B's hit loaded
    from disk again (B's RAM prefix cache reset before each), order swapped every other
    pair, ``disk_over_warm`` the median of the per-pair ratios."""
    prompts = _prompts(args.reps, args.prompt_len, args.seed)
    a = _llm(args, tier)
    _ttft(a, _prompts(1, 64, args.seed + 1)[0])  # warm the kernels
    cold = _phase(a, prompts)
    t0 = time.perf_counter()
    _flush(a)  # the cold prompts' blocks written (the writer thread shares the cores)
    flush_s = time.perf_counter() - t0
    written = _tier_bytes(tier)
    b = _llm(args, tier)  # a second engine: its RAM prefix cache is empty
    _ttft(b, _prompts(1, 64, args.seed + 2)[0])
    restart = _phase(b, prompts)
    warm, disk, ratios = [], [], []
    for r in range(args.rounds):
        for i, p in enumerate(prompts):
            pair = {}
            for side in (("warm", "disk") if (r + i) % 2 == 0 else ("disk", "warm")):
                if side == "disk":
                    b.reset_prefix_cache()
                pair[side] = _ttft(a if side == "warm" else b, p)
            warm.append(pair["warm"])
            disk.append(pair["disk"])
            ratios.append(pair["disk"][0] / pair["warm"][0])
    a.shutdown()
    b.shutdown()
    med = lambda runs: round(statistics.median(t for t, _ in runs), 4)
    return {"prompt_len": args.prompt_len, "cold": cold, "restart_disk": restart,
            "warm_ram_ttft_s": med(warm), "disk_ttft_s": med(disk),
            "cached_tokens": {"warm": sorted({c for _, c in warm}), "disk": sorted({c for _, c in disk})},
            "disk_over_warm": round(statistics.median(ratios), 3),
            "restart_over_warm": round(restart["ttft_s"] / med(warm), 3),
            "disk_over_cold": round(med(disk) / cold["ttft_s"], 3),
            "restart_over_cold": round(restart["ttft_s"] / cold["ttft_s"], 3), "tier_bytes": written,
            "writes_pending_after_cold_s": round(flush_s, 3)}


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--prompt-len", type=int, default=4000)
    p.add_argument("--reps", type=int, default=3, help="distinct long prompts")
    p.add_argument("--rounds", type=int, default=3, help="alternating warm/disk rounds over the prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay-prompts", type=int, default=0, help="0: no replay phase")
    p.add_argument("--replay-len", type=int, default=1000)
    p.add_argument("--replay-kv-cache", default="64MiB")
    args = p.parse_args(argv)
    result: dict = {"uptime_before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    with tempfile.TemporaryDirectory(prefix="kv_tier_") as tier:
        result["persistence"] = persistence(args, tier)
    if args.replay_prompts:
        with tempfile.TemporaryDirectory(prefix="kv_tier_replay_") as tier:
            result["replay_with_tier"] = replay(args, tier)
        result["replay_without_tier"] = replay(args, None)
    result["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
