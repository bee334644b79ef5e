"""The CPU cost of request timelines (issue 33), without a model: the front end's
``OutputProcessor.process_outputs`` over a step's outputs, and the scheduler's
``schedule`` + ``update_from_output`` with stats (the timeline's events) on, each with
timelines on and off, in microseconds per engine step at ``--batch`` running requests.
Alternates on/off ``--rounds`` times and reports medians (a shared machine's load drifts).

    python -m llmserve.benchmarks.timeline_cost --batch 32 --steps 64 --rounds 5
"""
from __future__ import annotations

import argparse
import statistics
import time

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.outputs import EngineCoreOutput, ModelRunnerOutput
from llmserve.core.request import Request
from llmserve.core.scheduler import Scheduler
from llmserve.engine.output_processor import OutputProcessor
from llmserve.engine.request_timeline import RequestTimelines
from llmserve.sampling_params import RequestOutputKind, SamplingParams


def _frontend_us(tokenizer, batch: int, steps: int, timelines: bool) -> float:
    """Microseconds per step of process_outputs for ``batch`` decoding requests."""
    op = OutputProcessor(tokenizer, log_stats=True)
    if timelines:
        op.timelines = RequestTimelines()
    params = SamplingParams(max_tokens=steps + 1, output_kind=RequestOutputKind.DELTA)
    for i in range(batch):
        op.add_request(f"r{i}", None, [1, 2, 3, 4], params, time.time())
    outs = [[EngineCoreOutput(f"r{i}", [100 + (s % 50)]) for i in range(batch)] for s in range(steps)]
    t0 = time.perf_counter()
    for s in range(steps):
        op.process_outputs(outs[s], time.monotonic())
    return (time.perf_counter() - t0) / steps * 1e6


def _scheduler_us(batch: int, steps: int, log_stats: bool) -> float:
    """Microseconds per step of schedule + update_from_output (no model)."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=batch, max_model_len=4096),
                  CacheConfig(block_size=16), 4096)
    for i in range(batch):
        s.add_request(Request(f"r{i}", list(range(1, 65)), SamplingParams(max_tokens=steps + 1, ignore_eos=True), 0,
                              log_stats=log_stats))
    t0 = time.perf_counter()
    for _ in range(steps):
        so = s.schedule()
        s.update_from_output(so, ModelRunnerOutput(sampled_token_ids={x.request.request_id: 7 for x in so.scheduled}))
    return (time.perf_counter() - t0) / steps * 1e6


def main(args: argparse.Namespace) -> dict:
    """Run the rounds; prints and returns the medians (us per step) and the differences."""
    from llmserve.tokenizer import get_tokenizer

    tok = get_tokenizer(args.tokenizer)
    res: dict[str, list[float]] = {"frontend_off": [], "frontend_on": [], "scheduler_off": [], "scheduler_on": []}
    for _ in range(args.rounds):
        for on in (False, True):
            res[f"frontend_{'on' if on else 'off'}"].append(_frontend_us(tok, args.batch, args.steps, on))
            res[f"scheduler_{'on' if on else 'off'}"].append(_scheduler_us(args.batch, args.steps, on))
    med = {k: statistics.median(v) for k, v in res.items()}
    for part in ("frontend", "scheduler"):
        print(f"{part:<9} off {med[part + '_off']:9.1f} us/step  on {med[part + '_on']:9.1f} us/step  "
              f"(+{med[part + '_on'] - med[part + '_off']:.1f} us per step of {args.batch} requests)")
    return med


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokenizer", default="SmolLM2-135M-Instruct")
    main(p.parse_args())
