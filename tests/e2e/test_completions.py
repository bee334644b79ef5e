"""/v1/completions against the real server: stop strings, finish reasons, echo and
logprobs, max_tokens 0, token-id prompts, greedy equivalence, tiny top_p/temperature and
penalty scope (cases C04, C05, C10, C11, C15, C17, C18, C21)."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_utils import MODEL, finish_reasons, no_nonfinite, stream_text


def complete(server, expect: int = 200, **body):
    body.setdefault("model", MODEL)
    r = server.post("/v1/completions", body)
    assert r.status_code == expect, r.text
    return no_nonfinite(r.text)


def streamed(server, **body):
    body.setdefault("model", MODEL)
    return server.stream_chunks("/v1/completions", {**body, "stream": True})


# --------------------------------------------------------------------------- C04 stop strings
DAYS = "Days of the week: Monday, Tuesday,"


@pytest.fixture(scope="module")
def t0(server):
    """Greedy 40-token continuation of DAYS, and two stop strings Sa (early) and Sb (later)."""
    text = complete(server, prompt=DAYS, max_tokens=40, temperature=0)["choices"][0]["text"]
    sa = ia = None
    for i in range(1, len(text) - 3):
        cand = text[i:i + 3]
        if cand.strip() and text.find(cand) == i:
            sa, ia = cand, i
            break
    assert sa is not None, text
    sb = None
    for j in range(ia + len(sa) + 1, len(text) - 3):
        cand = text[j:j + 4]
        if text.find(cand) == j and sa not in cand:
            sb = cand
            break
    assert sb is not None, text
    return text, sa, ia, sb


def test_stop_strings_c04(server, t0):
    text, sa, ia, sb = t0
    q = {"prompt": DAYS, "max_tokens": 40, "temperature": 0}
    for stream in (False, True):
        def run(**extra):
            if stream:
                chunks = streamed(server, **q, **extra)
                return stream_text(chunks), [r for r in finish_reasons(chunks) if r]
            ch = complete(server, **q, **extra)["choices"][0]
            return ch["text"], [ch["finish_reason"]], ch.get("stop_reason")

        a1 = run(stop=[sb, sa])
        assert a1[0] == text[:ia] and a1[1] == ["stop"]
        if not stream:
            assert a1[2] == sa
        assert run(stop=sa)[:2] == a1[:2]
        a3 = run(stop=[sb, sa], include_stop_str_in_output=True)
        assert a3[0] == text[:ia + len(sa)] and a3[1] == ["stop"]
        a4 = run(stop=[text[:3]])
        assert a4[0] == "" and a4[1] == ["stop"]
    assert complete(server, **q, stop=[])["choices"][0]["text"] == text
    assert complete(server, **q, stop=None)["choices"][0]["text"] == text


# --------------------------------------------------------------------------- C05 finish reasons
def test_finish_reasons_c05(server):
    f1 = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r1 = complete(server, **f1)
    assert r1["choices"][0]["finish_reason"] == "length" and r1["usage"]["completion_tokens"] == 5
    text = r1["choices"][0]["text"]
    stop = text.strip()[:4] or text[:2]
    f4 = {k: v for k, v in f1.items() if k != "ignore_eos"}
    r4 = complete(server, **f4, stop=[stop])
    assert r4["choices"][0]["finish_reason"] == "stop"
    for body, expect in ((f1, "length"), ({**f4, "stop": [stop]}, "stop")):
        assert [r for r in finish_reasons(streamed(server, **body)) if r] == [expect]
    f6 = {**f1, "n": 2, "temperature": 1, "seed": 3}
    r6 = complete(server, **f6)
    assert sorted(c["index"] for c in r6["choices"]) == [0, 1]
    assert all(c["finish_reason"] == "length" for c in r6["choices"])
    chunks = streamed(server, **f6)
    for i in (0, 1):
        assert [r for r in finish_reasons(chunks, i) if r] == ["length"]


# --------------------------------------------------------------------------- C10 / C11 echo + logprobs
def _check_echo_choice(choice, prompt, prompt_tokens, completion_tokens):
    lp = choice["logprobs"]
    n = prompt_tokens + completion_tokens
    assert choice["text"].startswith(prompt)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x is not None and math.isfinite(x) and x <= 0 for x in lp["token_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    if not any(t.startswith("bytes:") for t in lp["tokens"]):
        assert "".join(lp["tokens"]) == choice["text"]


def test_echo_logprobs_c10(server):
    prompt = "purple elephants dance quietly"
    e1 = complete(server, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=1, top_k=1)
    e2 = complete(server, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    for r in (e1, e2):
        _check_echo_choice(r["choices"][0], prompt, r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"])
    p = e1["usage"]["prompt_tokens"]
    for a, b in zip(e1["choices"][0]["logprobs"]["token_logprobs"][1:p], e2["choices"][0]["logprobs"]["token_logprobs"][1:p]):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a))
    prompts = ["purple elephants", "green frogs sing"]
    e3 = complete(server, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=1, top_k=1)
    assert [c["index"] for c in e3["choices"]] == [0, 1]
    for c, pr in zip(e3["choices"], prompts):
        _check_echo_choice(c, pr, server.tok(pr)["count"], 1)
    # streamed echo: the first chunk carries the prompt and its logprobs
    chunks = streamed(server, prompt=prompt, echo=True, logprobs=1, max_tokens=2, temperature=0)
    assert stream_text(chunks).startswith(prompt)
    toks = [t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
    assert len(toks) == p + 2


def test_echo_max_tokens_zero_c11(server):
    z1 = complete(server, prompt="Your answer: Yes", echo=True, logprobs=1, max_tokens=0, temperature=0)
    ch = z1["choices"][0]
    assert ch["text"] == "Your answer: Yes" and z1["usage"]["completion_tokens"] == 0
    assert len(ch["logprobs"]["token_logprobs"]) == z1["usage"]["prompt_tokens"]
    assert math.isfinite(ch["logprobs"]["token_logprobs"][-1]) and ch["finish_reason"] == "length"
    server.assert_healthy()
    # without echo a 0-token completion returns nothing: OpenAI and vLLM answer 400 (it was a 200 with text "")
    for stream in (False, True):
        z2 = complete(server, 400, prompt="Your answer: Yes", max_tokens=0, temperature=0, stream=stream)
        assert z2["error"]["param"] == "max_tokens" and "echo" in z2["error"]["message"], z2
    r = server.post("/v1/completions/render", {"model": MODEL, "prompt": "Your answer: Yes", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text  # as the route runs it
    z2 = complete(server, prompt="Your answer: Yes", max_tokens=0, echo=True)  # echo alone: the prompt back
    assert z2["choices"][0]["text"] == "Your answer: Yes" and z2["usage"]["completion_tokens"] == 0
    server.assert_healthy()
    z3 = complete(server, 400, prompt="Your answer: Yes", echo=True, logprobs=1, max_tokens=-1)
    assert "max_tokens" in (z3["error"]["param"] or "") + z3["error"]["message"]
    server.assert_healthy()


def test_logprobs_shape_without_echo(server):
    r = complete(server, prompt="The sky is", max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 == r["usage"]["completion_tokens"]
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    for tok, lpv, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert 3 <= len(top) <= 4 and tok in top and top[tok] == lpv
        assert max(top.values()) == lpv  # greedy picks the best token


# --------------------------------------------------------------------------- C15 token-id prompts
def test_token_id_prompts_c15(server):
    ids = server.tok("The capital of France is")["tokens"]
    ids2 = server.tok("Two plus two equals")["tokens"]
    q = {"max_tokens": 8, "temperature": 0}
    k1 = complete(server, prompt="The capital of France is", **q)
    for prompt in (ids, [ids]):
        k = complete(server, prompt=prompt, **q)
        assert k["choices"][0]["text"] == k1["choices"][0]["text"]
        assert k["usage"]["prompt_tokens"] == k1["usage"]["prompt_tokens"]
    k4 = complete(server, prompt=[ids, ids2], **q)
    assert [c["index"] for c in k4["choices"]] == [0, 1]
    assert k4["choices"][0]["text"] == k1["choices"][0]["text"]
    k5 = complete(server, prompt=ids, echo=True, **q)
    detok = server.post("/detokenize", {"model": MODEL, "tokens": ids}).json()["prompt"]
    assert k5["choices"][0]["text"].startswith(detok)
    vocab = 49152
    for bad in ([vocab], [-1], [1.5], ["a", 3], [[ids[0]], "x"]):
        r = complete(server, 400, prompt=bad, max_tokens=4)
        assert r["error"]["message"] and r["error"]["code"] == 400
    server.assert_healthy()
    k7 = complete(server, prompt=["The capital of France is", "Two plus two equals"], n=2, temperature=0.8, seed=1,
                  max_tokens=4, ignore_eos=True)
    assert sorted(c["index"] for c in k7["choices"]) == [0, 1, 2, 3]
    assert k7["usage"]["completion_tokens"] == 16
    # choice p*2+j belongs to prompt p: with echo, its text starts with that prompt
    k7e = complete(server, prompt=["The capital of France is", "Two plus two equals"], n=2, temperature=0.8,
                   seed=1, max_tokens=2, echo=True)
    for c in k7e["choices"]:
        assert c["text"].startswith(["The capital of France is", "Two plus two equals"][c["index"] // 2])


# --------------------------------------------------------------------------- C17 greedy equivalence
def test_greedy_equivalence_c17(server):
    p = "Write one sentence about rivers."
    g0 = complete(server, prompt=p, temperature=0, max_tokens=32)["choices"][0]["text"]
    assert complete(server, prompt=p, temperature=1.0, top_k=1, max_tokens=32)["choices"][0]["text"] == g0
    assert complete(server, prompt=p, temperature=0, max_tokens=32, seed=5, top_p=0.5,
                    top_k=10)["choices"][0]["text"] == g0
    for _ in range(2):
        assert complete(server, prompt=p, temperature=0, max_tokens=32)["choices"][0]["text"] == g0
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: complete(server, prompt=p, temperature=0, max_tokens=32), range(8)))
    assert all(o["choices"][0]["text"] == g0 for o in outs)
    g5 = complete(server, prompt=p, temperature=0, max_tokens=32, n=2)
    assert [c["text"] for c in g5["choices"]] == [g0, g0]


# --------------------------------------------------------------------------- C18 tiny top_p / temperature
def test_tiny_top_p_and_temperature_c18(server):
    q = {"prompt": "The sky is", "max_tokens": 16}
    g = complete(server, **q, temperature=0)["choices"][0]["text"]
    variants = [{"temperature": 1e-4}, {"temperature": 1.0, "top_p": 1e-4}, {"temperature": 1.0, "min_p": 1.0},
                {"temperature": 1e-6, "top_p": 1e-6, "logprobs": 3}]
    with ThreadPoolExecutor(4) as pool:  # T1, T2, T5, T3 in one batch
        outs = list(pool.map(lambda v: complete(server, **q, **v), variants))
    assert [o["choices"][0]["text"] for o in outs] == [g] * 4
    t3 = outs[3]
    assert all(x is None or math.isfinite(x) for x in t3["choices"][0]["logprobs"]["token_logprobs"])
    t4 = complete(server, 400, **q, temperature=1.0, top_p=0)
    assert "top_p" in (t4["error"]["param"] or "") + t4["error"]["message"]
    server.assert_healthy()


# --------------------------------------------------------------------------- C21 penalties
def test_penalty_scope_c21(server):
    p = "Paris Paris Paris Paris Paris Paris Paris Paris"
    r0 = complete(server, prompt=p, max_tokens=1, temperature=0, logprobs=5)
    r1 = complete(server, prompt=p, max_tokens=1, temperature=0, logprobs=5, presence_penalty=2.0,
                  frequency_penalty=2.0)
    assert r1["choices"][0]["text"] == r0["choices"][0]["text"]
    first = r0["choices"][0]["logprobs"]["tokens"][0]
    prompt_ids = server.tok(p)["tokens"]
    first_id = server.tok(first)["tokens"]
    r2 = complete(server, prompt=p, max_tokens=1, temperature=0, logprobs=5, repetition_penalty=10.0)
    if len(first_id) == 1 and first_id[0] in prompt_ids:
        assert r2["choices"][0]["text"] != r0["choices"][0]["text"]
    q = {"prompt": p, "max_tokens": 12, "temperature": 0, "frequency_penalty": 1.5}
    assert stream_text(streamed(server, **q)) == complete(server, **q)["choices"][0]["text"]
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)):
        err = complete(server, 400, prompt=p, max_tokens=4, **{field: value})["error"]
        assert err["param"] == field or field in err["message"]


def _running(server) -> float:
    for line in server.http.get("/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_running in /metrics")


def test_multi_prompt_validated_before_anything_runs(server):
    """Several prompts: the engine checks them all before the response starts; one that
    does not fit the context fails the request with a 400 (streaming or not) and the
    good prompt is not left running."""
    h = server.tok("hello")["tokens"][0]
    max_len = server.tok("hi")["max_model_len"]
    for stream in (False, True):
        body = {"model": MODEL, "prompt": [[h] * 4, [h] * max_len], "max_tokens": 400, "ignore_eos": True,
                "stream": stream}
        with server.http.stream("POST", "/v1/completions", json=body) as r:
            r.read()
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
        err = no_nonfinite(r.text)["error"]
        assert err["param"] == "prompt" and str(max_len) in err["message"]
        assert _running(server) == 0
    ok = server.post("/v1/completions", {"model": MODEL, "prompt": [[h] * 4, [h] * 5], "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_fan_out_counts_against_admission(server):
    """One call fanning out into many engine requests (tester's fanout.py: 1024 prompts x
    n=16, within the documented limits, counted as one request, held a concurrent 4-token
    chat for 117 s) counts as its 16,384 sequences: past everything the limits hold, it
    runs only on an idle engine, so beside a running stream it is a 429 at once naming
    them; a small chat after the stream runs, and an ordinary n=2 call (2 prompts x 2)
    still works."""
    import time
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as stream:
        next(stream.iter_lines())  # the stream runs
        t = time.monotonic()
        r = server.post("/v1/completions", {"model": MODEL, "prompt": ["hello"] * 1024, "n": 16, "max_tokens": 8})
        assert r.status_code == 429 and time.monotonic() - t < 10, r.text
        assert "16384 sequences" in no_nonfinite(r.text)["error"]["message"] and "Retry-After" in r.headers
    chat = server.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    out = complete(server, prompt=["Hello", "The sky is"], n=2, max_tokens=3, temperature=1, seed=1)
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2, 3]
    assert all(c["finish_reason"] in ("length", "stop") for c in out["choices"])
    assert 4 <= out["usage"]["completion_tokens"] <= 12
    assert _running(server) == 0
