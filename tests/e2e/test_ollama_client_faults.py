"""Faults real Ollama clients hit, replayed with those clients against the shared servers
(``server``: SmolLM2 float32; ``minilm_server``: all-MiniLM-L6-v2, 128-token context).

- langchain-ollama's ``bind_tools`` / ``with_structured_output(method="function_calling")``
  on a server without a tool-call parser: the enforced call was an open array, so SmolLM2
  repeated the same call until ``num_predict`` (or, with langchain's default, the whole
  2048-token context: minutes) and the request then failed with "max_tokens ended the
  output before the call was complete". An enforced call is now one call.
- ``/api/embed``: ``options.num_ctx`` bounds each input's tokens (Ollama's EmbedHandler
  cuts to min(num_ctx, the model's context)); it was ignored. ``truncate: false`` over
  the context is Ollama's 400 ``input exceeds maximum context length``; it named
  ``truncate_prompt_tokens``, a field an Ollama client cannot send.
- ``/api/embed`` ``dimensions``: Ollama cuts every model's (unit) vector to its first
  ``dimensions`` values and renormalises; it was a 400 "does not support matryoshka" for
  all-MiniLM, so langchain-ollama's ``OllamaEmbeddings(dimensions=...)`` failed.
- ``/api/generate`` with ``raw: true`` and ``system`` or ``context``: the system text and
  context were dropped without a word; Ollama answers 400 "raw mode does not support
  template, system, or context".
- ``/api/show`` for VS Code Copilot Chat (User-Agent ``GitHubCopilotChat/...``), which
  names a model by ``model_info["general.basename"]``: Ollama puts the name the client
  asked for there; it was the weights' file name. Copilot chats through
  ``/v1/chat/completions`` and turns on agent mode (tools) when ``capabilities`` lists
  "tools": without ``--enable-auto-tool-choice`` that route answers tools with a 400, so
  "tools" is listed to Copilot only when the route takes them.
- ``/api/generate`` ``template`` (a Go template in place of the model's): rendered as
  Ollama renders it (go_template.py); it was a 400.
- ``options.num_predict`` 0 or below -2: Ollama's runner stops on num_predict only above
  0, so both are "no limit" there; 0 gave an empty answer and -3 a 400.
- ``/api/ps``: ``expires_at`` was Go's zero time, which ``ollama ps`` shows as
  "Stopping..."; models here never unload, so it is Ollama's keep-alive-forever time.
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import ollama
import pytest

from e2e_utils import MODEL, RemoteServer

EMB = "all-MiniLM-L6-v2"
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def _client(srv: RemoteServer) -> ollama.Client:
    return ollama.Client(host=srv.url_root, headers={"Authorization": f"Bearer {srv.api_key}"}, timeout=300)


def test_an_enforced_tool_call_is_one_call_not_a_loop(server):
    # SmolLM2 writes [{"name": "add", ...}, {"name": "add", ...}, ... until the budget ran
    # out: with 80 tokens the third call was cut and the request failed.
    resp = _client(server).chat(MODEL, messages=[{"role": "user", "content": "what is 2+3"}], tools=[ADD],
                                options={"temperature": 0, "num_predict": 80})
    assert resp.done_reason == "stop" and resp.eval_count < 80, resp
    (call,) = resp.message.tool_calls
    assert call.function.name == "add" and set(call.function.arguments) == {"a", "b"}


@pytest.mark.parametrize("stream", [False, True])
def test_an_enforced_tool_call_cut_by_num_predict_is_done_reason_length(server, stream):
    # Ollama has no forced tool choice: a budget that ends the output is done_reason
    # "length" with a 200; the call this server enforces was a 400 once cut.
    ask = dict(messages=[{"role": "user", "content": "what is 2+3"}], tools=[ADD],
               options={"temperature": 0, "num_predict": 6})
    if stream:
        last = list(_client(server).chat(MODEL, stream=True, **ask))[-1]
    else:
        last = _client(server).chat(MODEL, **ask)
    assert last.done and last.done_reason == "length" and last.eval_count == 6, last


def test_langchain_bind_tools_and_function_calling_output(server):
    from langchain_ollama import ChatOllama
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    llm = ChatOllama(model=MODEL, base_url=server.url_root, temperature=0, num_predict=80,
                     client_kwargs={"headers": {"Authorization": f"Bearer {server.api_key}"}})
    for name in (MODEL, f"{MODEL}:latest"):  # looks the name up in /api/tags (it listed no :latest)
        ChatOllama(model=name, base_url=server.url_root, validate_model_on_init=True,
                   client_kwargs={"headers": {"Authorization": f"Bearer {server.api_key}"}})
    called = llm.bind_tools([ADD]).invoke("what is 2+3")
    assert [c["name"] for c in called.tool_calls] == ["add"], called
    person = llm.with_structured_output(Person, method="function_calling").invoke("John is 30 years old.")
    assert isinstance(person, Person)


def test_embed_num_ctx_bounds_inputs_and_truncate_false_is_ollamas_400(minilm_server):
    client = _client(minilm_server)
    long_text = "word " * 100  # 102 tokens with [CLS] and [SEP]
    assert client.embed(EMB, input=long_text, options={"num_ctx": 64}).prompt_eval_count == 64
    assert client.embed(EMB, input=long_text).prompt_eval_count == 102
    assert client.embed(EMB, input="word", options={"num_ctx": 64}, truncate=False).prompt_eval_count == 3
    for inputs, options in ((long_text, {"num_ctx": 64}), (["a", "word " * 500], None)):
        with pytest.raises(ollama.ResponseError) as e:
            client.embed(EMB, input=inputs, options=options, truncate=False)
        assert e.value.status_code == 400 and e.value.error.startswith("input exceeds maximum context length")
        assert "truncate_prompt_tokens" not in e.value.error and "truncate" in e.value.error


def test_ps_says_the_models_stay_loaded(server):
    (loaded,) = _client(server).ps().models
    assert loaded.expires_at > datetime.now(timezone.utc) + timedelta(days=365 * 100), loaded.expires_at


def test_embed_dimensions_cut_any_models_vectors_as_ollama_does(minilm_server):
    from langchain_ollama import OllamaEmbeddings

    client = _client(minilm_server)
    full = np.array(client.embed(EMB, input="The cat sat on the mat.").embeddings[0])
    assert full.size == 384 and abs(np.linalg.norm(full) - 1) < 1e-5
    (short,) = client.embed(EMB, input="The cat sat on the mat.", dimensions=8).embeddings
    np.testing.assert_allclose(short, full[:8] / np.linalg.norm(full[:8]), atol=1e-6)
    assert len(client.embed(EMB, input="x", dimensions=0).embeddings[0]) == 384  # Go's 0: unset
    assert len(client.embed(EMB, input="x", dimensions=1000).embeddings[0]) == 384
    lc = OllamaEmbeddings(model=EMB, base_url=minilm_server.url_root, dimensions=8,
                          client_kwargs={"headers": {"Authorization": f"Bearer {minilm_server.api_key}"}})
    np.testing.assert_allclose(lc.embed_query("The cat sat on the mat."), short, atol=1e-6)


def test_raw_generate_refuses_what_it_would_drop(server):
    client = _client(server)
    for extra in ({"system": "Answer in French."}, {"context": [1, 2, 3]}, {"template": "{{ .Prompt }}"}):
        with pytest.raises(ollama.ResponseError) as e:
            client.generate(MODEL, prompt="Hello", raw=True, options={"num_predict": 1}, **extra)
        assert e.value.status_code == 400, extra
        assert e.value.error.startswith("raw mode does not support template, system, or context"), e.value.error
    assert client.generate(MODEL, prompt="Hello", raw=True, options={"num_predict": 1}).eval_count == 1
    # without raw, a request's Go template is rendered as Ollama renders it (it was a 400)
    chatml = "<|im_start|>user\n{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n{{ .Response }}<|im_end|>"
    templated = client.generate(MODEL, prompt="Hello", template=chatml, options={"num_predict": 1, "temperature": 0})
    assert templated.eval_count == 1 and templated.prompt_eval_count == 10 and len(templated.context) == 11, templated


def test_show_gives_copilot_chat_the_name_it_asked_for(server):
    name = f"{MODEL.lower()}:latest"
    copilot = server.http.post("/api/show", json={"model": name}, headers={"User-Agent": "GitHubCopilotChat/0.31.0"})
    # Copilot's flow: the name /api/tags lists (Ollama's name:latest) goes to /v1/chat/completions
    (listed,) = [m["name"] for m in server.http.get("/api/tags").json()["models"]]
    chat = server.post("/v1/chat/completions", {"model": listed, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 1})
    assert listed == f"{MODEL}:latest" and chat.status_code == 200 and chat.json()["model"] == MODEL, chat.text
    assert copilot.status_code == 200 and copilot.json()["model_info"]["general.basename"] == name, copilot.text
    other = server.http.post("/api/show", json={"model": name}).json()
    assert other["model_info"]["general.basename"] != name and other["model_info"]["llama.context_length"] > 0
    # the shared server has no tool-call parser: /api/chat enforces calls, /v1 refuses tools
    assert "tools" in other["capabilities"] and "tools" not in copilot.json()["capabilities"]
    assert "completion" in copilot.json()["capabilities"]
    agent = server.post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "hi"}], "tools": [ADD], "max_tokens": 2})
    assert agent.status_code == 400, agent.text  # what agent mode would have met


def test_num_predict_zero_and_negative_are_no_limit_as_in_ollama(server):
    client = _client(server)
    hi = [{"role": "user", "content": "hi"}]
    unlimited = client.chat(MODEL, messages=hi, options={"temperature": 0, "num_predict": -1})
    assert unlimited.done_reason == "stop" and unlimited.eval_count > 0
    for n in (0, -3):
        resp = client.chat(MODEL, messages=hi, options={"temperature": 0, "num_predict": n})
        assert (resp.done_reason, resp.eval_count, resp.message.content) == \
            ("stop", unlimited.eval_count, unlimited.message.content), n
