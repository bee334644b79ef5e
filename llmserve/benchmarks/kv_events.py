"""What ``--kv-events-config`` costs, and what it sends, on a multi-turn workload:

    python -m llmserve.benchmarks.kv_events [--model SmolLM2-135M-Instruct]
        [--conversations 50] [--turns 4] [--max-tokens 16] [--rounds 2]
        [--kv-cache-memory 48MiB] [--max-model-len 1024]

Each round runs the same trace (``conversations`` x ``turns`` requests, each turn's
prompt extending the last; a KV cache small enough to evict) offline in-process twice,
with events off and on (order alternating between rounds), and times the ``generate``
calls (wall and process CPU seconds, one torch thread: on a shared machine the CPU time
is the steadier figure). With events on, a subscriber that knows nothing of llmserve's types (raw msgpack:
``[ts, [[tag, ...], ...], rank]``, vLLM's array layout) counts every batch and event by
tag, fetches any batches it missed from the replay socket (seq_gaps: gaps left after
that, 0 when every batch was decoded), and sums the payload bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time
from collections import Counter
from typing import Any, Optional

import msgspec
import zmq


def token_trace(conversations: int, turns: int, seed: int = 0, first: tuple[int, int] = (60, 160),
                turn: tuple[int, int] = (20, 60)) -> list[list[list[int]]]:
    """Per conversation, its turns' prompt token ids (each extends the previous): a first
    message of ``first`` tokens (range, half-open) and ``turn`` more tokens a turn."""
    rng = random.Random(seed)
    out = []
    for _ in range(conversations):
        ids = [rng.randrange(1000, 30000) for _ in range(rng.randrange(*first))]
        turns_ids = []
        for _ in range(turns):
            ids = ids + [rng.randrange(1000, 30000) for _ in range(rng.randrange(*turn))]
            turns_ids.append(list(ids))
        out.append(turns_ids)
    return out


class RawCounter:
    """A SUB socket reading batches as plain msgpack (no schema types); a gap (the first
    batches sent before the subscription took hold) is fetched from the replay socket."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self.replay_endpoint = replay_endpoint
        self.replayed = 0
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.events: Counter = Counter()
        self.batches, self.bytes, self.gaps, self.last_seq = 0, 0, 0, -1
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            _, seq_bytes, payload = self.sock.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last_seq + 1:
                self._replay(seq)
            self.gaps += seq != self.last_seq + 1
            self._count(seq, payload)

    def _count(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        ts, events, *rank = msgspec.msgpack.decode(payload)
        self.events.update(ev[0] for ev in events)
        self.batches += 1
        self.bytes += len(payload)

    def _replay(self, until: int) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        sock.send_multipart([b"", (self.last_seq + 1).to_bytes(8, "big")])
        while sock.poll(5000):
            _, seq_bytes, payload = sock.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if not payload or seq >= until:
                break
            self._count(seq, payload)
            self.replayed += 1
        sock.close(linger=0)

    def close(self) -> None:
        time.sleep(0.5)  # the publisher thread sends the last batches
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)
        self.ctx.term()


def _run(model: str, trace: list[list[list[int]]], max_tokens: int, kv: str, max_model_len: int,
         events: bool) -> dict[str, Any]:
    from llmserve import LLM, SamplingParams

    folder = tempfile.mkdtemp(prefix="kvev-")
    endpoint, replay = f"ipc://{folder}/ev", f"ipc://{folder}/replay"
    counter = RawCounter(endpoint, replay) if events else None
    kwargs = {"kv_events_config": {"enable_kv_cache_events": True, "endpoint": endpoint,
                                   "replay_endpoint": replay}} if events else {}
    llm = LLM(model, multiprocess_mode=False, kv_cache_memory=kv, max_model_len=max_model_len, num_threads=1,
              **kwargs)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        for turn in range(len(trace[0])):
            llm.generate([{"prompt_token_ids": c[turn]} for c in trace], params, use_tqdm=False)
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        cached = len(llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.pool.cached)
    finally:
        llm.llm_engine.shutdown()
    out: dict[str, Any] = {"generate_s": round(secs, 2), "cpu_s": round(cpu, 2), "blocks_cached_at_end": cached}
    if counter is not None:
        counter.close()
        out.update(batches=counter.batches, replayed=counter.replayed, seq_gaps=counter.gaps, events=dict(counter.events),
                   payload_bytes=counter.bytes)
    return out


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--conversations", type=int, default=50)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-cache-memory", default="48MiB")
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args(argv)
    trace = token_trace(args.conversations, args.turns)
    runs: dict[str, list] = {"off": [], "on": []}
    for r in range(args.rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            res = _run(args.model, trace, args.max_tokens, args.kv_cache_memory, args.max_model_len, mode == "on")
            res["loadavg"] = os.getloadavg()
            runs[mode].append(res)
            print(json.dumps({mode: res}), flush=True)
    result: dict[str, Any] = {"requests": args.conversations * args.turns, "runs": runs}
    for key in ("generate_s", "cpu_s"):
        off = sorted(x[key] for x in runs["off"])[len(runs["off"]) // 2]
        on = sorted(x[key] for x in runs["on"])[len(runs["on"]) // 2]
        result[f"median_{key}"] = {"off": off, "on": on, "on_vs_off": round(on / off, 3)}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    return result


if __name__ == "__main__":
    main()
