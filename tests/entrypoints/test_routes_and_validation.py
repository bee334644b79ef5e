"""Issue 10: routes users expect (``GET /v1/models/{id}``, SageMaker's ``/invocations``),
validation error bodies (vLLM's location format, small, no echo of the body), no 5xx
for unsupported features. The app runs over the scripted engine stub of test_app."""
from __future__ import annotations

import json

from test_app import CHAT, _output, app_and_engine  # noqa: F401 (fixture)


def test_retrieve_model(app_and_engine):  # noqa: F811
    client, _ = app_and_engine()
    card = client.get("/v1/models/m").json()
    assert (card["id"], card["object"], card["max_model_len"]) == ("m", "model", 64)
    r = client.get("/v1/models/x")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["message"].startswith("The model `x` does not exist.")
    assert (err["type"], err["code"], err["param"]) == ("NotFoundError", 404, "model")
    assert client.get("/v1/models/org/x").status_code == 404


def test_invocations_route_by_shape(app_and_engine):  # noqa: F811
    client, engine = app_and_engine()
    engine.outputs = [_output("Hello", "stop")]
    chat = client.post("/invocations", json=CHAT).json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == "Hello"
    assert engine.prompts[-1]["prompt"].startswith("<|im_start|>")  # through the chat template
    cmpl = client.post("/invocations", json={"prompt": "hi", "max_tokens": 3}).json()
    assert cmpl["object"] == "text_completion" and cmpl["choices"][0]["text"] == "Hello"
    assert engine.prompts[-1]["prompt"] == "hi"
    r = client.post("/invocations", json={"input": "hi"})  # embeddings: the endpoint's own answer
    assert r.status_code == client.post("/v1/embeddings", json={"input": "hi"}).status_code
    assert 400 <= r.status_code < 500
    r = client.post("/invocations", json={"messages": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post("/invocations", json={"foo": 1})
    assert r.status_code == 400 and "'messages' (ChatCompletionRequest)" in r.json()["error"]["message"]
    r = client.post("/invocations", content=b"{bad", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert client.get("/ping").status_code == 200


def test_validation_errors_are_small_and_never_echo_the_body(app_and_engine):  # noqa: F811
    client, _ = app_and_engine()
    # a 150 KB invalid body: 4,000 list items of the wrong type (under the 4,096-message limit)
    body = {"model": "m", "messages": [{"role": "user", "content": 12345678} for _ in range(4000)]}
    raw = json.dumps(body)
    assert len(raw) > 150_000
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert len(r.content) < 4096
    err = r.json()["error"]
    assert err["param"] == "messages"
    assert err["message"].startswith("messages.0.content.str: Input should be a valid string")
    assert "12345678" not in err["message"]
    assert err["message"].endswith("more errors")
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": "lots"})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "max_tokens: Input should be a valid integer, unable to parse "
                                            "string as an integer", "type": "BadRequestError",
                                 "param": "max_tokens", "code": 400}


def test_logit_bias_keys_reach_the_engine_as_sent(app_and_engine):  # noqa: F811
    # The InputProcessor (tests/engine/test_logit_bias.py) names the keys that are not
    # token ids with the vocabulary size; the server clamps values and passes keys through.
    client, engine = app_and_engine()
    engine.outputs = [_output("Hi", "stop")]
    r = client.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"a": 1, "5": 1e6, "b c": -300}})
    assert r.status_code == 200
    assert engine.params[-1].logit_bias == {"a": 1.0, 5: 100.0, "b c": -100.0}


def test_stream_options_without_include_usage_send_no_usage(app_and_engine):  # noqa: F811
    client, engine = app_and_engine()
    engine.outputs = [_output("Hi", "stop")]
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": "m", "prompt": "x"})):
        for opts in ({}, {"continuous_usage_stats": True}):
            r = client.post(path, json={**body, "stream": True, "stream_options": opts})
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            assert events and all(e.get("usage") is None for e in events), (path, opts)
        r = client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 1


def test_score_with_one_side_names_every_accepted_pairing(app_and_engine):  # noqa: F811
    """Fresh-user trial: /score with ``queries`` alone answered "`documents` is required
    with `queries`", hiding ``items``. The 400 names every field that pairs with the given
    one, then every pairing of vLLM's ScoreRequest forms (checked before any engine call)."""
    client, _ = app_and_engine()
    pairings = "`text_1`/`text_2`, `queries`/`documents`, `queries`/`items` or `data_1`/`data_2`"
    for body, param, partners in (({"queries": "q"}, "documents", "`documents` or `items`"),
                                  ({"items": ["a"]}, "queries", "`queries`"),
                                  ({"text_1": "a"}, "text_2", "`text_2`"),
                                  ({"data_2": ["b"]}, "data_1", "`data_1`")):
        r = client.post("/score", json={"model": "m", **body})
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert err["param"] == param, (body, err)
        given = next(iter(body))
        assert f"`{given}` needs the other side, {partners}:" in err["message"], err
        assert pairings in err["message"], err
    none = client.post("/v1/score", json={"model": "m"}).json()["error"]
    assert none["param"] == "text_1" and pairings in none["message"]
