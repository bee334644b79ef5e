"""System and developer messages where the template cannot take them, and Claude Code's
billing line (llmserve/entrypoints/system_messages.py), through the one renderer that
every chat route uses (OpenAI chat, Anthropic Messages, Ollama, Responses).

The templates below are written here in the shapes real models ship: a ChatML one that
refuses a system message after the first message and any role it has no branch for
(as Qwen3.5's does), and one that renders a system message only when it comes first and
nothing for roles it does not know (as gpt-oss's and Qwen2.5's do for such messages).
"""
from __future__ import annotations

import json
import os

import pytest

STRICT_CHATML = (
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{%- endif %}"
    "{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role in ['user', 'assistant', 'tool'] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{ raise_exception('Unexpected message role.') }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
FIRST_SYSTEM_ONLY = (
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}{{ '[S]' + message.content }}"
    "{%- elif message.role == 'user' %}{{ '[U]' + message.content }}"
    "{%- elif message.role == 'assistant' %}{{ '[A]' + message.content }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '[A]' }}{%- endif %}")
DEVELOPER_AWARE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'developer' %}{{ '[D]' + message.content }}"
    "{%- else %}{{ '[' + message.role + ']' + message.content }}{%- endif %}{%- endfor %}")

CONVERSATION = [{"role": "user", "content": "Fix the bug."},
                {"role": "system", "content": "Agents: explore, plan."},
                {"role": "assistant", "content": "Looking."},
                {"role": "user", "content": "Go on."}]


def render(tokenizer, template, messages):
    from llmserve.entrypoints.renderer import Renderer
    return Renderer(tokenizer, template).render_messages(messages)


def test_a_template_that_refuses_a_late_system_message_gets_it_merged_first(smol_tokenizer):
    text = render(smol_tokenizer, STRICT_CHATML, [{"role": "system", "content": "Be brief."}, *CONVERSATION])
    assert text == ("<|im_start|>system\nBe brief.\n\nAgents: explore, plan.<|im_end|>\n"
                    "<|im_start|>user\nFix the bug.<|im_end|>\n<|im_start|>assistant\nLooking.<|im_end|>\n"
                    "<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n")
    # no leading system message: the merged one is made
    assert render(smol_tokenizer, STRICT_CHATML, CONVERSATION).startswith(
        "<|im_start|>system\nAgents: explore, plan.<|im_end|>\n<|im_start|>user\nFix the bug.")


def test_a_template_that_drops_a_late_system_message_gets_it_merged_first(smol_tokenizer):
    text = render(smol_tokenizer, FIRST_SYSTEM_ONLY, [{"role": "system", "content": "Be brief."}, *CONVERSATION])
    assert text == "[S]Be brief.\n\nAgents: explore, plan.[U]Fix the bug.[A]Looking.[U]Go on.[A]"


def test_a_template_that_renders_late_system_messages_keeps_them_in_place(smol_tokenizer):
    text = render(smol_tokenizer, None, CONVERSATION)  # SmolLM2's ChatML prints every message
    user, system = text.index("Fix the bug."), text.index("<|im_start|>system\nAgents: explore, plan.")
    assert user < system < text.index("Looking.")


def test_developer_is_system_unless_the_template_names_it(smol_tokenizer):
    messages = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    assert render(smol_tokenizer, STRICT_CHATML, messages).startswith(
        "<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nHi")
    assert render(smol_tokenizer, FIRST_SYSTEM_ONLY, messages) == "[S]Answer in French.[U]Hi[A]"
    assert render(smol_tokenizer, DEVELOPER_AWARE, messages) == "[D]Answer in French.[user]Hi"
    # a developer message after the first one: a system message, merged where refused
    late = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "developer", "content": "Use tools."}]
    assert render(smol_tokenizer, STRICT_CHATML, late).startswith(
        "<|im_start|>system\nBe brief.\n\nUse tools.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_a_template_error_that_merging_does_not_cure_is_still_a_400(smol_tokenizer):
    from llmserve.sampling_params import SamplingParamsError
    bad = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "S"}, {"role": "tool", "content": "x"}]
    template = "{{ raise_exception('no tools here') if messages | selectattr('role', 'eq', 'tool') | list }}"
    with pytest.raises(SamplingParamsError, match="no tools here") as err:
        render(smol_tokenizer, template, bad)
    assert err.value.param == "messages"


def _claude_code_request() -> dict:
    here = os.path.dirname(os.path.dirname(__file__))
    with open(os.path.join(here, "data", "agent_clis", "claude_code_2.1.197.json")) as f:
        return json.load(f)["body"]


def test_claude_codes_billing_nonce_does_not_change_the_prompt(smol_tokenizer):
    """Two turns whose billing lines differ (cch is a per-request nonce) render the same
    prompt, so the second one reuses the first one's prefix cache; a user's text that
    starts with the same words is kept."""
    from llmserve.entrypoints.anthropic.conversion import chat_messages
    from llmserve.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from llmserve.entrypoints.renderer import Renderer

    renderer = Renderer(smol_tokenizer)
    prompts = []
    for nonce in ("36ee5", "0aaa9"):
        body = _claude_code_request()
        body["system"][0]["text"] = f"x-anthropic-billing-header: cc_version=2.1.197.1c6; cc_entrypoint=cli; cch={nonce};"
        prompts.append(renderer.render_messages(chat_messages(AnthropicMessagesRequest(**body))))
    assert prompts[0] == prompts[1]
    assert "x-anthropic-billing-header" not in prompts[0]
    assert prompts[0].startswith("<|im_start|>system\nYou are a Claude agent")
    user = [{"role": "user", "content": "x-anthropic-billing-header: what is it?"}]
    assert "x-anthropic-billing-header: what is it?" in renderer.render_messages(user)


def test_claude_codes_late_system_message_reaches_a_strict_template(smol_tokenizer):
    """Claude Code 2.1.197's recorded request (a system message after the first user
    turn) renders on a template that takes a system message only first."""
    from llmserve.entrypoints.anthropic.conversion import chat_messages
    from llmserve.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    body = _claude_code_request()
    late = next(m for m in body["messages"] if m["role"] == "system")
    text = render(smol_tokenizer, STRICT_CHATML, chat_messages(AnthropicMessagesRequest(**body)))
    late_text = late["content"] if isinstance(late["content"], str) else late["content"][0]["text"]
    assert text.count("<|im_start|>system\n") == 1
    assert late_text.strip() in text.split("<|im_end|>")[0]
