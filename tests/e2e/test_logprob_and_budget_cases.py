"""Cases C37 (chat logprobs without top_logprobs), C38 (logprobs=0) and C42
(max_completion_tokens) from /work/shared/cases.md, with their exact expectations."""
from __future__ import annotations

import math

from e2e_utils import MODEL

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"


def _post(server, path, body):
    r = server.post(path, {"model": MODEL, **body})
    return r.status_code, r.json()


def test_chat_logprobs_default_top_c37(server):
    msgs = [{"role": "user", "content": "Name a colour."}]
    p1 = {"messages": msgs, "max_tokens": 6, "temperature": 0, "logprobs": True}
    res = {}
    for name, extra in (("P1", {}), ("P2", {"top_logprobs": 0}), ("P3", {"top_logprobs": 2})):
        status, body = _post(server, CHAT, {**p1, **extra})
        assert status == 200, body
        res[name] = body
    for name in ("P1", "P2"):
        content = res[name]["choices"][0]["logprobs"]["content"]
        assert len(content) == res[name]["usage"]["completion_tokens"]
        assert all(math.isfinite(e["logprob"]) and e["logprob"] <= 0 and e["top_logprobs"] == [] for e in content)
    for e in res["P3"]["choices"][0]["logprobs"]["content"]:
        assert len(e["top_logprobs"]) == 2
        assert (e["top_logprobs"][0]["token"], e["top_logprobs"][0]["logprob"]) == (e["token"], e["logprob"])
    seqs = [[(e["token"], e["logprob"]) for e in res[n]["choices"][0]["logprobs"]["content"]] for n in res]
    assert [t for t, _ in seqs[0]] == [t for t, _ in seqs[1]] == [t for t, _ in seqs[2]]
    # P2 and P3 reuse P1's prompt from the prefix cache; the cached path's attention
    # differs from a full prefill in the last float32 bits (~6e-6 measured), see issue 10.6
    for other in seqs[1:]:
        assert all(abs(a - b) <= 1e-4 for (_, a), (_, b) in zip(seqs[0], other))
    status, p4 = _post(server, CHAT, {**p1, "logprobs": False})
    assert status == 200 and p4["choices"][0]["logprobs"] is None


def test_zero_logprobs_c38(server):
    z1 = {"prompt": "Translate to French: good morning ->", "max_tokens": 6, "temperature": 0, "logprobs": 0}
    s1, r1 = _post(server, CMPL, z1)
    s2, r2 = _post(server, CMPL, {**z1, "logprobs": 1})
    s3, r3 = _post(server, CMPL, {k: v for k, v in z1.items() if k != "logprobs"})
    s4, r4 = _post(server, CMPL, {**z1, "echo": True})
    assert (s1, s2, s3, s4) == (200, 200, 200, 200)
    lp1, n = r1["choices"][0]["logprobs"], r1["usage"]["completion_tokens"]
    assert len(lp1["tokens"]) == len(lp1["token_logprobs"]) == len(lp1["text_offset"]) == n
    assert all(math.isfinite(v) and v <= 0 for v in lp1["token_logprobs"])
    assert lp1["token_logprobs"] == r2["choices"][0]["logprobs"]["token_logprobs"]
    assert r1["choices"][0]["text"] == r2["choices"][0]["text"]
    for tok, top in zip(lp1["tokens"], lp1["top_logprobs"]):
        assert top is None or set(top) <= {tok}
    assert r3["choices"][0]["logprobs"] is None
    lp4, u4 = r4["choices"][0]["logprobs"], r4["usage"]
    assert len(lp4["token_logprobs"]) == u4["prompt_tokens"] + u4["completion_tokens"]
    assert lp4["token_logprobs"][0] is None


def test_max_completion_tokens_c42(server):
    msgs = [{"role": "user", "content": "Write a long story about a lighthouse."}]
    x1 = {"messages": msgs, "max_completion_tokens": 5, "ignore_eos": True}
    s, r = _post(server, CHAT, x1)
    assert s == 200 and r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"
    s, r = _post(server, CHAT, {**x1, "max_tokens": 9})
    assert s == 200 and r["usage"]["completion_tokens"] == 5
    chunks = server.stream_chunks(CHAT, {"model": MODEL, **x1, "stream": True,
                                         "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["length"]
    for bad in (-3, 5000 * 1000):
        s, r = _post(server, CHAT, {**x1, "max_completion_tokens": bad})
        assert s == 400 and (r["error"]["param"] == "max_completion_tokens"
                             or "context length" in r["error"]["message"]), r
