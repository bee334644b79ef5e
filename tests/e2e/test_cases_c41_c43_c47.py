"""Cases C41 (top_k 0 means off), C43 (X-Request-Id echoed or generated, on every kind of
response) and C47 (several text parts of one message joined with "\\n") from
shared/cases.md, on the shared float32 server."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from e2e_utils import MODEL

BASE = {"model": MODEL, "prompt": "My favourite animal is", "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}


def _text(server, body: dict) -> str:
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_top_k_zero_is_no_limit_c41(server):
    seeds = list(range(1, 6))
    bodies = ([dict(BASE, seed=s, top_k=0) for s in seeds] + [dict(BASE, seed=s, top_k=-1) for s in seeds]
              + [dict(BASE, seed=s) for s in seeds] + [dict(BASE, temperature=0), dict(BASE, seed=1234, top_k=1)])
    # All at once: a seeded request's text does not depend on the batch (issue 18).
    with ThreadPoolExecutor(len(bodies)) as pool:
        texts = list(pool.map(lambda b: _text(server, b), bodies))
    k0, k_minus1, unset, (greedy, k1) = texts[:5], texts[5:10], texts[10:15], texts[15:]
    assert k0 == k_minus1 == unset  # A2
    assert any(t != greedy for t in k0)  # A3: 0 is not a limit of 1
    assert k1 == greedy
    chat = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 4, "top_k": 0})
    assert chat.status_code == 200, chat.text  # A1
    bad = server.post("/v1/completions", dict(BASE, top_k=-2))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k"  # A4


HI = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_x_request_id_is_echoed_or_generated_c43(server):
    r = server.post("/v1/chat/completions", HI, headers={"X-Request-Id": "trace-abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-abc-123"  # A1
    ids = [server.post("/v1/chat/completions", HI).headers.get("X-Request-Id") for _ in range(2)]
    assert all(ids) and ids[0] != ids[1]  # A2
    with server.http.stream("POST", "/v1/chat/completions", json=dict(HI, stream=True),
                            headers={"X-Request-Id": "trace-stream-9"}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        assert s.headers["X-Request-Id"] == "trace-stream-9"  # A3: on the SSE response itself
        assert "[DONE]" in "".join(s.iter_text())
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                    headers={"x-request-id": "lower-case-id"})
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "lower-case-id"
    err = server.post("/v1/chat/completions", dict(HI, model="nope"), headers={"X-Request-Id": "err-id"})
    assert 400 <= err.status_code < 500 and err.headers["X-Request-Id"] == "err-id"  # A4


PART1, PART2 = "First part: the code word is MAPLE.", "Second part: repeat the code word."


def _rendered(server, messages: list) -> str:
    r = server.post("/tokenize", {"model": MODEL, "add_generation_prompt": True, "messages": messages})
    assert r.status_code == 200, r.text
    d = server.post("/detokenize", {"model": MODEL, "tokens": r.json()["tokens"]})
    return d.json()["prompt"]


def test_text_parts_are_joined_with_newline_c47(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": PART1}, {"type": "text", "text": PART2}]}]
    joined = [{"role": "user", "content": f"{PART1}\n{PART2}"}]
    s1, s2 = _rendered(server, parts), _rendered(server, joined)
    assert s1.count(PART1) == 1 and s1.count(PART2) == 1 and s1.index(PART1) < s1.index(PART2)  # A1
    assert s1 == s2  # A2
    outs = [server.post("/v1/chat/completions", {"model": MODEL, "messages": m, "max_tokens": 8,
                                                 "temperature": 0}).json() for m in (parts, joined)]
    assert outs[0]["usage"]["prompt_tokens"] == outs[1]["usage"]["prompt_tokens"]  # A3
    assert outs[0]["choices"][0]["message"]["content"] == outs[1]["choices"][0]["message"]["content"]
    roles = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": "Hello"},
             {"role": "assistant", "content": [{"type": "text", "text": "Hi there."}]},
             {"role": "user", "content": "Bye"}]
    s4 = _rendered(server, roles)  # A4: each part under its own role header
    assert "<|im_start|>system\nBe brief.<|im_end|>" in s4
    assert "<|im_start|>assistant\nHi there.<|im_end|>" in s4
    bogus = server.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "bogus", "text": "x"}]}]})
    assert bogus.status_code == 400 and "error" in bogus.json()  # A5
    empty = server.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": []}]})
    assert empty.status_code in (200, 400)
