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


def test_zero_logprobs_offline_c38_and_truncation(llm_fp32):
    p = "Translate to French: good morning ->"
    out = llm_fp32.generate([p], SamplingParams(temperature=0, max_tokens=4, logprobs=0, prompt_logprobs=0),
                            use_tqdm=False)[0]
    gen = out.outputs[0]
    assert len(gen.logprobs) == len(gen.token_ids)
    assert all(t in d for t, d in zip(gen.token_ids, gen.logprobs))
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    assert all(t in d for t, d in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]))
    # vLLM's SamplingParams.truncate_prompt_tokens: the last N prompt tokens reach the model
    ids = llm_fp32.get_tokenizer().encode(p)
    cut = llm_fp32.generate([p], SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=3),
                            use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-3:]
    ref = llm_fp32.generate([TokensPrompt(prompt_token_ids=ids[-3:])], SamplingParams(temperature=0, max_tokens=2),
                            use_tqdm=False)[0]
    assert cut.outputs[0].token_ids == ref.outputs[0].token_ids


def test_max_tokens_zero_outputs_no_token(llm_fp32):
    """SamplingParams(max_tokens=0) offline (a prompt-scoring request): no token is
    output, finish_reason is "length", the prompt logprobs are there; the engine used to
    hand back the one token it samples after the prefill (1 token for a 0 budget)."""
    p = "Your answer: Yes"
    outs = llm_fp32.generate([p, p], [SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1, logprobs=1),
                                      SamplingParams(temperature=0, max_tokens=1)], use_tqdm=False)
    zero, one = outs[0].outputs[0], outs[1].outputs[0]
    assert (zero.token_ids, zero.text, zero.logprobs, zero.finish_reason) == ([], "", [], "length")
    assert len(outs[0].prompt_logprobs) == len(outs[0].prompt_token_ids)
    assert len(one.token_ids) == 1  # the same engine still answers a budget of 1
