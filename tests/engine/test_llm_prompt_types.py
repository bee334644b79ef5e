"""Offline LLM (issue 10 point 5): vLLM's TextPrompt/TokensPrompt importable from llmserve
and accepted by LLM.generate; use_tqdm may be a callable that builds the progress bar."""
from __future__ import annotations

import llmserve
from llmserve import SamplingParams, TextPrompt, TokensPrompt


def test_prompt_typeddicts_and_tqdm_callable(llm_fp32):
    assert {"TextPrompt", "TokensPrompt"} <= set(llmserve.__all__)
    tok = llm_fp32.get_tokenizer()
    text = "The capital of France is"
    ids = tok.encode(text)
    sp = SamplingParams(temperature=0, max_tokens=4)
    bars = []

    def make_bar(*args, **kwargs):
        from tqdm import tqdm

        bars.append(kwargs["total"])
        return tqdm(*args, **kwargs)

    outs = llm_fp32.generate([text, TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids)], sp,
                             use_tqdm=make_bar)
    assert bars == [3]
    assert [o.prompt_token_ids for o in outs] == [ids, ids, ids]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[0].outputs[0].text == " Paris.\n\n"
    assert (outs[1].prompt, outs[2].prompt) == (text, None)
