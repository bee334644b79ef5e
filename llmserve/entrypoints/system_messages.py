"""System-like messages a chat template cannot take where they stand, and Claude Code's
billing line: the conversation is reshaped before (or after a failed) rendering.

Agent clients send instructions in places many chat templates refuse or drop:

- ``role: "developer"`` (OpenAI's name for the system message since o1; Codex, the
  Responses API and the openai-agents SDK send it). Most templates do not know the role:
  Qwen3.5's raises "Unexpected message role", Qwen2.5's renders nothing for it, so the
  instructions vanish. A template whose source never names ``developer`` gets it as
  ``system`` (llama.cpp PR 20215 and vLLM PR 43590 map it the same way).
- A system message after the first message: Claude Code >= 2.1.154 sends its agent list as
  a ``system`` message after the first user turn, and Anthropic's API takes it. Templates
  that only take a leading system message raise ("System message must be at the
  beginning.", Qwen3.5, Mistral; "Conversation roles must alternate", Gemma) or render
  nothing for it (gpt-oss, Qwen2.5 for ``developer``). Such a conversation is rendered as
  it is first; when the template raises, or a non-leading system message's text is not in
  its output, it is rendered again with every system message's text joined (in order,
  blank line between) into one leading system message (vLLM issues 44000 / 48874; vLLM
  PR 46025 detects the template's support, vllm-mlx PR 646 merges the same way). A
  template that renders them in place (Llama 3, ChatML / SmolLM2) keeps them there.
- Claude Code's first system block ``x-anthropic-billing-header: cc_version=...;
  cc_entrypoint=...; cch=<nonce>;`` is client metadata for Anthropic's billing. Its
  ``cch`` changes on every request, so at the head of the prompt it made every turn miss
  the prefix cache (a full prefill of the ~3,000-token system prompt and tools each
  turn). That line is left out of a system message that starts with it, as vLLM (PR
  36829), SGLang (PR 21064) and llama.cpp (PR 21793) do.
"""
from __future__ import annotations

import re
from typing import Any, Callable

# The billing line at the head of a system message (Claude Code's first system block).
_BILLING_LINE = re.compile(r"\A\s*x-anthropic-billing-header:[^\n]*(?:\n|\Z)")
# Roles that carry instructions for the whole conversation.
_SYSTEM_ROLES = ("system", "developer")


def strip_billing_header(text: str) -> str:
    """``text`` without a leading ``x-anthropic-billing-header: ...`` line (see the
    module docstring); any other text is returned unchanged."""
    if "x-anthropic-billing-header" not in text[:64]:
        return text
    return _BILLING_LINE.sub("", text, count=1)


def template_names_role(template_source: str, role: str) -> bool:
    """Whether the Jinja source names ``role`` as a quoted string (the template has a
    branch for it)."""
    return f'"{role}"' in template_source or f"'{role}'" in template_source


def normalize_system_messages(conversation: list[dict[str, Any]], template_source: str) -> list[dict[str, Any]]:
    """The parsed conversation (plain dicts, ``content`` a string) with each system
    message's billing line left out and ``developer`` messages as ``system`` when the
    template does not name ``developer``. Returns new dicts for the messages it changes;
    the input is not modified."""
    developer_as_system = not template_names_role(template_source, "developer")
    out = []
    for msg in conversation:
        role = msg.get("role")
        if role in _SYSTEM_ROLES:
            msg = dict(msg, content=strip_billing_header(msg.get("content") or ""))
            if role == "developer" and developer_as_system:
                msg["role"] = "system"
        out.append(msg)
    return out


def inline_system_texts(conversation: list[dict[str, Any]]) -> list[str]:
    """The stripped, non-empty texts of the system messages after the first message."""
    return [m["content"].strip() for m in conversation[1:]
            if m.get("role") == "system" and isinstance(m.get("content"), str) and m["content"].strip()]


def merge_system_messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One leading system message holding every system message's text (in order, a
    blank line between), then the other messages in their order."""
    system = [m for m in conversation if m.get("role") == "system"]
    rest = [m for m in conversation if m.get("role") != "system"]
    text = "\n\n".join(m["content"] for m in system if m.get("content"))
    return [{"role": "system", "content": text}, *rest] if text else rest


def render_with_inline_systems(render: Callable[[list[dict[str, Any]]], str],
                               conversation: list[dict[str, Any]]) -> str:
    """``render(conversation)``; when the conversation has system messages after its first
    message and the template raises or leaves one of their texts out, ``render`` of the
    merged conversation instead (:func:`merge_system_messages`). The first error is
    raised when the merged one fails too."""
    inline = inline_system_texts(conversation)
    if not inline:
        return render(conversation)
    try:
        text = render(conversation)
    except Exception as first:
        try:
            return render(merge_system_messages(conversation))
        except Exception:
            raise first from None
    if all(t in text for t in inline):
        return text
    return render(merge_system_messages(conversation))
