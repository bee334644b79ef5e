"""Issue 19: `llmserve serve` started with every vLLM frontend flag it honours at once
(one shared server), each flag's effect checked over HTTP with the official client and
httpx. The no-op and refused flags are covered by tests/entrypoints/test_vllm_serve_flags.py."""
from __future__ import annotations

import gzip
import json
import os
import socket

import httpx
import pytest

from e2e_utils import MODEL, SERVE_CLI, RemoteServer

BLOCK = 16  # --block-size: the prefix cache hits whole blocks only
LONG_PROMPT = "The history of the lighthouse keepers of the northern coast, told one keeper at a time: " * 4


@pytest.fixture(scope="module")
def flags_server(tmp_path_factory):
    log_config = tmp_path_factory.mktemp("logcfg") / "logging.json"
    log_config.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "LOGCFG %(levelname)s %(name)s: %(message)s"}},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
        "loggers": {"llmserve": {"handlers": ["console"], "level": "INFO", "propagate": False}},
    }))
    srv = RemoteServer([
        "--kv-cache-memory", "256MiB", "--block-size", str(BLOCK),
        "--enable-prompt-tokens-details", "--enable-force-include-usage", "--enable-server-load-tracking",
        "--enable-tokenizer-info-endpoint", "--enable-request-id-headers", "--disable-fastapi-docs",
        "--middleware", "starlette.middleware.gzip.GZipMiddleware", "--response-role", "bot",
        "--return-tokens-as-token-ids", "--enable-log-requests", "--max-log-len", "9",
        "--chat-template-content-format", "string", "--h11-max-incomplete-event-size", "8192",
        "--log-config-file", str(log_config),
    ], entrypoint=SERVE_CLI)
    yield srv
    srv.stop()


def _maps_libtorch(pid: int) -> bool:
    """Whether process ``pid`` has torch's shared library mapped (Linux /proc)."""
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def _child_pids(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (field 4 of /proc/<pid>/stat)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:  # exited meanwhile
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry))
    return found


def test_api_server_process_runs_without_torch(flags_server):
    """Issue 31: the `llmserve serve` API server runs no model, so it never loads torch (3 s
    of start-up and ~150 MiB at rest): not at start, not for a chat completion. Its engine
    child does, which shows the check sees torch where it is."""
    pid = flags_server.proc.pid
    assert not _maps_libtorch(pid)
    reply = flags_server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
    assert reply.choices[0].message.content
    assert not _maps_libtorch(pid)
    assert any(_maps_libtorch(child) for child in _child_pids(pid))


def _expected_hit(prompt_tokens: int) -> int:
    # whole blocks of the prompt, never its last token (it must be computed to sample)
    return (prompt_tokens - 1) // BLOCK * BLOCK


def test_prompt_tokens_details_cached_tokens_non_streamed(flags_server):
    client = flags_server.client()
    prompt = "Completions, not streamed. " + LONG_PROMPT
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == _expected_hit(n) > 0
    msgs = [{"role": "user", "content": "Chat, not streamed. " + LONG_PROMPT}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    # the chat template's default system prompt may already be cached: a block or two
    assert first.usage.prompt_tokens_details.cached_tokens < _expected_hit(first.usage.prompt_tokens)
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == _expected_hit(again.usage.prompt_tokens)


def test_force_include_usage_and_cached_tokens_in_streams(flags_server):
    """No stream_options at all: usage still ends every stream (chat and completions),
    with the cache hit of a repeated prompt."""
    client = flags_server.client()
    msgs = [{"role": "user", "content": "Chat, streamed. " + LONG_PROMPT}]
    for attempt in range(2):
        chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0,
                                                     stream=True))
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage.completion_tokens == 3
        hit = usage.prompt_tokens_details.cached_tokens
        assert hit < _expected_hit(usage.prompt_tokens) if attempt == 0 else hit == _expected_hit(usage.prompt_tokens)
        assert all(c.usage is None for c in chunks[:-1])
    prompt = "Completions, streamed. " + LONG_PROMPT
    for attempt in range(2):
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, stream=True))
        usage = chunks[-1].usage
        assert usage.completion_tokens == 3
        assert usage.prompt_tokens_details.cached_tokens == (0 if attempt == 0 else _expected_hit(usage.prompt_tokens))
    # include_usage false is overridden too (vLLM's should_include_usage)
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True,
                                            stream_options={"include_usage": False}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2


def test_server_load_counts_in_flight_requests(flags_server):
    load = lambda: httpx.get(flags_server.url_for("load"), timeout=10).json()  # noqa: E731
    assert load() == {"server_load": 0}
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 40, "stream": True, "ignore_eos": True}
    with flags_server.http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert load() == {"server_load": 1}
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert load() == {"server_load": 0}


def test_tokenizer_info_endpoint_and_gzip_middleware(flags_server):
    r = flags_server.http.get("/tokenizer_info", headers={"Accept-Encoding": "gzip"})
    assert r.status_code == 200
    assert r.headers["content-encoding"] == "gzip"  # --middleware GZipMiddleware
    info = r.json()
    from llmserve.tokenizer import get_tokenizer

    assert info["tokenizer_class"] == type(get_tokenizer(MODEL)).__name__
    assert info["eos_token"] == "<|im_end|>" and info["eos_token_id"] == 2
    assert "<|im_start|>" in info["chat_template"]
    assert "vocab_file" not in info
    assert len(gzip.compress(r.content)) > 0


def test_request_id_header_and_docs_disabled(flags_server):
    r = flags_server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                          headers={"X-Request-Id": "flags-rid-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "flags-rid-1"
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(flags_server.url_for(path), timeout=10).status_code == 404


def test_response_role_and_token_id_logprobs(flags_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    r = flags_server.post("/v1/chat/completions", body)
    choice = r.json()["choices"][0]
    assert choice["message"]["role"] == "bot"
    content = choice["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert entry["token"].startswith("token_id:") and int(entry["token"][9:]) >= 0
        assert entry["bytes"] == list(entry["token"].encode())
        assert all(t["token"].startswith("token_id:") for t in entry["top_logprobs"])
    chunks = flags_server.stream_chunks("/v1/chat/completions", {**body, "stream": True})
    assert chunks[0]["choices"][0]["delta"]["role"] == "bot"
    r = flags_server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "logprobs": 1})
    assert all(t.startswith("token_id:") for t in r.json()["choices"][0]["logprobs"]["tokens"])


def test_h11_event_size_limit(flags_server):
    """Headers that stay incomplete past the 8 KiB set (h11 alone: 16 KiB) are refused,
    instead of being buffered (a slow-header flood)."""
    with socket.create_connection(("127.0.0.1", flags_server.port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 12000)
        assert s.recv(4096).startswith(b"HTTP/1.1 400")
    assert httpx.get(flags_server.url_for("health"), timeout=10).status_code == 200


def test_request_log_respects_max_log_len_and_log_config(flags_server):
    flags_server.post("/v1/completions", {"model": MODEL, "prompt": "Abcdefghijklmnop", "max_tokens": 1})
    logs = flags_server.logs()
    assert "LOGCFG INFO llmserve" in logs  # --log-config-file formats llmserve's logs
    assert "prompt='Abcdefghi'," in logs  # --enable-log-requests, --max-log-len 9
    assert "Abcdefghij" not in logs
