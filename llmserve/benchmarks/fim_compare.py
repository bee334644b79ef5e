"""FIM prompts side by side with llama.cpp's ``llama-server`` (issue 27):
``python -m llmserve.benchmarks.fim_compare --llama-url URL --llmserve-url URL --model DIR``.

Both servers get the same inputs: ``/infill`` (``input_prefix``, ``input_suffix``,
``input_extra``, ``prompt``) on both, and ``suffix`` on llmserve's ``/v1/completions``
(llama-server refuses ``suffix`` there; its /infill with ``input_prefix`` = the prompt is the
reference). llama-server reports the prompt it built as text (its ``prompt`` field, the
prompt tokens detokenized with special tokens) and its length (``tokens_evaluated``);
llmserve's prompt ids are turned into text by llama-server's own ``/detokenize``, so both
sides are rendered by one vocabulary. Reports, per case, whether the lengths and the
texts agree.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

import requests

CASES: list[dict[str, Any]] = [
    {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n    return c\n"},
    {"input_prefix": "def add(a, b):\n", "input_suffix": "\n# <|fim_middle|> stays text\n", "prompt": "    c ="},
    {"input_prefix": "import os\n", "input_suffix": "", "prompt": ""},
    {"input_prefix": "x = 1\n", "input_suffix": "print(x)\n",
     "input_extra": [{"filename": "util.py", "text": "def mul(a, b):\n    return a * b\n"},
                     {"filename": "b.py", "text": "X = 1\n"}]},
    {"input_prefix": "class A:\n" * 40, "input_suffix": "    pass\n" * 40, "prompt": "  "},
]


def _post(url: str, path: str, body: dict, key: str = "") -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = requests.post(url.rstrip("/") + path, json=body, headers=headers, timeout=120)
    r.raise_for_status()
    return r.json()


def llama_prompt(url: str, case: dict) -> tuple[str, int]:
    """llama-server's infill prompt as text (special tokens written out) and its length."""
    out = _post(url, "/infill", {**case, "n_predict": 1, "temperature": 0, "cache_prompt": False})
    return out["prompt"], out["tokens_evaluated"]


def llmserve_ids(url: str, model: str, case: dict, key: str) -> list[int]:
    """The prompt ids llmserve builds: /v1/completions with ``suffix`` when the case fits
    it (no extra chunks, no prompt), else the same layout through /infill's own builder."""
    if not case.get("input_extra") and not case.get("prompt") and case["input_suffix"]:
        out = _post(url, "/v1/completions", {"model": model, "prompt": case["input_prefix"],
                                             "suffix": case["input_suffix"], "max_tokens": 1,
                                             "return_token_ids": True, "temperature": 0}, key)
        return out["choices"][0]["prompt_token_ids"] if "prompt_token_ids" in out["choices"][0] else \
            out["prompt_token_ids"]
    return _infill_ids_offline(model, case)


def _infill_ids_offline(model: str, case: dict) -> list[int]:
    from llmserve.entrypoints.openai.infill.fim import find_fim_tokens, infill_prompt
    from llmserve.entrypoints.openai.infill.protocol import InfillRequest
    from llmserve.tokenizer import get_tokenizer

    tok = get_tokenizer(model)
    req = InfillRequest(**case)
    ids = infill_prompt(tok, find_fim_tokens(tok), req.input_prefix, req.input_suffix, req.extra_chunks(),
                        req.prompt, 4096)
    return list(ids.token_ids if hasattr(ids, "token_ids") else ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-url", required=True)
    p.add_argument("--llmserve-url", required=True)
    p.add_argument("--model", required=True, help="the HF directory llmserve serves (its served name too)")
    p.add_argument("--api-key", default="")
    args = p.parse_args()
    agree = 0
    for i, case in enumerate(CASES):
        text, n = llama_prompt(args.llama_url, case)
        ids = llmserve_ids(args.llmserve_url, args.model, case, args.api_key)
        ours = _post(args.llama_url, "/detokenize", {"tokens": ids})["content"]
        served = _post(args.llmserve_url, "/infill", {**case, "n_predict": 1, "temperature": 0},
                       args.api_key)["tokens_evaluated"]  # llmserve's /infill builds the same length
        same = len(ids) == n == served and ours == text
        agree += same
        print(json.dumps({"case": i, "llama_tokens": n, "llmserve_tokens": len(ids), "same_text": ours == text,
                          "agree": same}))
        if not same:
            print("  llama:   ", repr(text[:300]))
            print("  llmserve:", repr(ours[:300]))
    print(f"{agree}/{len(CASES)} cases build the same prompt")


if __name__ == "__main__":
    main()
