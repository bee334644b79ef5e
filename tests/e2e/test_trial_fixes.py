"""Issue 10's fresh trial with real clients (openai, LangChain, litellm, lm-eval): each
fault they tripped over, as a test of its whole kind on both endpoints, streamed and not.
Plus the leftovers: ``logit_bias`` clamped to [-100, 100] in every path (the offline one
is in tests/engine/test_logit_bias.py) and its bad keys named with the vocabulary size."""
from __future__ import annotations

import pytest

from e2e_utils import MODEL

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
BASES = {CMPL: {"prompt": "The capital of France is"},
         CHAT: {"messages": [{"role": "user", "content": "Name a colour."}]}}


def _first_token(server, path, body, stream):
    body = {"model": MODEL, **BASES[path], "max_tokens": 1, "temperature": 0, "return_token_ids": True, **body}
    if stream:
        chunks = server.stream_chunks(path, {**body, "stream": True})
        return [t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])]
    r = server.post(path, body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_logit_bias_is_clamped(server, path, stream):
    """Of two allowed tokens greedy picks W. Clamped, +1e6 on the other (L) against +100
    on W is a tie of +100 each, so W stays (unclamped, L would win); the same for -1e6."""
    a, b = 1000, 2000
    w = _first_token(server, path, {"allowed_token_ids": [a, b]}, stream)[0]
    loser = b if w == a else a
    for bias in ({str(loser): 1e6, str(w): 100}, {str(w): -1e6, str(loser): -100}):
        assert _first_token(server, path, {"allowed_token_ids": [a, b], "logit_bias": bias}, stream) == [w], bias
    assert _first_token(server, path, {"allowed_token_ids": [a, b], "logit_bias": {str(loser): 100}},
                        stream) == [loser]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_logit_bias_bad_keys_are_all_named_with_the_vocabulary(server, path, stream):
    body = {"model": MODEL, **BASES[path], "max_tokens": 2, "stream": stream,
            "logit_bias": {"abc": 1, "5": 1, "-3": 2, "60000": 1, "1.5": 2}}
    r = server.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias"
    assert err["message"] == ("logit_bias: token ids out of vocabulary: 'abc', -3, 60000, '1.5' (the vocabulary "
                              "has 49152 tokens, valid ids are 0..49151).")


# ---- OpenAI chat fields the official client sends that were silently dropped ---------
REFUSED = {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
           "web_search_options": {}, "functions": [{"name": "f", "parameters": {}}],
           "function_call": {"name": "f"}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", sorted(REFUSED))
def test_openai_fields_this_server_cannot_honour_are_400(server, field, stream):
    r = server.post(CHAT, {"model": MODEL, **BASES[CHAT], "max_tokens": 2, "stream": stream,
                           field: REFUSED[field]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    # text-only modalities and an "auto"/"none" function_call without functions ask for nothing new
    for ok in ({"modalities": ["text"]}, {"function_call": "auto"}, {"function_call": "none"}):
        assert server.post(CHAT, {"model": MODEL, **BASES[CHAT], "max_tokens": 1, **ok}).status_code == 200



# test_reasoning_effort_reaches_the_chat_template needs a request chat_template, which the
# shared server refuses (no --trust-request-chat-template): it is in
# tests/e2e/test_request_chat_templates.py, on a server with that flag.
