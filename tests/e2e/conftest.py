"""End-to-end fixtures (helpers in e2e_utils.py).

``server``: one per session: the default model in its default dtype (packed 4-bit
weights: greedy outputs are batch-invariant there too, and it decodes ~7x faster than
float32 on 2 AVX2 cores: 5-6 against 38-40 ms a token at batch 1, which took ~100 s off
the e2e files that use it), default settings plus an API key, so every test also goes
through the auth middleware. Comparisons with transformers' float32 run in process
(tests/engine, tests/models, tests/pooling). ``server_512``: ``--max-model-len 512`` in the default dtype with a KV
cache too small for 8 full-length sequences (cases C12/C13), one per module that uses it. ``tiny_server``: a tiny random Llama
directory whose generation_config.json sets a default budget and extra EOS ids, served
with a deliberately slow ``--chat-template`` and ``--renderer-num-workers 4``.
"""
import json
import os

import pytest

from e2e_utils import SLOW_CHAT_TEMPLATE, TINY_MAX_NEW_TOKENS, RemoteServer


@pytest.fixture(scope="session")
def server():
    srv = RemoteServer(["--kv-cache-memory", "256MiB"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server_512():
    # 512-token context; 240 usable blocks of 16 tokens = 3840 tokens of KV: 8 full-length
    # sequences (8 x 32 blocks) cannot fit at once, 7 can.
    # Default dtype (bfloat16 on this CPU): these cases check lengths and statuses, not
    # batch-invariant text, and bfloat16 decodes about twice as fast.
    srv = RemoteServer(["--max-model-len", "512", "--num-gpu-blocks-override", "241",
                        "--max-num-batched-tokens", "512", "--timeout-graceful-shutdown", "1"])
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, save_tiny_model_fn):
    """A tiny random Llama (SmolLM2's vocabulary and tokenizer) whose generation_config.json
    sets ``max_new_tokens`` and lists every token id as an extra EOS id."""
    from llmserve.tokenizer import get_tokenizer

    path = str(tmp_path_factory.mktemp("tiny-gencfg"))
    model = save_tiny_model_fn("llama", path)
    get_tokenizer("SmolLM2-135M-Instruct").save_pretrained(path)
    vocab = model.config.vocab_size
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"max_new_tokens": TINY_MAX_NEW_TOKENS, "eos_token_id": list(range(vocab))}, f)
    with open(os.path.join(path, "slow_template.jinja"), "w") as f:
        f.write(SLOW_CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir):
    # Also trusts request chat templates (a long render bound, so only the request's timeout or
    # a disconnect stops one): test_request_chat_templates.py shares it (one server start, ~10 s),
    # and test_sleep_mode.py its sleep-mode dev endpoints (VLLM_SERVER_DEV_MODE=1).
    srv = RemoteServer(["--model", tiny_model_dir, "--served-model-name", "tiny", "--dtype", "float32",
                        "--kv-cache-memory", "64MiB", "--renderer-num-workers", "4",
                        "--chat-template", os.path.join(tiny_model_dir, "slow_template.jinja"),
                        "--trust-request-chat-template", "--request-chat-template-timeout", "60",
                        "--enable-sleep-mode"], env={"VLLM_SERVER_DEV_MODE": "1"})
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def minilm_server():
    """all-MiniLM-L6-v2 (the packaged embedding model), float32, 128-token context, trusting
    request chat templates with one template worker: the embeddings and Ollama-door tests share it."""
    srv = RemoteServer(["--model", "all-MiniLM-L6-v2", "--dtype", "float32", "--max-model-len", "128",
                        "--kv-cache-memory", "64MiB", "--trust-request-chat-template",
                        "--request-chat-template-workers", "1"])
    yield srv
    srv.stop()
