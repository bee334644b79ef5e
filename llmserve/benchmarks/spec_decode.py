"""n-gram speculative decoding: TPOT with and without it, same run, one request at a time.

    llmserve bench spec-decode --workload edit --num-prompts 9 --max-tokens 160
    llmserve bench spec-decode --workload chat --num-prompts 8 --max-tokens 128
    llmserve bench spec-decode --cost            # the per-token verify cost (adaptive.py)

Two in-process engines on the same model (``--speculative-config`` on one, off on the
other) take each prompt in turn, alternating which goes first, so load drift hits both
alike. Per request TPOT = (last token time - first token time) / (tokens - 1). Prints one
JSON line: median TPOT of each, their ratio, the acceptance counts (vLLM's
spec_decode_num_drafts / num_draft_tokens / num_accepted_tokens, mean accepted length per
draft), and how many outputs differ (greedy: 0 expected with ``--batch-invariant``).

``--cost`` forces drafts of k = 1..5 tokens that are always rejected and reports each
TPOT over the no-speculation TPOT: the cost of verifying k more tokens per step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Optional

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--workload", choices=["edit", "chat"], default="edit")
    parser.add_argument("--num-prompts", type=int, default=9)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--speculative-config", default=DEFAULT_SPEC)
    parser.add_argument("--batch-invariant", action="store_true",
                        help="Row-invariant GEMMs on both engines (greedy outputs then equal token for token).")
    parser.add_argument("--cost", action="store_true", help="Measure the verify cost of k forced, rejected drafts.")
    parser.add_argument("--num-threads", type=int, default=None)


def _llm(args: argparse.Namespace, spec: Optional[str]):
    from llmserve import LLM

    return LLM(args.model, dtype=args.dtype, multiprocess_mode=False, kv_cache_memory="256MiB", max_model_len=2048,
               batch_invariant=args.batch_invariant, speculative_config=spec, num_threads=args.num_threads)


def _one(llm, messages, sp) -> tuple[float, tuple[int, ...]]:
    """TPOT (seconds) of one chat request alone, and its token ids."""
    out = llm.chat([messages], sp, use_tqdm=False)[0]
    m, toks = out.metrics, out.outputs[0].token_ids
    if m is None or m.first_token_time is None or len(toks) < 2:
        return float("nan"), tuple(toks)
    last = m.last_token_time or m.finished_time
    return (last - m.first_token_time) / (len(toks) - 1), tuple(toks)


def _spec_totals(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.spec.totals


def _compare(args: argparse.Namespace, base, spec, sp) -> dict:
    from llmserve.benchmarks.spec_datasets import WORKLOADS

    msgs = WORKLOADS[args.workload](args.num_prompts)
    _one(base, msgs[0], sp), _one(spec, msgs[0], sp)  # warm-up
    t0 = _spec_totals(spec)
    d0, dt0, a0 = t0.num_drafts, t0.num_draft_tokens, t0.num_accepted_tokens
    tb, ts, differ = [], [], 0
    for i, m in enumerate(msgs):
        pair = [(base, tb), (spec, ts)]
        outs = []
        for llm, acc in (pair if i % 2 == 0 else pair[::-1]):
            tpot, toks = _one(llm, m, sp)
            acc.append(tpot)
            outs.append(toks)
        differ += outs[0] != outs[1]
    t = _spec_totals(spec)
    drafts, dtoks, acc = t.num_drafts - d0, t.num_draft_tokens - dt0, t.num_accepted_tokens - a0
    mb, ms = statistics.median(tb), statistics.median(ts)
    return {"workload": args.workload, "num_prompts": len(msgs), "max_tokens": args.max_tokens,
            "tpot_ms_no_spec": round(mb * 1e3, 2), "tpot_ms_spec": round(ms * 1e3, 2),
            "speedup": round(mb / ms, 3), "num_drafts": drafts, "num_draft_tokens": dtoks,
            "num_accepted_tokens": acc, "acceptance_rate": round(acc / dtoks, 3) if dtoks else None,
            "mean_accepted_per_draft": round(acc / drafts, 2) if drafts else None,
            "outputs_differ": differ, "load": os.getloadavg()[0]}


def _cost(args: argparse.Namespace, base, spec, sp) -> dict:
    """Forced, always-rejected drafts of k tokens: TPOT(k) / TPOT(no spec), each the
    minimum over rounds (k interleaved within a round), so other load on the machine
    inflates the ratios less than medians would."""
    from llmserve.benchmarks.spec_datasets import WORKLOADS
    from llmserve.spec_decode import scheduling

    msgs = WORKLOADS["chat"](2)
    junk = base.get_tokenizer().vocab_size - 1
    orig = scheduling.SpecDecodeScheduler.propose
    best: dict[int, float] = {}
    try:
        for _ in range(3):
            for k in range(0, 6):
                scheduling.SpecDecodeScheduler.propose = lambda self, req, m, b, k=k: [junk] * min(k, m)
                for m in msgs:
                    tpot, _ = _one(spec if k else base, m, sp)
                    best[k] = min(best.get(k, tpot), tpot)
    finally:
        scheduling.SpecDecodeScheduler.propose = orig
    ratios = {k: round(best[k] / best[0], 3) for k in range(1, 6)}
    per_token = [(r - 1) / k for k, r in ratios.items()]
    return {"tpot_ms_no_spec": round(best[0] * 1e3, 2), "tpot_ratio_by_k": ratios,
            "cost_per_token": round(statistics.median(per_token), 3), "load": os.getloadavg()[0]}


def main(args: argparse.Namespace) -> dict:
    from llmserve import SamplingParams

    spec_cfg = args.speculative_config
    if args.cost:  # the forced drafts must not be cut by the adaptive length
        cfg = json.loads(spec_cfg)
        cfg["num_speculative_tokens"] = 5
        spec_cfg = json.dumps(cfg)
    base, spec = _llm(args, None), _llm(args, spec_cfg)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t = time.time()
    result = _cost(args, base, spec, sp) if args.cost else _compare(args, base, spec, sp)
    result["seconds"] = round(time.time() - t, 1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cli_args(p)
    main(p.parse_args())
