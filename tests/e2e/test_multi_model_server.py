"""One ``llmserve serve`` hosting a chat model and an embedding model (issue 11, point 6):
each in its own EngineCore, chosen per request by ``model``; both in /v1/models and in
/metrics (by ``model_name``); 32 chat streams and 32 embedding clients at once, each
answer equal to what a single-model server / the offline ``LLM.embed`` gives."""
from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from e2e_utils import MODEL as CHAT, SERVE_CLI, RemoteServer

# An --extra-model server (own servers, ~13 s); tenants' multi-model rules are in tests/entrypoints; `make test-all` runs it (make test keeps under 15 minutes)
pytestmark = pytest.mark.slow

EMB = "all-MiniLM-L6-v2"
PROMPTS = ["Name a colour.", "Count to five.", "What is the capital of France?", "Say hello."]
SENTS = [f"Sentence number {i} is about {w}." for i, w in
         enumerate(("rivers", "mountains", "coffee", "trains", "music", "Paris", "rain", "kernels") * 4)]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def duo():
    srv = RemoteServer([CHAT, "--extra-model", EMB, "--dtype", "float32", "--kv-cache-memory", "256MiB"],
                       entrypoint=SERVE_CLI)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline_embeddings():
    from llmserve import LLM

    # The reference: the engine in this process (no child process to start; same numbers).
    llm = LLM(EMB, dtype="float32", kv_cache_memory="64MiB", multiprocess_mode=False)
    try:
        return np.array([o.outputs.embedding for o in llm.embed(SENTS, use_tqdm=False)])
    finally:
        llm.shutdown()


def _chat_texts(srv: RemoteServer, prompts: list[str]) -> list[str]:
    client = srv.client()
    return [client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": p}],
                                           max_tokens=MAX_TOKENS, temperature=0).choices[0].message.content
            for p in prompts]


async def _load(srv: RemoteServer) -> tuple[list[str], list[list[float]]]:
    client = srv.async_client(timeout=600.0)

    async def chat(i: int) -> str:
        stream = await client.chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            max_tokens=MAX_TOKENS, temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def embed(i: int) -> list[float]:
        if i % 3 == 0:  # no format: the client asks for base64 and decodes it itself
            return (await client.embeddings.create(model=EMB, input=SENTS[i])).data[0].embedding
        if i % 3 == 1:
            return (await client.embeddings.create(model=EMB, input=SENTS[i], encoding_format="float")).data[0].embedding
        b64 = (await client.embeddings.create(model=EMB, input=SENTS[i], encoding_format="base64")).data[0].embedding
        return np.frombuffer(base64.b64decode(b64), dtype="<f4").tolist()

    try:
        res = await asyncio.gather(*(chat(i) for i in range(32)), *(embed(i) for i in range(32)))
    finally:
        await client.close()
    return res[:32], res[32:]


def test_32_chat_streams_and_32_embedding_clients_at_once(duo, server, offline_embeddings):
    texts, vecs = asyncio.run(_load(duo))
    # chat: greedy text equals the single-model server's (float32: batch-invariant)
    want = dict(zip(PROMPTS, _chat_texts(server, PROMPTS)))
    assert all(want.values())
    assert texts == [want[PROMPTS[i % len(PROMPTS)]] for i in range(32)]
    # embeddings: equal to the offline LLM.embed
    got = np.array(vecs)
    cos = (got * offline_embeddings).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(offline_embeddings, axis=1)
    assert got.shape == (32, 384) and cos.min() >= 1 - 1e-5


def test_models_metrics_and_tokenizers_of_both(duo):
    cards = duo.http.get("/v1/models").json()["data"]
    assert [(c["id"], c["max_model_len"]) for c in cards] == [(CHAT, 2048), (EMB, 512)]
    assert duo.http.get(f"/v1/models/{EMB}").json()["id"] == EMB
    # each model tokenizes with its own tokenizer (BERT adds [CLS] ... [SEP])
    assert duo.post("/tokenize", {"model": EMB, "prompt": "Hello my name is"}).json()["count"] == 6
    assert duo.post("/tokenize", {"model": CHAT, "prompt": "Hello my name is"}).json()["count"] == 4
    duo.post("/v1/embeddings", {"model": EMB, "input": "count me"})
    duo.post("/v1/completions", {"model": CHAT, "prompt": "count me", "max_tokens": 2})
    from prometheus_client.parser import text_string_to_metric_families

    text = duo.http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}  # parses: no duplicate series
    prompt_tokens = {s.labels["model_name"]: s.value for s in families["vllm:prompt_tokens"].samples
                     if s.name.endswith("_total")}
    assert set(prompt_tokens) == {CHAT, EMB} and all(v > 0 for v in prompt_tokens.values())
    assert duo.http.get("/health").status_code == 200
    # admission runs per engine (its gauges count both) and the server reports ready
    assert duo.http.get("/ready").status_code == 200, duo.http.get("/ready").text
    in_flight = {s.labels.get("model_name") for s in families["vllm:admission_in_flight_requests"].samples}
    assert {CHAT, EMB} <= in_flight


def test_routing_errors_name_the_model(duo):
    msgs = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/chat/completions", {"messages": msgs}), ("/v1/completions", {"prompt": "hi"})):
        for stream in (False, True):
            r = duo.post(path, {"model": EMB, "stream": stream, **body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "model" and "--runner generate" in err["message"] and CHAT in err["message"]
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/pooling", {"input": "hi"}),
                       ("/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]})):
        r = duo.post(path, {"model": CHAT, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "model" and "--runner pooling" in err["message"] and EMB in err["message"]
    for path in ("/v1/chat/completions", "/v1/embeddings", "/tokenize"):
        r = duo.post(path, {"model": "no-such-model", "messages": msgs, "input": "hi", "prompt": "hi"})
        assert r.status_code == 404 and "no-such-model" in r.json()["error"]["message"], r.text
        assert EMB in r.json()["error"]["message"] and CHAT in r.json()["error"]["message"]
    # without `model`, each endpoint goes to the model that serves it
    assert duo.post("/v1/embeddings", {"input": "hi"}).json()["model"] == EMB
    chat = duo.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2}).json()
    assert chat["model"] == CHAT
    # SageMaker's /invocations routes by shape, then by model
    assert duo.post("/invocations", {"model": EMB, "input": "hi"}).json()["data"][0]["object"] == "embedding"
    assert duo.http.get("/health").status_code == 200
