"""llama-server's request fields and route aliases as its users send them, on the shared
``server`` (SmolLM2, float32; MiniLM for ``/embeddings``): ``max_tokens`` /
``max_completion_tokens`` as aliases of ``n_predict``, ``logit_bias``, a budget past the
context, a string ``stop``, a negative ``temperature``, and the routes' other names. Each
case is a few short greedy requests.
"""
import httpx

GREEDY = {"prompt": "1, 2, 3,", "temperature": 0}


def test_max_tokens_is_an_alias_of_n_predict(server):
    """llama-server reads ``n_predict``, else ``max_completion_tokens``, else
    ``max_tokens``. The route ignored both aliases: ``max_tokens: 3`` ran to the context."""
    def run(**fields):
        r = server.http.post("/completion", json={**GREEDY, "stop": ["9"], **fields})
        assert r.status_code == 200, r.text
        return r.json()

    out = run(max_tokens=2)  # without the budget it counts on to the stop word " 9"
    assert (out["tokens_predicted"], out["stop_type"]) == (2, "limit"), out
    assert out["generation_settings"]["n_predict"] == 2
    assert run(max_completion_tokens=1, max_tokens=3)["tokens_predicted"] == 1
    assert run(n_predict=1, max_completion_tokens=2, max_tokens=3)["tokens_predicted"] == 1
    r = server.http.post("/completion", json={**GREEDY, "max_tokens": -2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_logit_bias_in_llama_servers_forms(server):
    """``logit_bias`` as llama-server takes it: ``[[id, bias]]``, ``[["text", bias]]`` and
    ``{"id": bias}``, ``false`` banning the token. The route ignored the field: the banned
    greedy token was still chosen."""
    def first(**fields):
        r = server.http.post("/completion", json={**GREEDY, "n_predict": 1, "return_tokens": True, **fields})
        assert r.status_code == 200, r.text
        return r.json()["tokens"][0]

    top = first()
    assert first(logit_bias=[[top, False]]) != top
    assert first(logit_bias={str(top): False}) != top
    text = server.http.post("/detokenize", json={"tokens": [top]}).json()["prompt"]
    assert first(logit_bias=[[text, False]]) != top
    hello = server.http.post("/tokenize", json={"prompt": " hello", "add_special_tokens": False}).json()["tokens"]
    assert len(hello) == 1 and first(logit_bias=[[hello[0], 100]]) == hello[0]
    assert first(logit_bias={" hello": 100}) == hello[0]
    for bad in ("x", [[1]], [[1, "a"]], {"1": True}, [[10 ** 7, 1]]):
        r = server.http.post("/completion", json={**GREEDY, "n_predict": 1, "logit_bias": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", (bad, r.text)


def test_n_predict_beyond_the_context_stops_at_its_end(server):
    """llama-server caps the prediction at the context; the route refused it with a 400
    naming ``max_tokens``, a field the request never sent."""
    n_ctx = server.http.get("/props").json()["default_generation_settings"]["n_ctx"]
    r = server.http.post("/completion", json={**GREEDY, "n_predict": n_ctx + 1000, "stop": ["9"]})
    assert r.status_code == 200, r.text
    assert r.json()["stop_type"] == "word"
    # a prompt that alone fills the context is still a 400, naming the prompt
    r = server.http.post("/completion", json={"prompt": [16] * (n_ctx + 1), "n_predict": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_a_string_stop_and_a_negative_temperature(server):
    """llama-server takes ``stop`` as a string (one word) and samples greedily at a
    temperature of 0 or below; the route refused both with a 400."""
    body = {"prompt": "1, 2, 3,", "n_predict": 8}
    r = server.http.post("/completion", json={**body, "stop": " 6", "temperature": -0.5})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stop_type"] == "word" and out["stopping_word"] == " 6", out
    assert out["generation_settings"]["stop"] == [" 6"] and out["generation_settings"]["temperature"] == 0.0
    same = server.http.post("/completion", json={**body, "stop": [" 6"], "temperature": 0}).json()
    assert same["content"] == out["content"]


def test_llama_servers_route_aliases(server, minilm_server):
    """llama-server's other names for the routes (404 before): /chat/completions,
    /models, /v1/health, /reranking and /v1/reranking, /embeddings (llama-server's
    /embedding answer, not /v1/embeddings'); each behind the same API key as its original.
    POST /slots/{id}?action=save|restore|erase: a 501 naming ``action``, not a bare 404."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    a = server.http.post("/chat/completions", json=chat)
    b = server.http.post("/v1/chat/completions", json=chat)
    assert a.status_code == b.status_code == 200, a.text
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
    assert server.http.get("/models").json()["data"] == server.http.get("/v1/models").json()["data"]
    assert server.http.get("/v1/health").status_code == 200
    rerank = {"query": "q", "documents": ["a"]}  # a generating model: the same refusal as /rerank's
    refusal = server.http.post("/rerank", json=rerank)
    for path in ("/reranking", "/v1/reranking"):
        r = server.http.post(path, json=rerank)
        assert (r.status_code, r.json()) == (refusal.status_code, refusal.json()), (path, r.text)
    r = minilm_server.http.post("/embeddings", json={"content": "hi"})
    assert r.status_code == 200 and r.json() == minilm_server.http.post("/embedding", json={"content": "hi"}).json()
    for method, path in (("POST", "/chat/completions"), ("GET", "/models"), ("POST", "/reranking"),
                         ("POST", "/embeddings"), ("POST", "/slots/0?action=save")):
        r = httpx.request(method, server.url_root + path, json={})
        assert r.status_code == 401, (path, r.status_code)
    assert httpx.get(server.url_root + "/v1/health").status_code == 200  # public, as /health
    for action in ("save", "restore", "erase"):
        r = server.http.post(f"/slots/0?action={action}", json={"filename": "x.bin"})
        assert r.status_code == 501 and r.json()["error"]["param"] == "action" and action in r.text, r.text
    r = server.http.post("/slots/0?action=<script>x</script>", json={})
    assert r.status_code == 501 and "<script>" not in r.text  # the client's value is not echoed


def test_llama_embeddings_take_input_as_well_as_content(minilm_server):
    """llama-server's /embedding and /embeddings read ``input`` (first) or ``content``;
    ``input`` was refused here (content: required)."""
    want = minilm_server.http.post("/embedding", json={"content": ["hi", "yo"]}).json()
    for path in ("/embedding", "/embeddings"):
        r = minilm_server.http.post(path, json={"input": ["hi", "yo"], "content": "ignored"})
        assert r.status_code == 200 and r.json() == want, (path, r.text)
