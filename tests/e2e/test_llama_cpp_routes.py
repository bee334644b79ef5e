"""llama-server's native routes, as a llama.cpp user calls them, on the shared ``server``
(SmolLM2, float32): ``POST /completion`` (and ``/completions``) with its prompt shapes,
answer object and ``data:`` stream, ``/slots``, ``/props``; ``/embedding`` on the shared
MiniLM server. FIM (``/infill``) is in test_fim_infill.py.
"""
import json
import math

from e2e_utils import MODEL

CHATML = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_completion_answers_in_llama_servers_shape(server):
    greedy = {"n_predict": 4, "temperature": 0}
    r = server.http.post("/completion", json={"prompt": "1, 2, 3,", **greedy, "return_tokens": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stop"] is True and out["model"] == MODEL and out["stop_type"] in ("limit", "eos")
    assert out["tokens_predicted"] == len(out["tokens"]) <= 4 and out["content"]
    ids = server.http.post("/tokenize", json={"prompt": "1, 2, 3,"}).json()["tokens"]
    assert out["tokens_evaluated"] == len(ids) and out["prompt"] == "1, 2, 3,"
    timings = out["timings"]  # llama-server's, on every final answer
    assert timings["predicted_n"] == out["tokens_predicted"] and timings["prompt_n"] + timings["cache_n"] == len(ids)
    assert timings["predicted_ms"] >= 0 and timings["prompt_per_second"] >= 0
    # the same prompt as token ids, and mixed text and ids, on the alias: the same greedy answer
    for prompt in (ids, ids[:2] + [server.http.post("/detokenize", json={"tokens": ids[2:]}).json()["prompt"]]):
        same = server.http.post("/completions", json={"prompt": prompt, **greedy}).json()
        assert same["content"] == out["content"], (prompt, same)
    # special-token text is read as those tokens (llama-server's parse_special), not spelled out
    chat = server.http.post("/completion", json={"prompt": CHATML, **greedy}).json()
    assert chat["tokens_evaluated"] == len(server.http.post("/tokenize", json={"prompt": CHATML}).json()["tokens"])
    assert chat["tokens_evaluated"] < 12
    # several prompts: an array of answers, in order
    both = server.http.post("/completion", json={"prompt": ["1, 2, 3,", CHATML], **greedy}).json()
    assert [b["index"] for b in both] == [0, 1] and [b["content"] for b in both] == [out["content"], chat["content"]]
    # a stop word ends it: stop_type "word", the word left out
    stop = out["content"].strip()[:1]
    worded = server.http.post("/completion", json={"prompt": "1, 2, 3,", **greedy, "stop": [stop]}).json()
    assert worded["stop_type"] == "word" and worded["stopping_word"] == stop and stop not in worded["content"]


def test_completion_stream_and_bad_input(server):
    body = {"prompt": "1, 2, 3,", "n_predict": 3, "temperature": 0}
    with server.http.stream("POST", "/completion", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["timings"]["predicted_n"] == events[-1]["tokens_predicted"]
    assert not any("timings" in e for e in events[:-1])
    assert all(len(e["tokens"]) >= 1 for e in events[:-1])  # a stream carries the ids (llama-server)
    whole = server.http.post("/completion", json=body).json()
    assert "".join(e["content"] for e in events) == whole["content"]
    for bad, param in [({"n_predict": 3}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [10 ** 9]}, "prompt"),
                       ({"prompt": [1, [2]]}, "prompt"), ({"prompt": "x", "n_predict": -2}, "n_predict")]:
        r = server.http.post("/completion", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_tokenize_and_detokenize_take_llama_servers_fields(server):
    text = "Hello <|im_end|>\u00e1\U0001F600"
    r = server.http.post("/tokenize", json={"content": text})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == server.http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert 2 in ids  # <|im_end|> read as the special token (parse_special defaults to true)
    plain = server.http.post("/tokenize", json={"content": text, "parse_special": False}).json()["tokens"]
    assert 2 not in plain and len(plain) > len(ids)
    pieces = server.http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert pieces[0]["piece"] == "Hello" and {"id": 2, "piece": "<|im_end|>"} in pieces
    # the emoji's bytes are split over tokens: those pieces are byte lists that join to it
    tail = [b for p in pieces if isinstance(p["piece"], list) for b in p["piece"]]
    assert bytes(tail).decode("utf-8") == "\U0001F600"
    out = server.http.post("/detokenize", json={"tokens": ids}).json()
    assert out["content"] == out["prompt"] == text  # llama-server's key beside vLLM's
    for bad, param in [({"content": "a", "prompt": "b"}, "content"), ({"prompt": "a", "with_pieces": True}, "with_pieces"),
                       ({"content": "a", "add_special_tokens": True}, "add_special_tokens")]:
        r = server.http.post("/tokenize", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_props_reports_the_context_defaults_and_template(server):
    r = server.http.get("/props")
    assert r.status_code == 200, r.text
    props = r.json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 2048 and settings["params"]["n_predict"] == -1
    assert 0 <= settings["params"]["temperature"] <= 2 and props["total_slots"] >= 1
    assert props["model_alias"] == MODEL and props["model_path"].endswith(".gguf")
    assert "<|im_start|>" in props["chat_template"] and props["modalities"]["vision"] is False


def test_completion_follows_a_grammar_or_json_schema(server):
    # llama-server's json_schema / grammar constrain the answer (they were ignored before)
    r = server.http.post("/completion", json={"prompt": "Is the sky blue? Answer:", "n_predict": 4,
                                              "grammar": 'root ::= "yes" | "no"'})
    assert r.status_code == 200 and r.json()["content"] in ("yes", "no"), r.text
    r = server.http.post("/completion", json={"prompt": "x", "n_predict": 8, "temperature": 0,
                                              "json_schema": {"enum": ["alpha", "beta"]}})
    assert r.status_code == 200 and json.loads(r.json()["content"]) in ("alpha", "beta"), r.text
    for bad, param in [({"grammar": "root ::= ((("}, "grammar"), ({"json_schema": {"type": "nope"}}, "json_schema"),
                       ({"json_schema": {}, "grammar": 'root ::= "a"'}, "grammar")]:
        r = server.http.post("/completion", json={"prompt": "x", "n_predict": 2, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_apply_template_then_completion_equals_the_chat_answer(server):
    msgs = [{"role": "user", "content": "Say hi."}]
    r = server.http.post("/apply-template", json={"messages": msgs})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and "Say hi." in prompt
    done = server.http.post("/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0}).json()
    chat = server.http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 4,
                                                          "temperature": 0}).json()
    assert done["content"] == chat["choices"][0]["message"]["content"]
    assert done["tokens_evaluated"] == chat["usage"]["prompt_tokens"]
    r = server.http.post("/apply-template", json={"messages": msgs, "add_generation_prompt": False})
    assert not r.json()["prompt"].endswith("assistant\n")
    r = server.http.post("/apply-template", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_openai_routes_read_llama_servers_n_predict(server):
    # llama-server reads n_predict on its OpenAI routes too; it was ignored here (16 tokens)
    for path, body in (("/v1/completions", {"prompt": "Once upon a time"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story."}]})):
        r = server.http.post(path, json={"model": MODEL, **body, "n_predict": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, (path, r.text)
        same = server.http.post(path, json={"model": MODEL, **body, "n_predict": 3, "max_tokens": 3,
                                            "ignore_eos": True})
        assert same.json()["usage"]["completion_tokens"] == 3
        for bad in ({"n_predict": 3, "max_tokens": 4}, {"n_predict": "3"}, {"n_predict": -2}):
            r = server.http.post(path, json={"model": MODEL, **body, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n_predict", (path, bad, r.text)


def test_completion_n_probs_answers_completion_probabilities(server):
    # llama-server's n_probs: each generated token's logprob and its likeliest alternatives
    # (the field was ignored before); greedy, so the first alternative is the token itself
    body = {"prompt": "1, 2, 3,", "n_predict": 3, "temperature": 0, "n_probs": 2, "return_tokens": True}
    out = server.http.post("/completion", json=body).json()
    probs = out["completion_probabilities"]
    assert [p["id"] for p in probs] == out["tokens"] and len(probs) == out["tokens_predicted"] == 3
    for p in probs:
        assert [t["id"] for t in p["top_logprobs"]][:1] == [p["id"]] and len(p["top_logprobs"]) == 2
        assert p["logprob"] == p["top_logprobs"][0]["logprob"] >= p["top_logprobs"][1]["logprob"]
        assert bytes(p["bytes"]).decode("utf-8") == p["token"]
    assert "".join(p["token"] for p in probs) == out["content"]
    ref = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 3,
                                                    "temperature": 0, "logprobs": 2}).json()
    assert [round(p["logprob"], 4) for p in probs] == [round(x, 4) for x in
                                                      ref["choices"][0]["logprobs"]["token_logprobs"]]
    settings = out["generation_settings"]  # the settings it ran with
    assert settings["n_predict"] == 3 and settings["temperature"] == 0 and settings["n_probs"] == 2
    # post_sampling_probs: probabilities under prob / top_probs
    post = server.http.post("/completion", json={**body, "post_sampling_probs": True}).json()
    first = post["completion_probabilities"][0]
    assert "logprob" not in first and abs(first["prob"] - math.exp(probs[0]["logprob"])) < 1e-4
    assert [t["id"] for t in first["top_probs"]] == [t["id"] for t in probs[0]["top_logprobs"]]
    # a stream: each event carries its own tokens' entries
    with server.http.stream("POST", "/completion", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    streamed = [p for e in events for p in e.get("completion_probabilities", [])]
    assert [p["id"] for p in streamed] == out["tokens"] and "generation_settings" in events[-1]
    # a stop word's tokens are left out of a whole answer's entries, as llama-server does
    word = server.http.post("/detokenize", json={"tokens": out["tokens"][1:2]}).json()["content"]
    cut = server.http.post("/completion", json={**body, "stop": [word]}).json()
    assert cut["stop_type"] == "word" and len(cut["completion_probabilities"]) == cut["tokens_predicted"] - 1
    plain = server.http.post("/completion", json={"prompt": "1,", "n_predict": 1}).json()
    assert "completion_probabilities" not in plain
    for bad in (21, -1, "2"):
        r = server.http.post("/completion", json={"prompt": "x", "n_predict": 1, "n_probs": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n_probs", (bad, r.text)


def test_slots_lists_the_running_requests_in_slot_shape(server):
    # llama-server's GET /slots (a 404 before): --max-num-seqs entries, running ones first
    total = server.http.get("/props").json()["total_slots"]
    idle = server.http.get("/slots", params={"fail_on_no_slot": 1})
    assert idle.status_code == 200, idle.text
    assert len(idle.json()) == total and not any(s["is_processing"] for s in idle.json())
    assert [s["id"] for s in idle.json()] == list(range(total)) and idle.json()[0]["n_ctx"] == 2048
    # every entry (and /props' default_generation_settings) has llama-server's documented fields
    documented = {"id", "id_task", "n_ctx", "speculative", "is_processing", "params", "prompt", "next_token"}
    next_token = {"has_next_token", "has_new_line", "n_remain", "n_decoded", "stopping_word"}
    defaults = server.http.get("/props").json()["default_generation_settings"]
    for s in idle.json() + [defaults]:
        assert documented <= set(s) and set(s["next_token"]) == next_token and s["id_task"] == -1, s
        assert s["next_token"]["n_decoded"] == 0 and s["prompt"] == "" and "n_predict" in s["params"]
    body = {"prompt": "Once upon a time", "n_predict": 40, "ignore_eos": True, "temperature": 0, "stream": True}
    with server.http.stream("POST", "/completion", json=body) as r:
        lines = r.iter_lines()  # held: a dropped iterator closes the stream (an abort)
        next(line for line in lines if line.startswith("data: "))  # it runs now
        busy = server.http.get("/slots").json()
        again = server.http.get("/slots").json()
    slot = busy[0]
    assert all(documented <= set(s) and set(s["next_token"]) == next_token for s in busy)
    assert isinstance(slot["id_task"], int) and slot["id_task"] >= 0 and again[0]["id_task"] == slot["id_task"]
    assert set(slot["params"]) == set(idle.json()[0]["params"])  # the same keys as an idle slot's
    assert slot["is_processing"] and not busy[1]["is_processing"] and len(busy) == total
    assert slot["params"]["n_predict"] == 40 and slot["params"]["ignore_eos"] is True and slot["id_request"]
    assert 1 <= slot["next_token"]["n_decoded"] <= 40 and slot["next_token"]["n_remain"] == 40 - slot["next_token"]["n_decoded"]


def test_embedding_route_answers_llama_servers_list(minilm_server, server):
    # llama-server's POST /embedding (a 404 before), on the shared MiniLM server
    http = minilm_server.http
    r = http.post("/embedding", json={"content": "Hello my name is"})
    assert r.status_code == 200, r.text
    [item] = r.json()
    assert item["index"] == 0 and len(item["embedding"]) == 1
    ref = http.post("/v1/embeddings", json={"input": "Hello my name is"}).json()["data"][0]["embedding"]
    vec = item["embedding"][0]  # embd_normalize 2 (Euclidean) by default: /v1/embeddings' vector
    assert len(vec) == len(ref) == 384 and max(abs(a - b) for a, b in zip(vec, ref)) < 1e-5
    raw = http.post("/embedding", json={"content": "Hello my name is", "embd_normalize": -1}).json()[0]["embedding"][0]
    norm = math.sqrt(sum(x * x for x in raw))
    assert abs(norm - 1) > 0.01 and max(abs(a / norm - b) for a, b in zip(raw, ref)) < 1e-5
    scaled = http.post("/embedding", json={"content": "Hello my name is", "embd_normalize": 0}).json()[0]["embedding"][0]
    assert abs(max(abs(x) for x in scaled) - 32760) < 1e-2
    both = http.post("/embedding", json={"content": ["Hello my name is", "Second text"]}).json()
    assert [b["index"] for b in both] == [0, 1] and max(abs(a - b) for a, b in zip(both[0]["embedding"][0], vec)) < 1e-5
    for bad, param in [({}, "content"), ({"content": "a", "normalize": True}, "normalize"), ({"content": []}, "content")]:
        r = http.post("/embedding", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    # a generating model: /v1/embeddings' refusal
    r = server.http.post("/embedding", json={"content": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "--runner pooling" in r.text, r.text


def test_completion_n_predict_zero_generates_nothing(server):
    """llama-server's n_predict 0: the prompt is evaluated, no token is generated. The
    answer carried the one token the engine samples after the prefill ("-", 1 predicted)."""
    r = server.http.post("/completion", json={"prompt": "Hi", "n_predict": 0, "temperature": 0,
                                              "return_tokens": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["content"], out["tokens"], out["tokens_predicted"]) == ("", [], 0)
    assert out["stop_type"] == "limit" and out["timings"]["predicted_n"] == 0
