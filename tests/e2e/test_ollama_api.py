"""Ollama's API on the OpenAI server's port (issue 27, item 3), through the real clients:
the ``ollama`` Python client (list, show, ps, chat, generate, streaming, a tool call and
its round trip, embed) and langchain-ollama's ``ChatOllama``, unchanged but for the API
key header, against the shared ``server`` (SmolLM2, float32: greedy text is
batch-invariant, so the Ollama answers equal the OpenAI routes' answers), plus a pooling
server on all-MiniLM-L6-v2 for the embedding routes. Bad input answers Ollama's error
body ``{"error": "<message>"}`` with 400/401/404/501; ``pull`` of a served model succeeds."""
from __future__ import annotations

import json

import httpx
import numpy as np
import ollama
import pytest

from e2e_utils import MODEL, RemoteServer

EMB = "all-MiniLM-L6-v2"
GREEDY = {"temperature": 0, "num_predict": 3}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(srv: RemoteServer, **headers: str) -> ollama.Client:
    auth = {"Authorization": f"Bearer {srv.api_key}"}
    return ollama.Client(host=srv.url_root, headers={**auth, **headers}, timeout=300)


@pytest.fixture(scope="module")
def emb_server(minilm_server):
    return minilm_server


def _error(r: httpx.Response, status: int, *words: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    for w in words:
        assert w in body["error"], body
    return body["error"]


# ----------------------------------------------------------------------------- models
def test_list_show_ps_version(server):
    client = _client(server)
    names = [m.model for m in client.list().models]
    assert names == [f"{MODEL}:latest"]  # as Ollama lists a name without a tag
    context = server.http.get("/v1/models").json()["data"][0]["max_model_len"]
    shown = client.show(MODEL)
    assert {"completion", "tools"} <= set(shown.capabilities) and "embedding" not in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == context
    assert "im_start" in shown.template and shown.details.family == "llama"
    assert client.show(f"{MODEL}:latest").template == shown.template  # Ollama's default tag
    ps = client.ps().models
    assert [m.model for m in ps] == names and ps[0].context_length == context and ps[0].size > 0
    assert httpx.get(server.url_for("api/version")).json()["version"]


# ----------------------------------------------------------------------------- generation
def test_chat_whole_and_streamed_match_openai(server):
    client = _client(server)
    resp = client.chat(MODEL, messages=ASK, options=GREEDY)
    assert resp.done and resp.done_reason == "length" and resp.eval_count == 3
    assert resp.prompt_eval_count > 0 and resp.total_duration >= resp.eval_duration > 0
    want = server.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0)
    assert resp.message.content == want.choices[0].message.content
    parts = list(client.chat(MODEL, messages=ASK, options=GREEDY, stream=True, keep_alive="5m"))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == 3
    assert "".join(p.message.content for p in parts) == resp.message.content


def test_generate_templated_raw_and_format(server):
    client = _client(server)
    templated = client.generate(MODEL, prompt="What is the weather in Paris?", options=GREEDY)
    chat = client.chat(MODEL, messages=ASK, options=GREEDY)
    assert templated.response == chat.message.content  # one user turn through the template
    parts = list(client.generate(MODEL, prompt="Once upon a time", raw=True, options=GREEDY, stream=True))
    want = server.client().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0)
    assert "".join(p.response for p in parts) == want.choices[0].text and parts[-1].eval_count == 3
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = client.generate(MODEL, prompt="Give a number as JSON.", format=schema,
                          options={"temperature": 0, "num_predict": 12})
    assert isinstance(json.loads(out.response)["n"], int)


def test_generate_context_round_trip(server):
    """Ollama's (deprecated) ``context``: a templated answer returns the token ids of its
    prompt and answer, and a request sending them back has that text before its own turn
    (the answer then equals a raw completion of that text)."""
    client = _client(server)
    first = client.generate(MODEL, prompt="My name is Bob.", options=GREEDY)
    text = server.post("/detokenize", {"tokens": first.context}).json()["prompt"]
    assert text.endswith("My name is Bob.<|im_end|>\n<|im_start|>assistant\n" + first.response)
    parts = list(client.generate(MODEL, prompt="What is my name?", context=first.context, options=GREEDY,
                                 stream=True))
    turn = client.generate(MODEL, prompt="What is my name?", raw=True, options={"num_predict": 1}).prompt_eval_count
    whole = server.post("/detokenize", {"tokens": parts[-1].context}).json()["prompt"]
    assert whole.startswith(text) and "What is my name?<|im_end|>" in whole[len(text):]
    raw = client.generate(MODEL, prompt=whole[:len(whole) - len("".join(p.response for p in parts))], raw=True,
                          options=GREEDY)
    assert "".join(p.response for p in parts) == raw.response and parts[-1].prompt_eval_count > turn
    assert client.generate(MODEL, prompt="1, 2,", raw=True, options=GREEDY).context is None  # raw: none, as Ollama
    _error(server.post("/api/generate", {"model": MODEL, "prompt": "x", "context": [10 ** 9]}), 400, "context.0")


def test_tool_call_and_round_trip(server):
    client = _client(server)
    resp = client.chat(MODEL, messages=ASK, tools=TOOLS, options={"temperature": 0, "num_predict": 40})
    (call,) = resp.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments["city"], str)
    messages = [*ASK, resp.message, {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 21 C"}]
    r = server.post("/api/chat", {"model": MODEL, "messages": [m if isinstance(m, dict) else m.model_dump(
        exclude_none=True) for m in messages], "tools": TOOLS, "options": GREEDY, "stream": False})
    assert r.status_code == 200 and r.headers["x-llmserve-tool-choice"] == "none", r.text
    assert r.json()["message"]["content"] and not r.json()["message"].get("tool_calls")


def test_langchain_chat_ollama(server):
    from langchain_ollama import ChatOllama

    llm = ChatOllama(model=MODEL, base_url=server.url_root, temperature=0, num_predict=3,
                     client_kwargs={"headers": {"Authorization": f"Bearer {server.api_key}"}})
    whole = llm.invoke("What is the weather in Paris?")
    assert whole.content and whole.usage_metadata["output_tokens"] == 3
    assert "".join(c.content for c in llm.stream("What is the weather in Paris?")) == whole.content
    called = llm.bind_tools(TOOLS).bind(options={"temperature": 0, "num_predict": 40}).invoke(
        "What is the weather in Paris?")
    assert called.tool_calls[0]["name"] == "get_weather" and "city" in called.tool_calls[0]["args"]


# ----------------------------------------------------------------------------- embeddings
def test_embed_and_embeddings(emb_server, server):
    client = _client(emb_server)
    texts = ["The cat sat on the mat.", "Stock markets fell today."]
    out = client.embed(EMB, input=texts)
    want = emb_server.client().embeddings.create(model=EMB, input=texts, encoding_format="float")
    assert len(out.embeddings) == 2 and out.prompt_eval_count == want.usage.prompt_tokens
    np.testing.assert_allclose(out.embeddings, [d.embedding for d in want.data], atol=1e-6)
    old = client.embeddings(EMB, prompt=texts[0]).embedding
    np.testing.assert_allclose(old, out.embeddings[0], atol=1e-6)
    assert "embedding" in client.show(EMB).capabilities


def test_a_chat_model_embeds_through_its_hidden_states(server, hf_model):
    """Ollama embeds with any model; a chat model was a 400 here. Each input's vector is
    its last token's final hidden state, L2-normalised (vLLM's --convert embed pooling of
    a causal LM): transformers' float32 one up to the server's packed 4-bit weights
    (cosine > 0.995 in bfloat16 too; the exact float32 match is tests/pooling/test_llama_pooling.py);
    /v1/embeddings still refuses it (vLLM's rule)."""
    import torch

    client = _client(server)
    texts = ["The cat sat on the mat.", "Hi"]
    out = client.embed(MODEL, input=texts)
    ids = [server.tok(t)["tokens"] for t in texts]
    assert out.prompt_eval_count == sum(len(i) for i in ids)
    for vector, tokens in zip(out.embeddings, ids):
        with torch.inference_mode():
            h = hf_model.model(torch.tensor([tokens])).last_hidden_state[0, -1].float()
        ref = torch.nn.functional.normalize(h, dim=0).numpy()
        assert abs(np.linalg.norm(vector) - 1) < 1e-5 and float(np.dot(vector, ref)) > 0.995  # bf16: 0.9987
    np.testing.assert_allclose(client.embeddings(MODEL, prompt=texts[0]).embedding, out.embeddings[0], atol=1e-6)
    r = server.post("/v1/embeddings", {"model": MODEL, "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


# ----------------------------------------------------------------------------- bad input
def test_errors_in_ollama_shape(server):
    with pytest.raises(ollama.ResponseError) as e:
        _client(server).chat("no-such-model", messages=ASK)
    assert e.value.status_code == 404 and "no-such-model" in e.value.error
    post = server.post
    _error(post("/api/chat", {"model": MODEL, "messages": ASK, "options": {"temperature": "hot"}}), 400,
           "options.temperature")
    _error(post("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "images": ["AA=="]}]}),
           400, "images")
    _error(post("/api/generate", {"model": MODEL, "prompt": "x", "format": "yaml"}), 400, "format")
    _error(post("/api/generate", {"model": MODEL, "prompt": "def f(", "suffix": "  return 1"}), 400, "suffix")
    _error(post("/api/chat", {"model": MODEL, "messages": ASK, "think": True}), 400, "think")
    _error(post("/api/chat", {"model": MODEL, "messages": "hi"}), 400, "messages")
    history = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]
    _error(post("/api/chat", {"model": MODEL, "messages": history}), 400,  # an object, as Ollama's Go map takes it
           "cannot unmarshal string into Go struct field ToolCallFunction.messages.tool_calls.function.arguments")
    _error(server.http.post("/api/generate", content=b"{not json"), 400, "JSON")
    _error(post("/api/pull", {"model": "llama3"}), 404, "model 'llama3' not found", "downloads no models")
    assert _client(server).pull(MODEL).status == "success"  # a served model: pulled already
    _error(httpx.post(server.url_for("api/chat"), json={"model": MODEL, "messages": ASK}), 401)
    loaded = post("/api/generate", {"model": MODEL}).json()  # Ollama's "load the model" request
    assert loaded["done"] and loaded["done_reason"] == "load"
    unloaded = post("/api/chat", {"model": MODEL, "messages": [], "keep_alive": 0}).json()
    assert unloaded["done"] and unloaded["done_reason"] == "unload"


def test_model_names_match_as_ollama_and_an_unknown_one_is_its_404(server):
    """Ollama compares names without regard to case, ``:latest`` being the tag of a name
    without one (its getExistingName), and answers with the name as the request wrote it;
    an unknown name is its 404 body, worded per route as its routes.go does."""
    client = _client(server)
    lower, upper = MODEL.lower(), f"{MODEL.upper()}:LATEST"
    resp = client.chat(lower, messages=ASK, options={"temperature": 0, "num_predict": 1})
    assert resp.model == lower and resp.eval_count == 1
    gen = client.generate(upper, prompt="Hi", options={"temperature": 0, "num_predict": 1})
    assert gen.model == upper and gen.eval_count == 1
    assert client.show(f"{lower}:latest").template == client.show(MODEL).template
    _error(server.post("/api/chat", {"model": f"{MODEL}:1b", "messages": ASK}), 404)  # another tag: another model
    for path, body, message in (
            ("/api/chat", {"messages": ASK}, "model 'no-such' not found"),
            ("/api/generate", {"prompt": "x"}, "model 'no-such' not found"),
            ("/api/show", {}, "model 'no-such' not found"),
            ("/api/embed", {"input": "x"}, 'model "no-such" not found, try pulling it first'),
            ("/api/embeddings", {"prompt": "x"}, 'model "no-such" not found, try pulling it first')):
        r = server.post(path, {"model": "no-such", **body})
        assert r.status_code == 404 and r.json() == {"error": message}, (path, r.text)


@pytest.mark.slow  # 18 s: three prefills of a near-full context; `make test-all`
def test_num_predict_past_the_context_fills_it_and_bad_numbers_name_the_option(server):
    """``num_predict`` above the room the prompt leaves generates until the context is full
    (Ollama's behaviour), on /api/chat and both /api/generate forms, instead of a 400
    naming ``max_tokens``; NaN and out-of-range options are one-line errors naming the
    option, not pydantic's report."""
    max_len = server.http.get("/v1/models").json()["data"][0]["max_model_len"]
    def count(n: int) -> int:
        msgs = [{"role": "user", "content": " ".join(["apple"] * n)}]
        return server.post("/tokenize", {"model": MODEL, "messages": msgs, "add_generation_prompt": True}).json()["count"]

    per_word = count(101) - count(100)  # " apple": one token
    n = (max_len - 8 - count(1)) // per_word
    words = " ".join(["apple"] * n)
    msgs = [{"role": "user", "content": words}]
    room = max_len - count(n)
    assert 0 < room < 40, room
    cut = len(words)
    opts = {"temperature": 0, "num_predict": 1000}
    chat = server.post("/api/chat", {"model": MODEL, "messages": msgs, "stream": False, "options": opts})
    assert chat.status_code == 200, chat.text
    assert chat.json()["eval_count"] <= room and chat.json()["done"]
    gen = server.post("/api/generate", {"model": MODEL, "prompt": words[:cut], "stream": False, "options": opts})
    assert gen.status_code == 200 and gen.json()["eval_count"] <= room, gen.text
    raw = server.post("/api/generate", {"model": MODEL, "prompt": words[:cut], "raw": True, "stream": False,
                                        "options": opts})
    assert raw.status_code == 200 and raw.json()["eval_count"] < max_len, raw.text
    for key, value in (("temperature", float("nan")), ("seed", 2 ** 70), ("top_k", float("inf"))):
        body = json.dumps({"model": MODEL, "messages": ASK, "options": {key: value}}).encode()
        msg = _error(server.http.post("/api/chat", content=body, headers={"content-type": "application/json"}),
                     400, f"options.{key}")
        assert "pydantic" not in msg and "\n" not in msg, msg


def test_logprobs_as_ollama_sends_them(server):
    """Agent-door trial: ``logprobs`` / ``top_logprobs`` (Ollama 0.12.11+, the ollama
    client's arguments) were a 400 'not served on Ollama's routes'. Each token's
    ``logprobs`` entry (token, logprob, bytes, top_logprobs) now equals the chat route's,
    whole and streamed; raw /api/generate gives its tokens too, without alternatives at
    top_logprobs 0; top_logprobs outside 0-20 is Ollama's 400."""
    client = _client(server)
    want = server.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0,
                                                   logprobs=True, top_logprobs=2).choices[0].logprobs.content
    got = server.post("/api/chat", {"model": MODEL, "messages": ASK, "options": GREEDY, "stream": False,
                                    "logprobs": True, "top_logprobs": 2}).json()["logprobs"]  # the client drops bytes
    assert [(g["token"], g["bytes"], [t["token"] for t in g["top_logprobs"]]) for g in got] == \
        [(w.token, w.bytes, [t.token for t in w.top_logprobs]) for w in want]
    np.testing.assert_allclose([g["logprob"] for g in got], [w.logprob for w in want], atol=1e-4)
    resp = client.chat(MODEL, messages=ASK, options=GREEDY, logprobs=True, top_logprobs=2)
    assert [(lp.token, len(lp.top_logprobs)) for lp in resp.logprobs] == [(w.token, 2) for w in want]
    parts = list(client.chat(MODEL, messages=ASK, options=GREEDY, stream=True, logprobs=True, top_logprobs=2))
    assert [lp.token for p in parts for lp in (p.logprobs or [])] == [w.token for w in want]
    raw = client.generate(MODEL, prompt="The capital of France is", raw=True, options=GREEDY, logprobs=True)
    assert "".join(lp.token for lp in raw.logprobs) == raw.response and len(raw.logprobs) == raw.eval_count
    assert all(lp.top_logprobs is None for lp in raw.logprobs)
    _error(server.post("/api/chat", {"model": MODEL, "messages": ASK, "logprobs": True, "top_logprobs": 21}), 400,
           "top_logprobs must be between 0 and 20")
