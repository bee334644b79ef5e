"""``/classify``, ``/score`` and ``/rerank`` on a served cross-encoder (a tiny random
BertForSequenceClassification with one label, detected as a classification model): the
scores are the head's sigmoid on each (query, document) pair as transformers computes it,
not the cosine of embeddings; endpoints the model cannot serve answer 400."""
from __future__ import annotations

import os
import sys
import time

import httpx

import pytest
import torch

from e2e_utils import RemoteServer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pooling"))
from classify_utils import hf_logits, save_bert_classifier  # noqa: E402

MODEL = "tiny-cross-encoder"
QUERY = "what is a cat"
#: The served chat template (the BERT tokenizer has none): each message's text and a space.
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
DOCS = ["Paris is in France.", "A cat is a small animal that purrs.", "Bananas.", "Cats and dogs."]
ATOL = 1e-4


@pytest.fixture(scope="module")
def ce(tmp_path_factory):
    """(server, HF model, tokenizer) of the tiny cross-encoder."""
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("cross_encoder"))
    hf = save_bert_classifier(path, 1)
    srv = RemoteServer(["--model", path, "--served-model-name", MODEL, "--dtype", "float32",
                        "--max-model-len", "128", "--kv-cache-memory", "16MiB",
                        "--max-finished-request-timelines", "4096", "--chat-template", TEMPLATE])
    yield srv, hf, AutoTokenizer.from_pretrained(path)
    srv.stop()


def _ok(r):
    assert r.status_code == 200, r.text
    return r.json()


def _err(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["param"] == param, err
    return err


def _sigmoid_of(hf, tok, text, pair=None) -> float:
    enc = tok(text, pair)
    return torch.sigmoid(hf_logits(hf, input_ids=[enc.input_ids], token_type_ids=[enc.token_type_ids]))[0, 0].item()


def test_classify_score_rerank_by_the_cross_encoder_head(ce):
    srv, hf, tok = ce
    texts = ["Hi", "A much longer input that has many more tokens than the first one does."]
    for path in ("/classify", "/v1/classify"):
        out = _ok(srv.post(path, {"model": MODEL, "input": texts}))
        assert out["object"] == "list" and out["model"] == MODEL and out["id"].startswith("classify-")
        for i, (d, text) in enumerate(zip(out["data"], texts)):
            assert (d["index"], d["label"], d["num_classes"]) == (i, "LABEL_0", 1)
            assert abs(d["probs"][0] - _sigmoid_of(hf, tok, text)) < ATOL
        assert out["usage"]["prompt_tokens"] == sum(len(tok(t).input_ids) for t in texts)
    want = torch.tensor([_sigmoid_of(hf, tok, QUERY, d) for d in DOCS])
    for path in ("/score", "/v1/score"):
        got = _ok(srv.post(path, {"model": MODEL, "text_1": QUERY, "text_2": DOCS}))
        assert torch.allclose(torch.tensor([d["score"] for d in got["data"]]), want, atol=ATOL)
        assert got["usage"]["prompt_tokens"] == sum(len(tok(QUERY, d).input_ids) for d in DOCS)
    order = torch.argsort(-want).tolist()
    assert len(set(order[:2])) == 2 and want[order[1]] - want[order[2]] > 1e-3  # a clear top 2
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        rr = _ok(srv.post(path, {"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 2}))
        assert [r["index"] for r in rr["results"]] == order[:2]
        assert [r["document"]["text"] for r in rr["results"]] == [DOCS[i] for i in order[:2]]
        assert all(abs(r["relevance_score"] - want[r["index"]].item()) < ATOL for r in rr["results"])
    every = _ok(srv.post("/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS}))
    assert [r["index"] for r in every["results"]] == order
    raw = _ok(srv.post("/score", {"model": MODEL, "text_1": QUERY, "text_2": DOCS[:1], "use_activation": False}))
    assert abs(torch.sigmoid(torch.tensor(raw["data"][0]["score"])).item() - want[0].item()) < ATOL


def test_endpoints_the_cross_encoder_cannot_serve_are_400(ce):
    srv, _, _ = ce
    err = _err(srv.post("/v1/embeddings", {"model": MODEL, "input": "hi"}), "model")
    assert "Embeddings API" in err["message"] and "--convert embed" in err["message"]
    assert "needs one label" not in err["message"]  # that hint is for score/rerank only
    err = _err(srv.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}), "model")
    assert "/classify" in err["message"]
    _err(srv.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
         "model")
    _err(srv.post("/classify", {"model": MODEL, "input": []}), "input")
    _err(srv.post("/score", {"model": MODEL, "text_1": ["a", "b"], "text_2": DOCS}), "text_1")
    _err(srv.post("/rerank", {"model": MODEL, "query": QUERY, "documents": []}), "documents")
    # at most 1024 texts, as the other pooling routes' inputs (a 40,000-document rerank held others back)
    _err(srv.post("/rerank", {"model": MODEL, "query": QUERY, "documents": ["d"] * 1025}), "documents")
    _err(srv.post("/score", {"model": MODEL, "text_1": QUERY, "text_2": ["d"] * 1025}), "text_2")
    # a bool is not a token count (pydantic's lax int read true as 1)
    _err(srv.post("/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS, "truncate_prompt_tokens": True}),
         "truncate_prompt_tokens")


def test_deprecated_activation_names_and_rerank_usage(ce):
    """vLLM still reads ``softmax`` / ``activation`` as ``use_activation``; rerank usage
    has prompt_tokens beside total_tokens."""
    srv, hf, tok = ce
    logit = hf_logits(hf, **{k: [v] for k, v in tok(QUERY).items() if k != "attention_mask"})[0, 0].item()
    for name in ("softmax", "activation"):
        out = _ok(srv.post("/v1/classify", {"model": MODEL, "input": QUERY, name: False}))
        assert abs(out["data"][0]["probs"][0] - logit) < ATOL
    rr = _ok(srv.post("/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS[:2], "activation": False}))
    for r in rr["results"]:  # the pair's raw logit, not its sigmoid
        enc = tok(QUERY, DOCS[r["index"]])
        raw = hf_logits(hf, input_ids=[enc.input_ids], token_type_ids=[enc.token_type_ids])[0, 0].item()
        assert abs(r["relevance_score"] - raw) < ATOL
    logs = srv.logs()  # read as use_activation: not logged as an ignored field
    assert "'softmax' is not used" not in logs and "'activation' is not used" not in logs
    assert rr["usage"]["prompt_tokens"] == rr["usage"]["total_tokens"] == sum(len(tok(QUERY, d).input_ids)
                                                                             for d in DOCS[:2])


def test_truncation_keeps_the_query_of_each_pair(ce):
    """truncate_prompt_tokens (-1: max_model_len 128) cuts each (query, document) pair the
    way the tokenizer's truncation=True does: the document's end goes, [CLS] query [SEP]
    stays, so the score still depends on the query (users' bug: keeping the last tokens
    of the joined pair scored every query the same)."""
    srv, hf, tok = ce
    doc = "Paris is a city in France. " * 40
    got = {}
    for query in (QUERY, "bananas"):
        enc = tok(query, doc, truncation=True, max_length=128)
        want = torch.sigmoid(hf_logits(hf, input_ids=[enc.input_ids], token_type_ids=[enc.token_type_ids]))[0, 0]
        rr = _ok(srv.post("/v1/rerank", {"model": MODEL, "query": query, "documents": [doc],
                                          "truncate_prompt_tokens": -1}))
        got[query] = rr["results"][0]["relevance_score"]
        assert abs(got[query] - want.item()) < ATOL
    assert abs(got[QUERY] - got["bananas"]) > 1e-4
    one = _ok(srv.post("/classify", {"model": MODEL, "input": doc, "truncate_prompt_tokens": 16}))
    assert one["usage"]["prompt_tokens"] == 16
    enc = tok(doc, truncation=True, max_length=16)  # [CLS] kept: what BERT's head pools
    want = torch.sigmoid(hf_logits(hf, input_ids=[enc.input_ids], token_type_ids=[enc.token_type_ids]))[0, 0].item()
    assert abs(one["data"][0]["probs"][0] - want) < ATOL


def _rerank_rows(srv) -> list:
    return [r for r in srv.http.get("/v1/requests", params={"limit": 2000}).json()["data"]
            if r["id"].startswith("rerank-")]


def test_a_client_that_goes_away_aborts_its_rerank(ce):
    """A rerank whose client disconnects is aborted (as chat and completions are), not run
    to the end for nobody: fewer than its 1024 pairs complete. A run in which all 1024
    completed before the client's 0.2 s timeout proves nothing and is tried again (up to 3)."""
    srv = ce[0]
    docs = [f"document {i} is about the rain in a small town by the sea. " * 8 for i in range(1024)]
    for _ in range(3):
        before = {r["id"] for r in _rerank_rows(srv)}
        with pytest.raises(httpx.TimeoutException):
            srv.http.post("/rerank", json={"model": MODEL, "query": QUERY, "documents": docs}, timeout=0.2)
        deadline, rows = time.time() + 60, []
        while time.time() < deadline:  # until what reached the engine has ended
            time.sleep(0.5)
            rows = [r for r in _rerank_rows(srv) if r["id"] not in before]
            if all(r["state"] == "finished" for r in rows):
                break
        completed = sum(r["finish_reason"] != "abort" for r in rows)
        if completed < len(docs):
            break
    assert completed < len(docs), f"all {completed} pairs ran for a client that had gone"
    assert srv.http.get("/health").status_code == 200
    assert _ok(srv.post("/rerank", {"model": MODEL, "query": QUERY, "documents": DOCS[:1]}))["results"]


def test_score_takes_vllms_newer_field_names(ce):
    """vLLM's ScoreRequest forms (entrypoints/pooling/scoring/protocol.py): ``queries`` with
    ``documents`` or ``items``, and ``data_1``/``data_2``, score as ``text_1``/``text_2``;
    one naming per request: a mix or a missing side is a 400 naming the field."""
    srv = ce[0]
    want = _ok(srv.post("/score", {"model": MODEL, "text_1": QUERY, "text_2": DOCS[:2]}))
    for a, b in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):
        got = _ok(srv.post("/v1/score", {"model": MODEL, a: QUERY, b: DOCS[:2]}))
        assert [d["score"] for d in got["data"]] == pytest.approx([d["score"] for d in want["data"]], abs=1e-6)
        assert set(got) == set(want) and got["usage"] == want["usage"]
    err = _err(srv.post("/score", {"model": MODEL, "text_1": QUERY, "documents": DOCS}), "documents")
    assert "text_1" in err["message"] and "queries" in err["message"]
    _err(srv.post("/score", {"model": MODEL, "queries": QUERY, "documents": DOCS, "text_2": DOCS}), "text_2")
    _err(srv.post("/score", {"model": MODEL, "queries": QUERY, "documents": DOCS, "items": DOCS}), "items")
    _err(srv.post("/score", {"model": MODEL, "queries": QUERY}), "documents")
    _err(srv.post("/score", {"model": MODEL, "data_2": DOCS}), "data_1")
    _err(srv.post("/score", {"model": MODEL}), "text_1")
    _err(srv.post("/score", {"model": MODEL, "queries": ["a", "b"], "documents": DOCS}), "queries")  # 2 vs 4
    _err(srv.post("/score", {"model": MODEL, "data_1": QUERY, "data_2": []}), "data_2")


def test_invocations_routes_pooling_bodies_of_a_classifier(ce):
    """SageMaker's /invocations on a classifier, as vLLM's pooling invocation types: query +
    documents -> rerank, a score body (any naming) -> score, input or messages -> classify
    (no embeddings or chat handler for a classification model); other bodies stay 400s."""
    srv = ce[0]
    rr = {"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 2}
    assert _ok(srv.post("/invocations", rr))["results"] == _ok(srv.post("/rerank", rr))["results"]
    want = [d["score"] for d in _ok(srv.post("/score", {"model": MODEL, "text_1": QUERY, "text_2": DOCS}))["data"]]
    for a, b in (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2")):
        got = _ok(srv.post("/invocations", {"model": MODEL, a: QUERY, b: DOCS}))
        assert got["data"][0]["object"] == "score"
        assert [d["score"] for d in got["data"]] == pytest.approx(want, abs=1e-6)
    body = {"model": MODEL, "input": DOCS[:2]}
    got, direct = _ok(srv.post("/invocations", body)), _ok(srv.post("/classify", body))
    assert got["id"].startswith("classify-") and got["data"] == direct["data"]
    _err(srv.post("/invocations", {"model": MODEL, "text_1": QUERY, "documents": DOCS}), "documents")
    _err(srv.post("/invocations", {"model": MODEL, "query": QUERY}), "documents")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}  # vLLM's ClassificationChatRequest
    got, direct = _ok(srv.post("/invocations", chat)), _ok(srv.post("/classify", chat))
    assert got["id"].startswith("classify-") and got["data"] == direct["data"]
    r = srv.post("/invocations", {"model": MODEL, "foo": 1})
    assert r.status_code == 400 and "RerankRequest" in r.json()["error"]["message"]


def test_pooling_runs_the_classifier_head_per_token(ce):
    """/pooling on a classifier (vLLM's PoolingRequest.task): "classify" by default (the
    /classify probabilities), "token_classify" the head on every token then its
    activation (sigmoid for one label), ``[num_tokens, 1]``; use_activation=false: logits."""
    srv, hf, tok = ce
    default = _ok(srv.post("/pooling", {"model": MODEL, "input": QUERY}))
    assert default["data"][0]["data"] == pytest.approx(
        _ok(srv.post("/classify", {"model": MODEL, "input": QUERY}))["data"][0]["probs"], abs=1e-6)
    enc = tok(QUERY)
    with torch.inference_mode():
        logits = hf.classifier(hf.bert(torch.tensor([enc.input_ids])).last_hidden_state[0])
    for activation, want in ((True, torch.sigmoid(logits)), (False, logits)):
        out = _ok(srv.post("/pooling", {"model": MODEL, "input": QUERY, "task": "token_classify",
                                        "use_activation": activation}))
        got = torch.tensor(out["data"][0]["data"])
        assert got.shape == (len(enc.input_ids), 1) and torch.allclose(got, want, atol=ATOL)
        assert out["usage"]["prompt_tokens"] == len(enc.input_ids)
    err = _err(srv.post("/pooling", {"model": MODEL, "input": QUERY, "task": "embed"}), "model")
    assert "token_classify" in err["message"]


def test_classify_takes_chat_messages(ce):
    """vLLM's chat-form classify request: ``messages`` through the chat template (the
    server's --chat-template) into one prompt, added special tokens off as the template owns
    them; was a 400 "input: field required"."""
    srv, _, _ = ce
    msgs = [{"role": "system", "content": "be kind"}, {"role": "user", "content": QUERY}]
    got = _ok(srv.post("/classify", {"model": MODEL, "messages": msgs}))
    want = _ok(srv.post("/classify", {"model": MODEL, "input": f"be kind {QUERY} ", "add_special_tokens": False}))
    assert [d["probs"] for d in got["data"]] == [d["probs"] for d in want["data"]] and len(got["data"]) == 1
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    _err(srv.post("/classify", {"model": MODEL}), "input")
    _err(srv.post("/classify", {"model": MODEL, "input": "x", "messages": msgs}), "input")
