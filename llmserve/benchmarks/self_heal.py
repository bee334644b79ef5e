"""Measure the self-healing engine (issue 17 point 5) against a running ``llmserve serve``.

For each of ``--rounds`` rounds: run ``--streams`` concurrent greedy (temperature 0)
streaming completions, SIGKILL the server's EngineCore once every stream has at least
``--kill-after`` chunks, and check that every stream completes with the text of an
undisturbed run (made first, same prompts) and the expected number of tokens (no
duplicated or missing token). Reports the time to recover per kill: from the SIGKILL to
the first chunk any stream receives afterwards.

``--signal stop`` SIGSTOPs the engine instead (a stall): the server must detect it after
``--engine-stall-timeout`` (start it with a small one, e.g. 3 s), kill and restart the
engine and resume the streams the same way; the recovery time then includes that timeout.

    python -m llmserve.benchmarks.self_heal --base-url http://127.0.0.1:8000 --server-pid PID
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import psutil

PROMPTS = ["The history of Rome", "Water boils at", "A short poem about the sea:", "The best way to learn",
           "Once upon a time", "The capital of France is", "In computer science, a hash table",
           "My favourite recipe is", "The moon landing in 1969", "Photosynthesis is the process",
           "A good night's sleep", "The rules of chess", "Volcanoes form when", "The internet was invented",
           "Bicycles are", "Music theory explains"]


def engine_pid(server_pid: int) -> int:
    """The pid of the (one live) EngineCore process under the server ``server_pid``."""
    kids = [p for p in psutil.Process(server_pid).children(recursive=True)
            if "llmserve.engine.core" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE]
    if len(kids) != 1:
        raise RuntimeError(f"expected one engine process, found {kids}")
    return kids[0].pid


async def run_round(client, model: str, n: int, max_tokens: int, kill: bool, kill_after: int,
                    server_pid: int, sig: str = "kill") -> tuple[list, list, float | None]:
    """Run ``n`` streams (killing the engine mid-way if ``kill``); returns the texts, the
    token counts and the recovery time in seconds (None without a kill)."""
    progress = [0] * n
    last_chunk = [0.0]
    kill_t: list = []

    async def one(i: int):
        parts, ntok = [], 0
        stream = await client.completions.create(model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        async for chunk in stream:
            now = time.monotonic()
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                progress[i] += 1
                if kill_t and len(kill_t) == 1:
                    kill_t.append(now)  # the first chunk after the kill
            if chunk.usage is not None:
                ntok = chunk.usage.completion_tokens
            last_chunk[0] = now
        return "".join(parts), ntok

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    if kill:
        while min(progress) < kill_after:
            await asyncio.sleep(0.005)
        pid = engine_pid(server_pid)
        kill_t.append(time.monotonic())
        if sig == "stop":
            psutil.Process(pid).suspend()  # SIGSTOP: the process lives but makes no progress
        else:
            psutil.Process(pid).kill()
    results = await asyncio.gather(*tasks)
    recovery = kill_t[1] - kill_t[0] if len(kill_t) == 2 else None
    return [r[0] for r in results], [r[1] for r in results], recovery


async def main_async(args: argparse.Namespace) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=args.base_url + "/v1", api_key=args.api_key, max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    ref, ref_ntok, _ = await run_round(client, model, args.streams, args.max_tokens, False, 0, args.server_pid)
    rounds = []
    for r in range(args.rounds):
        texts, ntok, recovery = await run_round(client, model, args.streams, args.max_tokens, True, args.kill_after,
                                                args.server_pid, args.signal)
        identical = sum(t == rt for t, rt in zip(texts, ref))
        rounds.append({"round": r, "signal": args.signal, "identical": identical, "streams": args.streams, "recovery_s": recovery,
                       "tokens_ok": all(k == args.max_tokens for k in ntok)})
        print(json.dumps(rounds[-1]), flush=True)
    rec = [x["recovery_s"] for x in rounds if x["recovery_s"] is not None]
    return {"rounds": rounds, "all_identical": all(x["identical"] == args.streams for x in rounds),
            "all_tokens_ok": all(x["tokens_ok"] for x in rounds) and all(k == args.max_tokens for k in ref_ntok),
            "recovery_median_s": statistics.median(rec) if rec else None, "recovery_max_s": max(rec) if rec else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--server-pid", type=int, required=True)
    p.add_argument("--api-key", default="none")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--signal", choices=("kill", "stop"), default="kill",
                   help="SIGKILL the engine (a crash) or SIGSTOP it (a stall)")
    p.add_argument("--kill-after", type=int, default=8, help="chunks every stream has before the SIGKILL")
    print(json.dumps(asyncio.run(main_async(p.parse_args())), indent=1))


if __name__ == "__main__":
    main()
