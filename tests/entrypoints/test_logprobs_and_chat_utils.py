"""Logprob formatting (finite numbers, token strings, byte tokens, shapes) and chat-template
rendering, on the real SmolLM2 tokenizer."""
from __future__ import annotations

import json

import pytest

from llmserve.entrypoints.chat_utils import render_chat_prompt
from llmserve.entrypoints.openai.logprobs import (
    MIN_LOGPROB,
    TokenFormatter,
    build_chat_logprobs,
    build_completion_logprobs,
    finite_logprob,
)
from llmserve.outputs import Logprob
from llmserve.sampling_params import SamplingParamsError


def test_finite_logprob():
    assert finite_logprob(float("-inf")) == MIN_LOGPROB == -9999.0
    assert finite_logprob(float("nan")) == MIN_LOGPROB
    assert finite_logprob(-1e9) == MIN_LOGPROB
    assert finite_logprob(-0.25) == -0.25


def test_token_formatter_text_and_bytes(smol_tokenizer):
    fmt = TokenFormatter(smol_tokenizer)
    ids = smol_tokenizer.encode("Hello world", add_special_tokens=False)
    assert [fmt.text(i) for i in ids] == ["Hello", " world"]
    eos = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert fmt.text(eos) == "<|im_end|>"
    # a character split over several byte tokens: the pieces are written as bytes:\x..,
    # and their raw bytes add up to the character's UTF-8
    text = "\U0001f600"
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    raw = b"".join(bytes(fmt.raw_bytes(i)) for i in ids)
    assert raw == text.encode("utf-8")
    assert len(ids) == 3 and [fmt.text(i) for i in ids] == ["bytes:\\xf0\\x9f", "bytes:\\x98", "bytes:\\x80"]
    # "日本": two tokens hold parts of 日, the third is 本 whole
    ids = smol_tokenizer.encode("日本", add_special_tokens=False)
    assert [fmt.text(i) for i in ids] == ["bytes:\\xe6\\x97", "bytes:\\xa5", "本"]
    assert [fmt.text(i) for i in smol_tokenizer.encode(" café", add_special_tokens=False)] == [" café"]


def test_completion_logprobs_shape(smol_tokenizer):
    fmt = TokenFormatter(smol_tokenizer)
    ids = smol_tokenizer.encode("The sky is blue", add_special_tokens=False)
    tops = [None] + [{t: Logprob(-0.5, 1), 7: Logprob(float("-inf"), 2)} for t in ids[1:]]
    lp = build_completion_logprobs(fmt, ids, tops, 1)
    n = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [-0.5] * (n - 1)
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == "The sky is blue"
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    lp2 = build_completion_logprobs(fmt, ids[1:2], [{7: Logprob(float("-inf"), 1), ids[1]: Logprob(-3.0, 5)}], 1)
    assert lp2.token_logprobs == [-3.0] and set(lp2.top_logprobs[0].values()) == {MIN_LOGPROB, -3.0}
    json.loads(lp2.model_dump_json(), parse_constant=lambda c: pytest.fail(f"non-finite {c}"))


def test_chat_logprobs_top_k_by_rank(smol_tokenizer):
    fmt = TokenFormatter(smol_tokenizer)
    step = {5: Logprob(-2.0, 3), 6: Logprob(-0.1, 1), 7: Logprob(-1.0, 2)}
    out = build_chat_logprobs(fmt, [5], [step], 2)
    entry = out.content[0]
    assert entry.token == fmt.text(5) and entry.logprob == -2.0 and entry.bytes == fmt.raw_bytes(5)
    assert [t.logprob for t in entry.top_logprobs] == [-0.1, -1.0]
    assert build_chat_logprobs(fmt, [5], [step], 0).content[0].top_logprobs == []


def test_render_chat_prompt(smol_tokenizer):
    msgs = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "My favourite is the"}]
    cont = render_chat_prompt(smol_tokenizer, msgs, add_generation_prompt=False, continue_final_message=True)
    assert cont.endswith("My favourite is the")
    closed = render_chat_prompt(smol_tokenizer, msgs)
    assert closed.endswith("<|im_end|>\n<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "a\nb" in render_chat_prompt(smol_tokenizer, parts)
    # reserved template kwargs cannot be overridden through chat_template_kwargs
    assert render_chat_prompt(smol_tokenizer, msgs[:1], chat_template_kwargs={"add_generation_prompt": False,
                                                                              "tokenize": True}) == \
        render_chat_prompt(smol_tokenizer, msgs[:1])
    custom = render_chat_prompt(smol_tokenizer, msgs[:1], chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert custom == "[Name a fruit.]"


def test_render_chat_prompt_errors(smol_tokenizer):
    with pytest.raises(SamplingParamsError) as e:
        render_chat_prompt(smol_tokenizer, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert e.value.param == "messages.0.content.0.type"
    with pytest.raises(SamplingParamsError) as e:
        render_chat_prompt(smol_tokenizer, [{"role": "user", "content": "x"}], add_generation_prompt=False,
                           continue_final_message=True)
    assert e.value.param == "continue_final_message"
    with pytest.raises(SamplingParamsError):
        render_chat_prompt(smol_tokenizer, [{"role": "user", "content": "x"}], chat_template="{% if %}")
    with pytest.raises(SamplingParamsError) as e:  # a template that refuses a role: 400
        render_chat_prompt(smol_tokenizer, [{"role": "wizard", "content": "x"}], chat_template=(
            "{% for m in messages %}{% if m.role not in ['user'] %}{{ raise_exception('bad role') }}"
            "{% endif %}{{ m.content }}{% endfor %}"))
    assert e.value.param == "messages"


def test_custom_roles_reach_the_template(smol_tokenizer):
    # vLLM passes roles it does not know through to the chat template (issue 10).
    text = render_chat_prompt(smol_tokenizer, [{"role": "ipython", "content": "42"}, {"role": "user", "content": "x"}],
                              add_generation_prompt=True)
    assert "<|im_start|>ipython\n42<|im_end|>\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n" in text
