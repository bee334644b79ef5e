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
