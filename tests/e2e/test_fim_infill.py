"""Fill-in-the-middle: ``suffix`` on /v1/completions and llama-server's ``POST /infill``.

SmolLM2 (the shared ``server``) has no FIM tokens: both are a 400 naming the field. A tiny
random Llama with SmolLM2's tokenizer plus Qwen2.5-Coder's FIM tokens (``fim_server``)
checks the prompt layout token by token against llama-server's ``format_prompt_infill``,
written out here from its definition (repo name, file chunks, prefix, suffix, middle).
"""
import json

import pytest

from e2e_utils import RemoteServer

FIM_NAMES = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


@pytest.fixture(scope="module")
def fim_tokenizer_dir(tmp_path_factory):
    """A tiny random Llama whose tokenizer is SmolLM2's with Qwen2.5-Coder's FIM tokens added
    (ids 49152..49157), a 4096-token context (so llama-server keeps ``input_extra``)."""
    import copy

    import torch
    import transformers as tf

    from llmserve.tokenizer import get_tokenizer

    path = str(tmp_path_factory.mktemp("tiny-fim"))
    tok = copy.deepcopy(get_tokenizer("SmolLM2-135M-Instruct"))
    tok.add_special_tokens({"additional_special_tokens": FIM_NAMES})
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=49160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path, tok


@pytest.fixture(scope="module")
def fim_server(fim_tokenizer_dir):
    srv = RemoteServer(["--model", fim_tokenizer_dir[0], "--served-model-name", "tiny-fim", "--dtype", "float32",
                        "--kv-cache-memory", "64MiB", "--max-model-len", "4096"])
    yield srv
    srv.stop()


def _ids(tok, name):
    return tok.convert_tokens_to_ids(name)


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False, split_special_tokens=True)


def test_no_fim_tokens_is_a_400_naming_the_field(server):
    r = server.http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "def f(",
                                                  "suffix": "\n    return x", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix", r.text
    assert "FIM" in r.json()["error"]["message"]
    r = server.http.post("/infill", json={"input_prefix": "def f(", "input_suffix": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_suffix", r.text
    # an empty suffix is a plain completion (what clients send when the cursor is at the end)
    r = server.http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi",
                                                  "suffix": "", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_completions_suffix_builds_llama_server_layout(fim_server, fim_tokenizer_dir):
    tok = fim_tokenizer_dir[1]
    prefix, suffix = "def add(a, b):\n", "\n# <|fim_middle|> stays text\n"
    r = fim_server.http.post("/v1/completions", json={"prompt": [prefix, "x = "], "suffix": suffix, "max_tokens": 3,
                                                      "temperature": 0, "return_token_ids": True, "echo": True})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    for choice, p in zip(choices, [prefix, "x = "]):
        # llama-server: [repo]myproject\n [sep]filename\n [pre]prefix [suf]suffix [mid]
        expected = ([_ids(tok, "<|repo_name|>")] + _enc(tok, "myproject\n") + [_ids(tok, "<|file_sep|>")]
                    + _enc(tok, "filename\n") + [_ids(tok, "<|fim_prefix|>")] + _enc(tok, p)
                    + [_ids(tok, "<|fim_suffix|>")] + _enc(tok, suffix) + [_ids(tok, "<|fim_middle|>")])
        assert choice["prompt_token_ids"] == expected
        assert choice["prompt_token_ids"].count(_ids(tok, "<|fim_middle|>")) == 1  # typed text is not the token
        assert choice["text"].startswith(p)  # echo: the prompt as sent


def test_infill_layout_extra_chunks_and_stream(fim_server, fim_tokenizer_dir):
    tok = fim_tokenizer_dir[1]
    body = {"input_prefix": "def add(a, b):\n", "input_suffix": ["\n", "return c\n"], "prompt": "    c =",
            "input_extra": [{"filename": "util.py", "text": "def mul(a, b):\n    return a * b\n"},
                            {"text": "X = 1\n"}],
            "n_predict": 4, "temperature": 0, "return_tokens": True, "n_probs": 1}
    r = fim_server.http.post("/infill", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    sep, repo = _ids(tok, "<|file_sep|>"), _ids(tok, "<|repo_name|>")
    expected = ([repo] + _enc(tok, "myproject\n") + [sep] + _enc(tok, "util.py\n")
                + _enc(tok, "def mul(a, b):\n    return a * b\n") + [sep] + _enc(tok, "tmp\n") + _enc(tok, "X = 1\n")
                + [sep] + _enc(tok, "filename\n") + [_ids(tok, "<|fim_prefix|>")] + _enc(tok, "def add(a, b):\n")
                + tok.encode("    c =", add_special_tokens=False) + [_ids(tok, "<|fim_suffix|>")]
                + _enc(tok, "\n") + _enc(tok, "return c\n") + [_ids(tok, "<|fim_middle|>")])
    assert out["tokens_evaluated"] == len(expected)
    assert out["prompt"] == tok.decode(expected, skip_special_tokens=False)
    assert out["stop"] is True and out["tokens_predicted"] == len(out["tokens"]) <= 4
    assert out["stop_type"] in ("limit", "eos") and out["model"] == "tiny-fim"
    # n_probs: llama-server's completion_probabilities, one per middle token (greedy: its own top 1)
    assert [p["id"] for p in out["completion_probabilities"]] == out["tokens"]
    assert all([t["id"] for t in p["top_logprobs"]] == [p["id"]] for p in out["completion_probabilities"])

    with fim_server.http.stream("POST", "/infill", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["stop"] for e in events][-1] is True and not any(e["stop"] for e in events[:-1])
    assert "".join(e["content"] for e in events) == out["content"]  # greedy: the same middle
    assert [p["id"] for e in events for p in e.get("completion_probabilities", [])] == out["tokens"]


def test_infill_bad_input_names_the_field(fim_server):
    for body, param in [({"input_prefix": [1.5]}, "input_prefix"), ({"input_extra": [{"filename": "a"}]}, "input_extra"),
                        ({"n_predict": -2}, "n_predict"), ('{"input_suffix": "\\ud800"}', "input_suffix")]:
        r = fim_server.http.post("/infill", **({"content": body} if isinstance(body, str) else {"json": body}),
                                 headers={"content-type": "application/json"})
        assert r.status_code == 400, (body, r.text)
        assert (r.json()["error"]["param"] or "").startswith(param), (body, r.text)


def test_infill_n_predict_beyond_the_context_stops_at_its_end(fim_server, fim_tokenizer_dir):
    """llama-server caps ``n_predict`` at the room the prompt leaves; /infill refused it
    (a 400 naming ``max_tokens``). A +100 bias on ``<|fim_pad|>`` ends the middle at once."""
    pad = _ids(fim_tokenizer_dir[1], "<|fim_pad|>")
    r = fim_server.http.post("/infill", json={"input_prefix": "def f(", "input_suffix": "\n", "n_predict": 5000,
                                              "temperature": 0, "logit_bias": [[pad, 100]]})
    assert r.status_code == 200, r.text
    assert r.json()["stop_type"] == "eos" and r.json()["tokens_predicted"] <= 1


def test_infill_too_long_names_the_field_that_filled_the_context(fim_server, fim_tokenizer_dir):
    """A /infill prompt too long for the context is a 400 naming the request field holding
    most of its tokens; it named ``prompt`` (the engine's name for the whole layout) even
    when ``prompt`` was empty. Here llama-server's budgets keep 2050 extra, 1536 prefix
    and 510 suffix tokens: 4099 of the 4096-token context."""
    word = " x" * 3000  # 3000 tokens
    body = {"input_prefix": word, "input_suffix": word, "input_extra": [{"filename": "a.py", "text": word}],
            "n_predict": 2}
    for stream in (False, True):
        r = fim_server.http.post("/infill", json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "input_extra", r.text
    r = fim_server.http.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "prompt": word * 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_infill_negative_temperature_is_greedy(fim_server):
    """llama-server samples greedily at a temperature below 0; /infill refused it (a 400)."""
    body = {"input_prefix": "def f(", "input_suffix": "\n", "n_predict": 3, "return_tokens": True}
    r = fim_server.http.post("/infill", json={**body, "temperature": -1})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == fim_server.http.post("/infill", json={**body, "temperature": 0}).json()["tokens"]
