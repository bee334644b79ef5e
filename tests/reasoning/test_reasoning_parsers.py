"""Reasoning parsers on strings and token ids: whole outputs, streams split at every
character (streamed reasoning/content equal the whole-output split), is_reasoning_end and
extract_content_ids on ids."""
from __future__ import annotations

import pytest

from llmserve.reasoning import ReasoningParserManager


class VocabTokenizer:
    """A tokenizer stand-in: the parsers only read the vocabulary."""

    def __init__(self, vocab):
        self._vocab = vocab

    def get_vocab(self):
        return dict(self._vocab)


TOK = VocabTokenizer({"<think>": 7, "</think>": 8, "a": 1, "b": 2})


def parser(name, **kwargs):
    return ReasoningParserManager.get_reasoning_parser(name)(TOK, **kwargs)


def streamed(p, text, step=1):
    reasoning = content = prev = ""
    for k in list(range(step, len(text), step)) + [len(text)]:
        cur = text[:k]
        for d in (p.extract_reasoning_streaming(prev, cur, cur[len(prev):], [], [], []),):
            if d is not None:
                reasoning += d.reasoning or ""
                content += d.content or ""
        prev = cur
    d = p.flush_streaming(text)
    if d is not None:
        reasoning += d.reasoning or ""
        content += d.content or ""
    return reasoning or None, content or None


CASES = [  # (output, deepseek_r1 / qwen3 split)
    ("I should add.</think>The answer is 4.", ("I should add.", "The answer is 4.")),
    ("<think>Hmm, 2+2.</think>\n\n4", ("Hmm, 2+2.", "\n\n4")),
    ("still thinking when the budget ran out </thi", ("still thinking when the budget ran out </thi", None)),
    ("reasoning</think>", ("reasoning", None)),
    ("</think>only content", (None, "only content")),
]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text,expected", CASES)
def test_whole_and_streamed_splits_agree(name, text, expected):
    p = parser(name)
    assert p.extract_reasoning(text, None) == expected
    for step in (1, 2, 5):
        assert streamed(p, text, step) == expected


def test_qwen3_with_thinking_disabled_is_content():
    p = parser("qwen3", chat_template_kwargs={"enable_thinking": False})
    assert p.extract_reasoning("Just the answer.", None) == (None, "Just the answer.")
    assert streamed(p, "Just the answer.") == (None, "Just the answer.")
    assert parser("deepseek_r1").extract_reasoning("Just the answer.", None) == ("Just the answer.", None)


def test_qwen3_thinking_disabled_late_end_marker_stays_content_c59():
    """Thinking off: an output that opens no block is content throughout, a late
    ``</think>`` included, so the stream (content first) and the whole split agree; an
    output that opens ``<think>`` is still split. The grammar of a structured-output
    request then applies from the first token (reasoning_by_default False)."""
    p = parser("qwen3", chat_template_kwargs={"enable_thinking": False})
    assert not p.reasoning_by_default() and parser("qwen3").reasoning_by_default()
    assert parser("deepseek_r1", chat_template_kwargs={"enable_thinking": False}).reasoning_by_default()
    late = 'Let me add.</think>{"answer": 5}'
    assert p.extract_reasoning(late, None) == (None, late)
    for step in (1, 3):
        assert streamed(p, late, step) == (None, late)
    opened = "<think>Let me add.</think>5"
    assert p.extract_reasoning(opened, None) == ("Let me add.", "5")
    for step in (1, 3):
        assert streamed(p, opened, step) == ("Let me add.", "5")


def test_token_id_methods():
    p = parser("qwen3")
    assert p.is_reasoning_end([1, 7, 1, 2, 8]) and p.is_reasoning_end([8, 1])
    assert not p.is_reasoning_end([1, 7, 1]) and not p.is_reasoning_end([1, 2])
    assert not p.is_reasoning_end([8, 1, 7, 2])  # a new reasoning block opened after an old one
    assert p.extract_content_ids([1, 2, 8, 2, 1]) == [2, 1] and p.extract_content_ids([1, 2]) == []


def test_tokenizer_without_think_tokens_is_refused():
    with pytest.raises(ValueError, match="think"):
        ReasoningParserManager.get_reasoning_parser("deepseek_r1")(VocabTokenizer({"a": 1}))
    with pytest.raises(KeyError, match="not registered"):
        ReasoningParserManager.get_reasoning_parser("nope")
