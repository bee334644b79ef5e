"""/v1/chat/completions against the real server: streaming vs not, usage, n, stop strings,
logprobs, finish reasons, SSE framing, include_usage, ignore_eos, special tokens and the
chat template (cases C05, C06, C08, C20, C22, C23, C24)."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_utils import MODEL, finish_reasons, no_nonfinite, stream_text

SPECIALS = ("<|im_end|>", "<|endoftext|>", "<|im_start|>")
COUNT = [{"role": "user", "content": "Count to five."}]


def chat(server, **body):
    body.setdefault("model", MODEL)
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_stream_equals_non_stream_with_openai_client(server):
    """C06 A7 / Must show: streamed greedy text == non-streamed greedy text."""
    client = server.client()
    full = client.chat.completions.create(model=MODEL, messages=COUNT, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=COUNT, max_tokens=16, temperature=0, stream=True)
    pieces, roles, finishes = [], [], []
    for chunk in stream:
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            roles.append(ch.delta.role)
            finishes.append(ch.finish_reason)
    assert full.model == MODEL
    assert full.choices[0].message.content
    assert "".join(pieces) == full.choices[0].message.content
    assert roles[0] == "assistant"
    assert finishes[-1] == full.choices[0].finish_reason and all(f is None for f in finishes[:-1])


def test_usage_matches_tokenizer_counts(server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    resp = chat(server, messages=msgs, max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    tok = server.post("/tokenize", {"model": MODEL, "messages": msgs}).json()
    u = resp["usage"]
    assert u["prompt_tokens"] == tok["count"] == len(tok["tokens"])
    assert u["completion_tokens"] == 8 == len(resp["choices"][0]["logprobs"]["content"])
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_multi_turn_and_text_parts(server):
    """Assistant turns and list-of-text-parts content go through the template like strings."""
    turns = [{"role": "system", "content": "You answer in one word."},
             {"role": "user", "content": "Capital of France?"},
             {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": "And of Italy?"}]
    parts = [dict(m, content=[{"type": "text", "text": m["content"]}]) for m in turns]
    a = chat(server, messages=turns, max_tokens=6, temperature=0)
    b = chat(server, messages=parts, max_tokens=6, temperature=0)
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    # max_completion_tokens wins over max_tokens
    c = chat(server, messages=turns, max_tokens=50, max_completion_tokens=2, temperature=0, ignore_eos=True)
    assert c["usage"]["completion_tokens"] == 2


def test_n_3_gives_3_choices(server):
    resp = chat(server, messages=COUNT, n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    assert sorted(c["index"] for c in resp["choices"]) == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in resp["choices"])
    assert resp["usage"]["completion_tokens"] == 18


def test_stop_string_cuts_text_and_sets_finish_reason(server):
    base = chat(server, messages=COUNT, max_tokens=16, temperature=0)["choices"][0]["message"]["content"]
    m = re.search(r"[A-Za-z0-9]{2,}", base[1:])
    assert m, base
    stop = m.group(0)
    cut = base.find(stop)
    assert cut >= 1
    resp = chat(server, messages=COUNT, max_tokens=16, temperature=0, stop=[stop])
    ch = resp["choices"][0]
    assert ch["message"]["content"] == base[:cut]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop
    chunks = server.stream_chunks("/v1/chat/completions", {"model": MODEL, "messages": COUNT, "max_tokens": 16,
                                                            "temperature": 0, "stop": stop, "stream": True})
    assert stream_text(chunks, chat=True) == base[:cut]
    assert finish_reasons(chunks)[-1] == "stop"


def test_logprobs_shape(server):
    resp = chat(server, messages=COUNT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    ch = resp["choices"][0]
    content = ch["logprobs"]["content"]
    assert len(content) == resp["usage"]["completion_tokens"]
    for entry in content:
        assert isinstance(entry["token"], str) and entry["logprob"] <= 0
        assert isinstance(entry["bytes"], list) and all(0 <= b < 256 for b in entry["bytes"])
        tops = entry["top_logprobs"]
        assert len(tops) == 3
        lps = [t["logprob"] for t in tops]
        assert lps == sorted(lps, reverse=True)
        assert tops[0]["token"] == entry["token"] and abs(tops[0]["logprob"] - entry["logprob"]) < 1e-6  # greedy
    text = "".join(e["token"] for e in content)
    assert text.startswith(ch["message"]["content"])
    # logprobs without top_logprobs: the chosen token only
    plain = chat(server, messages=COUNT, max_tokens=3, temperature=0, logprobs=True)
    assert all(e["top_logprobs"] == [] for e in plain["choices"][0]["logprobs"]["content"])
    assert chat(server, messages=COUNT, max_tokens=3)["choices"][0]["logprobs"] is None


def test_finish_reasons_c05(server):
    f2 = chat(server, messages=[{"role": "user", "content": "Hello!"}], max_tokens=1)
    assert f2["choices"][0]["finish_reason"] == "length" and f2["usage"]["completion_tokens"] == 1
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 200, "temperature": 0}
    f3 = chat(server, **body)
    ch = f3["choices"][0]
    assert f3["usage"]["completion_tokens"] < 200
    assert ch["finish_reason"] == "stop" and "<|im_end|>" not in ch["message"]["content"]
    # F5: streamed, exactly one chunk per choice has a finish_reason, equal to the non-streamed one
    for b, expect in ((dict(body), "stop"), ({**body, "messages": [{"role": "user", "content": "Hello!"}],
                                               "max_tokens": 1}, "length")):
        chunks = server.stream_chunks("/v1/chat/completions", {**b, "stream": True})
        reasons = [r for r in finish_reasons(chunks) if r is not None]
        assert reasons == [expect]


def test_sse_framing_c06(server):
    for path, obj, body in (
            ("/v1/chat/completions", "chat.completion.chunk", {"messages": COUNT}),
            ("/v1/completions", "text_completion", {"prompt": "Count to five:"})):
        r, payloads = server.sse_events(path, {"model": MODEL, "max_tokens": 16, "stream": True, **body})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert payloads[-1] == "[DONE]" and all(p != "[DONE]" and p for p in payloads[:-1])
        chunks = [no_nonfinite(p) for p in payloads[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        for c in chunks:
            assert c["object"] == obj and isinstance(c["created"], int) and c["model"] == MODEL
            for ch in c["choices"]:
                assert "finish_reason" in ch
        reasons = finish_reasons(chunks)
        assert reasons[-1] in ("stop", "length") and all(x is None for x in reasons[:-1])
        if obj == "chat.completion.chunk":
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_include_usage_c08(server):
    u1 = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0,
          "stream": True, "stream_options": {"include_usage": True}}
    chunks = server.stream_chunks("/v1/chat/completions", u1)
    last = chunks[-1]
    assert last["choices"] == []
    u = last["usage"]
    assert all(isinstance(u[k], int) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert all(c.get("usage") is None for c in chunks[:-1])
    u2 = {k: v for k, v in u1.items() if k != "stream_options"}
    assert all(c.get("usage") is None for c in server.stream_chunks("/v1/chat/completions", u2))
    r3 = server.post("/v1/chat/completions", {**u1, "stream": False})
    assert r3.status_code == 400
    err = r3.json()["error"]
    assert err["param"] == "stream_options" or "stream_options" in err["message"]
    u4 = chat(server, **{k: v for k, v in u1.items() if k not in ("stream", "stream_options")})
    assert {k: u4["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == \
        {k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    # continuous_usage_stats: running usage on every chunk
    cont = server.stream_chunks("/v1/chat/completions", {**u1, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    done = [c["usage"]["completion_tokens"] for c in cont]
    assert all(c["usage"] is not None for c in cont) and done == sorted(done) and done[-1] == u["completion_tokens"]


def test_ignore_eos_c20(server):
    i1 = {"model": MODEL, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 64,
          "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:  # I1 and I2 together: one batch, half the wall time
        f2 = pool.submit(server.post, "/v1/completions", {"model": MODEL, "prompt": "Say OK.", "max_tokens": 64,
                                                          "ignore_eos": True, "temperature": 0})
        r1 = chat(server, **i1)
        r2 = f2.result().json()
    assert r1["usage"]["completion_tokens"] == 64 and r1["choices"][0]["finish_reason"] == "length"
    t = r1["choices"][0]["message"]["content"]
    assert not any(s in t for s in SPECIALS)
    assert r2["usage"]["completion_tokens"] == 64 and r2["choices"][0]["finish_reason"] == "length"
    chunks = server.stream_chunks("/v1/chat/completions", {**i1, "stream": True, "n": 2, "temperature": 0.7,
                                                           "seed": 9, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens"] == 128
    for i in (0, 1):
        assert [r for r in finish_reasons(chunks, i) if r] == ["length"]
    stop = t[:4]
    r4 = chat(server, **i1, stop=[stop])
    assert r4["choices"][0]["finish_reason"] == "stop"


def test_special_tokens_c22(server):
    s1 = {"model": MODEL, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 24,
          "temperature": 0, "ignore_eos": True}
    variants = {"s1": {}, "s2": {"skip_special_tokens": False, "spaces_between_special_tokens": False},
                "s3": {"skip_special_tokens": False, "spaces_between_special_tokens": True}}
    def run_all(body):
        # the three variants (and their streamed twins) run as one batch: the flags must
        # change decoding only, so batching them is itself part of the check
        with ThreadPoolExecutor(6) as pool:
            full = {k: pool.submit(chat, server, **body, **v) for k, v in variants.items()}
            streams = {k: pool.submit(server.stream_chunks, "/v1/chat/completions", {**body, **v, "stream": True})
                       for k, v in variants.items()}
            return {k: f.result() for k, f in full.items()}, {k: f.result() for k, f in streams.items()}

    out, streams = run_all(s1)
    if not any(s in out["s2"]["choices"][0]["message"]["content"] for s in SPECIALS):
        s1["max_tokens"] = 64
        out, streams = run_all(s1)
    text = {k: o["choices"][0]["message"]["content"] for k, o in out.items()}
    assert any(s in text["s2"] for s in SPECIALS), text["s2"]
    assert not any(s in text["s1"] for s in SPECIALS)

    def strip(s):
        for sp in SPECIALS:
            s = s.replace(sp, "")
        return s

    assert strip(text["s2"]) == text["s1"]
    assert re.sub(r"\s", "", strip(text["s3"])) == re.sub(r"\s", "", strip(text["s2"]))
    assert text["s3"].replace(" ", "") == text["s2"].replace(" ", "")
    assert len({o["usage"]["completion_tokens"] for o in out.values()}) == 1
    assert len({o["choices"][0]["finish_reason"] for o in out.values()}) == 1
    for k in variants:
        assert stream_text(streams[k], chat=True) == text[k], k


def test_chat_template_bos_and_generation_prompt_c23(server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    b1 = server.post("/tokenize", {"model": MODEL, "messages": msgs, "add_generation_prompt": True}).json()
    s = server.post("/detokenize", {"model": MODEL, "tokens": b1["tokens"]}).json()["prompt"]
    b2 = chat(server, messages=msgs, max_tokens=16, temperature=0)
    assert b2["usage"]["prompt_tokens"] == b1["count"] == len(b1["tokens"])
    assert b1["tokens"][0] != b1["tokens"][1]
    b3 = server.post("/v1/completions", {"model": MODEL, "prompt": s, "max_tokens": 16, "temperature": 0}).json()
    assert b3["usage"]["prompt_tokens"] == b2["usage"]["prompt_tokens"]
    assert b3["choices"][0]["text"] == b2["choices"][0]["message"]["content"]
    assert s.endswith("<|im_start|>assistant\n")
    b4 = server.post("/tokenize", {"model": MODEL, "messages": msgs, "add_generation_prompt": False}).json()
    s4 = server.post("/detokenize", {"model": MODEL, "tokens": b4["tokens"]}).json()["prompt"]
    assert not s4.endswith("<|im_start|>assistant\n")
    assert s.count("Be brief.") == 1
    b5 = server.post("/tokenize", {"model": MODEL, "messages": msgs[1:]}).json()
    s5 = server.post("/detokenize", {"model": MODEL, "tokens": b5["tokens"]}).json()["prompt"]
    assert s5.count("<|im_start|>system") <= 1


def test_continue_final_message_c24(server):
    msgs = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "My favourite fruit is the"}]
    q1 = chat(server, messages=msgs, continue_final_message=True, add_generation_prompt=False, max_tokens=8,
              temperature=0)
    q2 = server.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "continue_final_message": True,
                                              "add_generation_prompt": True, "max_tokens": 8})
    assert q2.status_code == 400
    msg = q2.json()["error"]["message"]
    assert "continue_final_message" in msg and "add_generation_prompt" in msg
    q3 = server.post("/tokenize", {"model": MODEL, "messages": msgs, "continue_final_message": True,
                                   "add_generation_prompt": False}).json()
    s = server.post("/detokenize", {"model": MODEL, "tokens": q3["tokens"]}).json()["prompt"]
    assert s.endswith("My favourite fruit is the")
    q4 = server.post("/v1/completions", {"model": MODEL, "prompt": s, "max_tokens": 8, "temperature": 0}).json()
    content = q1["choices"][0]["message"]["content"]
    assert not content.lstrip().startswith("My favourite fruit is the")
    assert content == q4["choices"][0]["text"]
    q5 = server.post("/tokenize", {"model": MODEL, "messages": msgs}).json()
    s5 = server.post("/detokenize", {"model": MODEL, "tokens": q5["tokens"]}).json()["prompt"]
    assert s5.endswith("<|im_start|>assistant\n")
    assert chat(server, messages=msgs, max_tokens=4)["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_zero_output_tokens_is_a_400_unless_echo(server, stream, field):
    """OpenAI and vLLM refuse 0 output tokens on chat ("expected a value >= 1"): a 400
    naming the field, not an empty 200; with ``echo`` (score the prompt) 0 is allowed."""
    from test_errors import assert_error

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], field: 0, "stream": stream}
    assert_error(server.post("/v1/chat/completions", body), 400, field)
    r = server.post("/v1/chat/completions", {**body, field: -1})  # names the bound that 0 fails too
    assert r.status_code == 400 and ">= 1" in r.json()["error"]["message"], r.text
    r = server.post("/v1/chat/completions", {**body, "stream": False, "echo": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0, r.text


