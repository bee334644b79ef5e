"""End-to-end helpers: a real ``llmserve`` server process on the real default model
(SmolLM2-135M-Instruct, float32 so greedy outputs are batch-invariant), reached over HTTP
with the official ``openai`` client and ``httpx``.

The fixtures live in conftest.py.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import httpx
import openai

API_KEY = "e2e-test-key"
MODEL = "SmolLM2-135M-Instruct"
_STARTUP_TIMEOUT_S = 300

# A chat template made slow on purpose (a loop before the messages): ~0.1 s a render here.
SLOW_CHAT_TEMPLATE = ("{% set ns = namespace(n=0) %}{% for i in range(30000) %}{% set ns.n = ns.n + 1 %}"
                      "{% endfor %}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
TINY_MAX_NEW_TOKENS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def no_nonfinite(text: str) -> Any:
    """json.loads that rejects NaN/Infinity (the cases' "strict JSON")."""
    def reject(const: str) -> Any:
        raise ValueError(f"non-finite JSON constant {const}")
    return json.loads(text, parse_constant=reject)


SERVE_CLI = ["-m", "llmserve.entrypoints.cli", "serve"]  # ``llmserve serve``


class RemoteServer:
    """A ``python -m llmserve.entrypoints.openai.api_server`` child process (``entrypoint``:
    the interpreter arguments before the flags, e.g. SERVE_CLI for ``llmserve serve``).

    Starts it on a free port, waits for ``GET /health`` == 200, and stops it with
    SIGTERM (SIGKILL after 30 s); ``env``: extra environment variables; ``host``: the
    loopback address it binds (127.0.0.2... for a second "node"); ``new_session``: in a
    process group of its own (a test may signal the whole group). ``url_for(path)``, ``client()`` (openai.OpenAI),
    ``http`` (an httpx.Client with the API key) are the ways in.
    """

    def __init__(self, args: list[str], api_key: Optional[str] = API_KEY,
                 entrypoint: Optional[list[str]] = None, env: Optional[dict[str, str]] = None,
                 host: str = "127.0.0.1", new_session: bool = False):
        self.port = _free_port()
        self.host = host
        self.api_key = api_key
        entrypoint = entrypoint or ["-m", "llmserve.entrypoints.openai.api_server"]
        cmd = [sys.executable, *entrypoint, "--host", host,
               "--port", str(self.port), "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = tempfile.NamedTemporaryFile(prefix="llmserve-e2e-", suffix=".log", delete=False)
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=new_session)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Idle connections are dropped after 2 s, well before the server's 5 s keep-alive:
        # at the same 5 s a pooled connection could be reused just as the server closed it,
        # and the request met a reset (seen once in test_chat.py once the tests got faster).
        self.http = httpx.Client(base_url=self.url_root, headers=headers, timeout=120.0,
                                 limits=httpx.Limits(keepalive_expiry=2.0))
        self._wait_ready()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(p.strip("/") for p in parts)

    def logs(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-6000:]

    def _wait_ready(self) -> None:
        deadline = time.time() + _STARTUP_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url_for("health"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # startup ends at an unknown moment: poll often
        self.stop()
        raise RuntimeError(f"server not ready after {_STARTUP_TIMEOUT_S} s:\n{self.logs()}")

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.api_key or "none", max_retries=0,
                             timeout=kwargs.pop("timeout", 120.0), **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.api_key or "none", max_retries=0,
                                  timeout=kwargs.pop("timeout", 120.0), **kwargs)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        return self.http.post(path, json=body, **kwargs)

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    # ---- helpers shared by the tests ----------------------------------------------------
    def model_id(self) -> str:
        return self.http.get("/v1/models").json()["data"][0]["id"]

    def tok(self, prompt: str) -> dict:
        r = self.post("/tokenize", {"model": MODEL, "prompt": prompt})
        assert r.status_code == 200, r.text
        return r.json()

    def assert_healthy(self) -> None:
        """The cases' "Healthy": /health 200 and a 4-token completion within 30 s."""
        assert httpx.get(self.url_for("health"), timeout=10).status_code == 200
        r = self.post("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text

    def sse_events(self, path: str, body: dict) -> tuple[httpx.Response, list[str]]:
        """POST with stream: the response and its raw SSE data payloads (``[DONE]`` included).
        Asserts the framing on the way: every event is one ``data: `` line plus a blank line."""
        with self.http.stream("POST", path, json=body) as r:
            raw = r.read().decode() if r.status_code != 200 else "".join(r.iter_text())
        if r.status_code != 200:
            return r, [raw]
        assert raw.endswith("\n\n"), raw[-200:]
        events = raw[:-2].split("\n\n")
        payloads = []
        for ev in events:
            assert "\n" not in ev and ev.startswith("data: "), repr(ev)
            payloads.append(ev[len("data: "):])
        return r, payloads

    def stream_chunks(self, path: str, body: dict) -> list[dict]:
        r, payloads = self.sse_events(path, body)
        assert r.status_code == 200, payloads
        assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
        return [no_nonfinite(p) for p in payloads[:-1]]


def stream_text(chunks: list[dict], index: int = 0, chat: bool = False) -> str:
    """``stream_text(choice i)`` of the cases: joined text / delta.content of one choice."""
    out = []
    for c in chunks:
        for ch in c["choices"]:
            if ch["index"] == index:
                out.append((ch["delta"].get("content") or "") if chat else ch["text"])
    return "".join(out)


def finish_reasons(chunks: list[dict], index: int = 0) -> list[Optional[str]]:
    return [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["index"] == index]




def metric_sum(server: RemoteServer, name: str, **labels: str) -> float:
    """The sum of the /metrics samples of ``name`` whose labels include ``labels``."""
    text = httpx.get(server.url_for("metrics"), timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
