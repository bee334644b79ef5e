"""Neighbours of the behaviour cases (cases.md), found by probing the default server:
each test replays a public bug report against an LLM server on the shared ``server``
fixture (SmolLM2-135M-Instruct, float32).
"""
from __future__ import annotations

from e2e_utils import MODEL, no_nonfinite

EMOJI_PROMPT = "Emoji list: 🍎 🍌 🍇 🥝"  # SmolLM2 writes emoji as three byte tokens each


def _expected_offsets(server, ids: list[int]) -> list[int]:
    """text_offset[i] = characters decoded before token i (a character split over several
    tokens counts once it is whole), from /detokenize of each prefix."""
    out = []
    for i in range(len(ids)):
        text = server.post("/detokenize", {"model": MODEL, "tokens": ids[:i]}).json()["prompt"]
        out.append(len(text.rstrip("\ufffd")))  # a trailing partial character is not text yet
    return out


def test_text_offset_follows_the_text_over_byte_tokens(server):
    """logprobs/text-offset (llama-cpp-python PR 1037: tokens that each hold part of a
    character made text_offset stop moving, so it no longer pointed into ``text``; vLLM
    issue 19368: with ``return_tokens_as_token_ids`` the offsets counted the length of
    ``token_id:N``). Every offset is the length of the text before its token, the same
    streamed and not, and whatever the tokens are written as."""
    body = {"model": MODEL, "prompt": EMOJI_PROMPT, "max_tokens": 9, "temperature": 0, "logprobs": 1,
            "return_token_ids": True}
    choice = server.post("/v1/completions", body).json()["choices"][0]
    lp, ids = choice["logprobs"], choice["token_ids"]
    assert any(t.startswith("bytes:") for t in lp["tokens"]), lp["tokens"]  # the case's precondition
    want = _expected_offsets(server, ids)
    assert lp["text_offset"] == want, (lp["text_offset"], want)
    assert want[-1] < len(choice["text"])
    chunks = server.stream_chunks("/v1/completions", {**body, "stream": True})
    streamed = [o for c in chunks for ch in c["choices"] for o in (ch["logprobs"] or {}).get("text_offset", [])]
    assert streamed == want
    as_ids = server.post("/v1/completions", {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert as_ids["logprobs"]["tokens"][0] == f"token_id:{ids[0]}"
    assert as_ids["logprobs"]["text_offset"] == want
    # echo: the prompt's tokens first, the offsets running on through the generated text
    echo = server.post("/v1/completions", {**body, "echo": True}).json()["choices"][0]
    offsets = echo["logprobs"]["text_offset"]
    n_prompt = len(offsets) - len(ids)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[n_prompt:] == [o + len(EMOJI_PROMPT) for o in want]
    no_nonfinite(server.post("/v1/completions", {**body, "echo": True}).text)


def test_a_stop_string_that_is_a_skipped_special_token_stops(server):
    """stop/special-token-stop-string (vLLM issue 2123; koboldcpp issues 791 and 812):
    ``stop: ["<|im_end|>"]`` with ``ignore_eos`` and the default
    ``skip_special_tokens`` never matched, because the token's text is left out of the
    output, so generation ran on to ``max_tokens``. It stops where it does with the
    special tokens kept: same text, same token count, ``stop_reason`` the string,
    streamed too; ``include_stop_str_in_output`` adds the string."""
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 40,
            "temperature": 0, "ignore_eos": True, "stop": ["<|im_end|>"]}
    kept = server.post("/v1/chat/completions", {**base, "skip_special_tokens": False}).json()
    assert kept["choices"][0]["finish_reason"] == "stop", kept  # the precondition: the model ends its turn
    got = server.post("/v1/chat/completions", base).json()
    choice = got["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "<|im_end|>"), choice
    assert choice["message"]["content"] == kept["choices"][0]["message"]["content"]
    assert got["usage"]["completion_tokens"] == kept["usage"]["completion_tokens"] < 40
    chunks = server.stream_chunks("/v1/chat/completions", {**base, "stream": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
        choice["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] \
        == ["stop"]
    incl = server.post("/v1/chat/completions", {**base, "include_stop_str_in_output": True}).json()
    assert incl["choices"][0]["message"]["content"] == choice["message"]["content"] + "<|im_end|>"
    # the EOS itself still ends a request without ignore_eos as an EOS (stop_reason null)
    eos = server.post("/v1/chat/completions", {**base, "ignore_eos": False}).json()["choices"][0]
    assert (eos["finish_reason"], eos["stop_reason"]) == ("stop", None)
