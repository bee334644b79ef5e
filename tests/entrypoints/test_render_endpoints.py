"""``/v1/completions/render`` and ``/v1/chat/completions/render`` (vLLM's renderer API,
what vllm-router's kv_aware policy asks before it falls back to /tokenize): the token ids
the generate handlers would run, as vLLM's GenerateRequest, without generating."""
from __future__ import annotations

from test_app import app_and_engine  # noqa: F401 (fixture)

MSGS = [{"role": "user", "content": "hi"}]


def test_completions_render_is_a_list_of_generate_requests_with_tokenizes_ids(app_and_engine):  # noqa: F811
    client, engine = app_and_engine()
    r = client.post("/v1/completions/render", json={"model": "m", "prompt": ["Hello world", "Goodbye"],
                                                     "max_tokens": 3, "temperature": 0.25, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    data = r.json()
    assert isinstance(data, list) and len(data) == 2
    for item, prompt in zip(data, ["Hello world", "Goodbye"]):
        assert item["request_id"].startswith("cmpl-") and item["model"] == "m"
        assert item["token_ids"] == client.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
        sp = item["sampling_params"]
        assert (sp["max_tokens"], sp["temperature"]) == (3, 0.25) and "all_stop_token_ids" not in sp
        assert item["stream"] is True and item["priority"] == 0 and item["token_offsets"] is None
    assert engine.prompts == []  # nothing generated


def test_chat_render_is_one_generate_request_with_the_templates_ids(app_and_engine):  # noqa: F811
    client, _ = app_and_engine()
    r = client.post("/v1/chat/completions/render", json={"model": "m", "messages": MSGS, "top_p": 0.5})
    assert r.status_code == 200
    data = r.json()
    assert isinstance(data, dict) and data["request_id"].startswith("chatcmpl-")
    assert data["token_ids"] == client.post("/tokenize", json={"messages": MSGS}).json()["tokens"]
    assert data["sampling_params"]["top_p"] == 0.5 and data["stream"] is False


def test_render_errors_are_openai_bodies(app_and_engine):  # noqa: F811
    client, _ = app_and_engine()
    for path, body in (("/v1/completions/render", {"model": "x", "prompt": "a"}),
                       ("/v1/chat/completions/render", {"model": "x", "messages": MSGS})):
        r = client.post(path, json=body)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = client.post("/v1/completions/render", json={"model": "m", "prompt": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = client.post("/v1/chat/completions/render", json={"model": "m", "messages": MSGS, "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
