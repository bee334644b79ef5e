"""Cases C53 (``LLM.chat`` over a list of conversations) and C54 (one SamplingParams per
prompt, length checks, ``use_tqdm`` callable) from shared/cases.md, offline in float32."""
from __future__ import annotations

import pytest

from llmserve import SamplingParams

C1 = [{"role": "user", "content": "Name a planet."}]
C2 = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Say thank you."}]
C3 = [{"role": "user", "content": "Count to three."}]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n)


def test_chat_batch_of_conversations_c53(llm_fp32):
    sp = _greedy(12)
    alone = [llm_fp32.chat(c, sp, use_tqdm=False)[0] for c in (C1, C2, C3)]
    batch = llm_fp32.chat([C1, C2, C3], sp, use_tqdm=False)
    assert len(batch) == 3  # A1: input order, same text and prompt ids as one by one
    for a, b in zip(alone, batch):
        assert (b.outputs[0].text, b.prompt_token_ids) == (a.outputs[0].text, a.prompt_token_ids)
    per = llm_fp32.chat([C1, C2, C3], [_greedy(3), _greedy(7), _greedy(1)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in per] == [3, 7, 1]  # A2
    one = llm_fp32.chat([C1], sp, use_tqdm=False)
    assert len(one) == 1 and one[0].outputs[0].text == alone[0].outputs[0].text  # A3
    cont = llm_fp32.chat([C1 + [{"role": "assistant", "content": "The planet is"}]], sp, use_tqdm=False,
                         add_generation_prompt=False, continue_final_message=True)[0]
    assert not cont.outputs[0].text.lstrip().startswith("The planet is")  # A4: continues the prefill
    prompt = llm_fp32.get_tokenizer().decode(cont.prompt_token_ids)
    assert prompt.rstrip().endswith("The planet is")


PROMPTS = ["The capital of France is", "1, 2, 3,", "Roses are red,"]
PARAMS = [SamplingParams(temperature=0, max_tokens=2),
          SamplingParams(temperature=0, max_tokens=5, stop=[","]),
          SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True)]


def test_per_prompt_params_follow_each_prompt_c54(llm_fp32):
    outs = llm_fp32.generate(PROMPTS, PARAMS, use_tqdm=False)
    alone = [llm_fp32.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(PROMPTS, PARAMS)]
    assert [o.prompt for o in outs] == PROMPTS  # A1: prompt order, each with its own params
    assert len(outs[0].outputs[0].token_ids) == 2
    assert outs[1].outputs[0].finish_reason == "stop" and "," not in outs[1].outputs[0].text
    assert len(outs[2].outputs[0].token_ids) == 9
    assert [o.outputs[0].text for o in outs] == [a.outputs[0].text for a in alone]


@pytest.mark.parametrize("n", [2, 4, 0])
def test_params_list_of_wrong_length_raises_before_work_c54(llm_fp32, n):
    sps = [_greedy(2)] * n
    with pytest.raises(ValueError, match="lengths of prompts and params must be the same"):
        llm_fp32.generate(PROMPTS, sps, use_tqdm=False)
    assert not llm_fp32.llm_engine.has_unfinished_requests()  # A2: nothing was submitted


def test_token_prompt_equals_text_prompt_and_tqdm_off_is_silent_c54(llm_fp32, capfd):
    ids = llm_fp32.get_tokenizer().encode("The capital of France is")
    a = llm_fp32.generate([{"prompt_token_ids": ids}], _greedy(4), use_tqdm=False)[0]
    b = llm_fp32.generate(["The capital of France is"], _greedy(4), use_tqdm=False)[0]
    assert (a.outputs[0].text, a.prompt_token_ids) == (b.outputs[0].text, b.prompt_token_ids)  # A3
    assert capfd.readouterr().err == ""  # A4: use_tqdm=False writes nothing
    calls = []

    def factory(*args, **kwargs):
        from tqdm import tqdm

        calls.append(kwargs)
        return tqdm(*args, **kwargs)

    llm_fp32.generate(PROMPTS[:2], _greedy(2), use_tqdm=factory)
    assert calls  # the callable built the bar
