"""use_beam_search on the server (issue 29): the answers equal LLM.beam_search's on the
same model in the same dtype (the session ``server`` and ``llm_same`` here), usage counts every returned
beam's tokens, a stream carries the same beams, and what the search cannot honour is a
400 naming the field."""
import json

import pytest

from llmserve.beam_search import BeamSearchParams


@pytest.fixture(scope="module")
def llm_same():
    """The offline LLM on the session ``server``'s model and dtype (the default: packed
    weights), engine in-process."""
    from llmserve import LLM

    llm = LLM("SmolLM2-135M-Instruct", multiprocess_mode=False, kv_cache_memory="64MiB", max_model_len=512)
    yield llm
    llm.shutdown()


def _texts(llm, prompt, k: int, max_tokens: int, temperature: float = 0.0) -> list[str]:
    tok = llm.get_tokenizer()
    out = llm.beam_search(prompt, BeamSearchParams(beam_width=k, max_tokens=max_tokens, temperature=temperature))[0]
    n = len(tok.encode(prompt)) if isinstance(prompt, str) else len(llm.apply_chat_template(prompt))
    return [tok.decode(s.tokens[n:], skip_special_tokens=True) for s in out.sequences]


def test_completions_and_chat_equal_offline(server, llm_same):
    prompt = "The capital of France is"
    r = server.post("/v1/completions", {"model": server.model_id(), "prompt": prompt, "max_tokens": 10,
                                             "n": 3, "use_beam_search": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])] == _texts(llm_same, prompt, 3, 10)
    assert body["usage"]["completion_tokens"] == 30  # 3 beams x 10 tokens (none ends earlier here)
    conv = [{"role": "user", "content": "Name a colour."}]
    r = server.post("/v1/chat/completions", {"model": server.model_id(), "messages": conv, "max_tokens": 12,
                                                  "n": 2, "use_beam_search": True, "early_stopping": True})
    assert r.status_code == 200, r.text
    got = [c["message"]["content"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    tok = llm_same.get_tokenizer()
    ids = llm_same.apply_chat_template(conv)
    ref = llm_same.beam_search(conv, BeamSearchParams(beam_width=2, max_tokens=12, early_stopping=True))[0]
    assert got == [tok.decode(s.tokens[len(ids):], skip_special_tokens=True) for s in ref.sequences]


def test_temperature_scales_the_scores_as_offline(server, llm_same):
    """vLLM scores beams on log_softmax(logits / temperature): at 0.3 the server's beams
    are LLM.beam_search's at 0.3, which are not the raw ones on this prompt."""
    prompt = "Once upon a time"
    r = server.post("/v1/completions", {"model": server.model_id(), "prompt": prompt, "max_tokens": 4, "n": 3,
                                         "use_beam_search": True, "temperature": 0.3})
    assert r.status_code == 200, r.text
    got = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert got == _texts(llm_same, prompt, 3, 4, 0.3) and got != _texts(llm_same, prompt, 3, 4)


@pytest.mark.slow
def test_stream_sends_the_final_beams(server):
    body = {"model": server.model_id(), "prompt": "The capital of France is", "max_tokens": 10, "n": 3,
            "use_beam_search": True}
    plain = server.post("/v1/completions", body).json()
    r = server.post("/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    texts = {c["index"]: c["text"] for e in events for c in e["choices"]}
    assert texts == {c["index"]: c["text"] for c in plain["choices"]}
    assert events[-1]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]


@pytest.mark.parametrize("extra,param", [
    ({"logit_bias": {"5": 2}}, "logit_bias"),
    ({"stop": ["\n"]}, "stop"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "stream_options"),
    ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
])
def test_what_beam_search_cannot_honour_is_a_400(server, extra, param):
    body = {"model": server.model_id(), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "n": 2, "use_beam_search": True, **extra}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
