"""Chat-template quirks of Gemma and Phi-3 through the one renderer (issue 30 item 4).

The templates are the models' own (tokenizer_config.json of google/gemma-2-2b-it and
microsoft/Phi-3-mini-4k-instruct), rendered with the SmolLM2 tokenizer (no hub here).
Gemma 2's template has no system role: it raises, and the renderer answers 400 naming
``messages`` with the template's own message, as vLLM does (it renders the model's
template and maps template errors to 400). Users who want a system prompt on Gemma 2 pass
a template of their own (``--chat-template`` / ``chat_template``), as with vLLM.
"""
from __future__ import annotations

import pytest

GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")


def test_gemma2_system_message_is_a_400_naming_messages(smol_tokenizer):
    from llmserve.entrypoints.renderer import Renderer
    from llmserve.sampling_params import SamplingParamsError

    renderer = Renderer(smol_tokenizer, GEMMA2_TEMPLATE)
    text = renderer.render_messages([{"role": "user", "content": "Hi "}])
    assert text.endswith("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(SamplingParamsError, match="System role not supported") as err:
        renderer.render_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert err.value.param == "messages"


def test_phi3_turns_end_with_end_token(smol_tokenizer):
    from llmserve.entrypoints.renderer import Renderer

    text = Renderer(smol_tokenizer, PHI3_TEMPLATE).render_messages(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
