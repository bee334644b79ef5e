"""vLLM's extra request fields that change the response (issue 10 point 1), on
/v1/completions and /v1/chat/completions, streamed and not, plus the validation of
token-id fields over HTTP (point 2) and case C40 (prompt logprobs and the prefix cache)."""
from __future__ import annotations

import random

import pytest

from e2e_utils import MODEL

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Name a colour."}]
NATO = ("alfa bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa "
        "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def _ok(server, path, body):
    r = server.post(path, {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _err(server, path, body, status=400):
    r = server.post(path, {"model": MODEL, **body})
    assert r.status_code == status, r.text
    return r.json()["error"]


def _radio_prompt(seed: int) -> str:
    rnd = random.Random(seed)
    return "Radio words: " + " ".join(rnd.choice(NATO) for _ in range(60))


def _check_prompt_logprobs(plp, prompt_ids):
    assert len(plp) == len(prompt_ids) and plp[0] is None
    for tid, entry in zip(prompt_ids[1:], plp[1:]):
        assert str(tid) in entry
        for cand in entry.values():
            assert set(cand) == {"logprob", "rank", "decoded_token"}
            assert cand["logprob"] <= 0 and cand["rank"] >= 1 and isinstance(cand["decoded_token"], str)
        assert len(entry) <= 2  # the actual token and the 1 best


def test_prompt_logprobs_c40(server):
    p = _radio_prompt(7)
    ids = server.tok(p)["tokens"]
    assert len(ids) > 7 * 16  # more than 7 blocks: the warm run hits the prefix cache
    body = {"prompt": p, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    cold, warm = _ok(server, CMPL, body), _ok(server, CMPL, body)
    for res in (cold, warm):
        _check_prompt_logprobs(res["choices"][0]["prompt_logprobs"], ids)
    for a, b in zip(cold["choices"][0]["prompt_logprobs"][1:], warm["choices"][0]["prompt_logprobs"][1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[k]["logprob"] - b[k]["logprob"]) <= 1e-4 for k in a)
    assert cold["choices"][0]["text"] == warm["choices"][0]["text"]
    longer = _ok(server, CMPL, {**body, "prompt": p + " zulu zulu"})["choices"][0]["prompt_logprobs"]
    for a, b in zip(cold["choices"][0]["prompt_logprobs"][1:], longer[1:len(ids)]):
        assert all(abs(a[k]["logprob"] - b[k]["logprob"]) <= 1e-4 for k in a)
    # chat: at the top level, over the rendered prompt
    chat = _ok(server, CHAT, {"messages": MSGS, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1,
                              "return_token_ids": True})
    _check_prompt_logprobs(chat["prompt_logprobs"], chat["prompt_token_ids"])
    assert chat["prompt_token_ids"] == server.post("/tokenize", {"model": MODEL, "messages": MSGS}).json()["tokens"]
    # prompt_logprobs=0: only the actual token at each position
    zero = _ok(server, CMPL, {**body, "prompt": "Hello there friend", "prompt_logprobs": 0})
    assert [sorted(e) if e else e for e in zero["choices"][0]["prompt_logprobs"]] == \
        [None] + [[str(t)] for t in server.tok("Hello there friend")["tokens"][1:]]
    # vLLM: not available when streaming; negative: 400 like every other field
    for path, base in ((CMPL, {"prompt": "Hi"}), (CHAT, {"messages": MSGS})):
        assert _err(server, path, {**base, "stream": True, "prompt_logprobs": 1})["param"] == "prompt_logprobs"
        for bad in (-1, -5, 21):
            assert _err(server, path, {**base, "prompt_logprobs": bad})["param"] == "prompt_logprobs"


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_return_token_ids_stream_and_not(server, path):
    base = {"prompt": "The capital of France is"} if path == CMPL else {"messages": MSGS}
    body = {**base, "max_tokens": 6, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    res = _ok(server, path, body)
    expected_prompt = (server.tok(base["prompt"])["tokens"] if path == CMPL else
                       server.post("/tokenize", {"model": MODEL, "messages": MSGS}).json()["tokens"])
    choice = res["choices"][0]
    prompt_ids = choice["prompt_token_ids"] if path == CMPL else res["prompt_token_ids"]
    assert prompt_ids == expected_prompt
    assert len(choice["token_ids"]) == res["usage"]["completion_tokens"] == 6
    text = choice["text"] if path == CMPL else choice["message"]["content"]
    assert server.post("/detokenize", {"model": MODEL, "tokens": choice["token_ids"]}).json()["prompt"] == text
    chunks = server.stream_chunks(path, {**body, "stream": True})
    if path == CMPL:
        firsts = [ch.get("prompt_token_ids") for c in chunks for ch in c["choices"]]
    else:
        firsts = [c.get("prompt_token_ids") for c in chunks]
    assert firsts[0] == expected_prompt and all(f is None for f in firsts[1:])
    assert [t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])] == choice["token_ids"]
    plain = _ok(server, path, {**body, "return_token_ids": False})
    assert plain["choices"][0].get("token_ids") is None and plain.get("prompt_token_ids") is None


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_return_tokens_as_token_ids(server, path):
    base = {"prompt": "The capital of France is", "logprobs": 2} if path == CMPL else \
        {"messages": MSGS, "logprobs": True, "top_logprobs": 2}
    body = {**base, "max_tokens": 4, "temperature": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
    for stream in (False, True):
        if stream:
            chunks = server.stream_chunks(path, {**body, "stream": True})
            ids = [t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])]
            lps = [ch["logprobs"] for c in chunks for ch in c["choices"] if ch.get("logprobs")]
        else:
            res = _ok(server, path, body)
            ids, lps = res["choices"][0]["token_ids"], [res["choices"][0]["logprobs"]]
        if path == CMPL:
            tokens = [t for lp in lps for t in lp["tokens"]]
            tops = [k for lp in lps for top in lp["top_logprobs"] for k in top]
        else:
            tokens = [e["token"] for lp in lps for e in lp["content"]]
            tops = [t["token"] for lp in lps for e in lp["content"] for t in e["top_logprobs"]]
        assert tokens == [f"token_id:{t}" for t in ids]
        assert tops and all(t.startswith("token_id:") for t in tops)


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_truncate_prompt_tokens(server, path):
    text = "one two three four five six seven eight nine ten"
    base = {"prompt": text} if path == CMPL else {"messages": [{"role": "user", "content": text}]}
    full = (server.tok(text)["tokens"] if path == CMPL else
            server.post("/tokenize", {"model": MODEL, "messages": base["messages"]}).json()["tokens"])
    body = {**base, "max_tokens": 2, "temperature": 0, "return_token_ids": True}

    def kept(**extra):
        res = _ok(server, path, {**body, **extra})
        ids = res["choices"][0]["prompt_token_ids"] if path == CMPL else res["prompt_token_ids"]
        assert res["usage"]["prompt_tokens"] == len(ids)
        return ids

    assert kept(truncate_prompt_tokens=5) == full[-5:]
    assert kept(truncate_prompt_tokens=5, truncation_side="left") == full[-5:]
    assert kept(truncate_prompt_tokens=5, truncation_side="right") == full[:5]
    assert kept(truncate_prompt_tokens=-1) == full
    assert kept(truncate_prompt_tokens=len(full) + 3) == full
    chunks = server.stream_chunks(path, {**body, "stream": True, "truncate_prompt_tokens": 4})
    firsts = [ch.get("prompt_token_ids") for c in chunks for ch in c["choices"]] if path == CMPL else \
        [c.get("prompt_token_ids") for c in chunks]
    assert firsts[0] == full[-4:]
    maxlen = server.http.get("/v1/models").json()["data"][0]["max_model_len"]
    for bad in (0, -2, maxlen + 1):
        assert _err(server, path, {**body, "truncate_prompt_tokens": bad})["param"] == "truncate_prompt_tokens"
    if path == CMPL:  # echo shows what the model saw
        res = _ok(server, CMPL, {**body, "truncate_prompt_tokens": 3, "echo": True, "max_tokens": 1})
        assert res["choices"][0]["text"].startswith(" eight nine ten")


def test_chat_echo_with_continue_final_message(server):
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    body = {"messages": msgs, "max_tokens": 4, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True}
    plain = _ok(server, CHAT, body)["choices"][0]["message"]["content"]
    echoed = _ok(server, CHAT, {**body, "echo": True})["choices"][0]["message"]["content"]
    assert echoed == "The capital of France is" + plain
    chunks = server.stream_chunks(CHAT, {**body, "echo": True, "stream": True})
    assert "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]) == echoed
    # the last message is the user's: nothing to echo (vLLM)
    user_only = _ok(server, CHAT, {"messages": msgs[:1], "max_tokens": 2, "temperature": 0, "echo": True})
    assert not user_only["choices"][0]["message"]["content"].startswith("What is")


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_token_id_fields_out_of_vocabulary_are_400(server, path):
    base = {"prompt": "Hi"} if path == CMPL else {"messages": MSGS}
    for bad in ([-1], [49152], [5, 100000]):
        err = _err(server, path, {**base, "max_tokens": 2, "stop_token_ids": bad})
        assert err["param"] == "stop_token_ids" and "49152" in err["message"]
    err = _err(server, path, {**base, "max_tokens": 2, "logit_bias": {"-3": 1, "60000": 2, "7": 1}})
    assert err["param"] == "logit_bias"
    assert "-3, 60000 (the vocabulary has 49152 tokens" in err["message"]
    err = _err(server, path, {**base, "max_tokens": 2, "priority": 5})
    assert err["param"] == "priority"


def test_min_tokens_without_max_tokens_is_not_a_400(server):
    # completions: the legacy default budget of 16 is raised to min_tokens, not refused
    res = _ok(server, CMPL, {"prompt": "Hi", "min_tokens": 20, "temperature": 0})
    assert res["usage"]["completion_tokens"] == 20
    # min_tokens holds back stop strings: the first "." does not stop before 6 tokens
    stopped = _ok(server, CMPL, {"prompt": "The capital of France is", "max_tokens": 10, "temperature": 0,
                                 "stop": ["."]})["choices"][0]
    held = _ok(server, CMPL, {"prompt": "The capital of France is", "max_tokens": 10, "temperature": 0,
                              "stop": ["."], "min_tokens": 6, "return_token_ids": True})["choices"][0]
    assert stopped["text"] == " Paris" and stopped["finish_reason"] == "stop"
    assert held["text"].startswith(" Paris.") and len(held["token_ids"]) >= 6
