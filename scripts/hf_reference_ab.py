"""A/B seconds of the HF greedy reference of tests/conftest.py PROMPTS (32 new tokens):
one prompt at a time (before) vs one left-padded batch (tests/conftest.py ``hf_greedy``),
alternating rounds in one process; checks both give the same tokens.

    PYTHONPATH=$PWD python scripts/hf_reference_ab.py [ROUNDS]
"""
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from llmserve.model_loader import resolve_model
from llmserve.tokenizer import get_tokenizer
from tests.conftest import PROMPTS


def one_by_one(model, tok) -> dict:
    res = {}
    for p in PROMPTS:
        ids = tok.encode(p)
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=32, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.eos_token_id)
        res[p] = out[0, len(ids):].tolist()
    return res


def batched(model, tok) -> dict:
    pad = tok.eos_token_id
    enc = [tok.encode(p) for p in PROMPTS]
    width = max(map(len, enc))
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                         eos_token_id=pad, pad_token_id=pad)
    return {p: (r[:r.index(pad) + 1] if pad in r else r) for p, r in zip(PROMPTS, out[:, width:].tolist())}


def main(rounds: int) -> None:
    sm = resolve_model("SmolLM2-135M-Instruct")
    model = AutoModelForCausalLM.from_pretrained(sm.path, gguf_file=sm.gguf_file, dtype=torch.float32).eval()
    tok = get_tokenizer("SmolLM2-135M-Instruct")
    times: dict = {"one_by_one": [], "batched": []}
    with torch.inference_mode():
        for i in range(rounds):
            for name, fn in (("one_by_one", one_by_one), ("batched", batched)):
                t = time.perf_counter()
                res = fn(model, tok)
                times[name].append(time.perf_counter() - t)
                if name == "one_by_one":
                    ref = res
                else:
                    assert res == ref, "batched reference differs from one at a time"
            print(f"round {i + 1}: one_by_one {times['one_by_one'][-1]:.1f} s, batched {times['batched'][-1]:.1f} s",
                  flush=True)
    a, b = statistics.median(times["one_by_one"]), statistics.median(times["batched"])
    print(f"median: one_by_one {a:.1f} s, batched {b:.1f} s, saved {a - b:.1f} s, ratio {a / b:.1f}x; same tokens")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
