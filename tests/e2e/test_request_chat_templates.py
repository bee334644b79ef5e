"""Request chat templates on a real server (issue 26 item 3): refused on the shared
``server`` (no --trust-request-chat-template, vLLM's default); with the flag, ordinary
templates render the prompt the server itself would, and hostile ones are stopped within
the request's X-Request-Timeout while the API server's memory stays small and it keeps
serving others. The sandbox's own cases (bounds, kill, replacement) are in
tests/entrypoints/test_template_sandbox.py."""
from __future__ import annotations

import threading
import time

import httpx
import psutil
import pytest

from e2e_utils import MODEL
from llmserve.entrypoints.renderer import Renderer

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Name a colour."}]
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ greeting | default('') }}"
HOSTILE = {  # name -> (template, status, param)
    "big-string": ("{% set x = 'a' * 1000000000 %}", 400, "chat_template"),  # MemoryError in the worker
    "2e8-loop": ("{% for i in range(20000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}", 408,
                 "X-Request-Timeout"),  # killed at the request's deadline
    "2e8-range": ("{% for i in range(200000000) %}{% endfor %}", 400, "messages"),  # jinja2's sandbox: MAX_RANGE
}
ENDLESS = "{% for i in range(100000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}"  # 2x10^9 steps


def test_request_templates_are_refused_by_default(server):
    for stream in (False, True):
        r = server.post(CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 1, "stream": stream,
                               "chat_template": TEMPLATE})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        assert "--trust-request-chat-template" in r.json()["error"]["message"]
    smuggled = {"chat_template_kwargs": {"chat_template": TEMPLATE}}
    for path, body in ((CHAT, {"messages": MSGS, "max_tokens": 1, **smuggled}),
                       ("/tokenize", {"messages": MSGS, "chat_template": TEMPLATE}),
                       ("/tokenize", {"messages": MSGS, **smuggled}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 1, **smuggled})):
        r = server.post(path, {"model": MODEL, **body})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] in ("chat_template", "chat_template_kwargs"), r.text
    # the server's own template serves as before
    assert server.post(CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": 1}).status_code == 200


@pytest.fixture(scope="module")
def trusted(tiny_server):
    """A tiny random Llama (SmolLM2's tokenizer) trusting request templates; a long render
    bound, so that only the request's timeout or a disconnect can stop a render here."""
    return tiny_server


def prompt_ids(srv, **extra) -> list[int]:
    r = srv.post(CHAT, {"model": "tiny", "messages": MSGS, "max_tokens": 1, "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"]


def test_trusted_request_templates_render_the_same_prompt(trusted, tiny_model_dir):
    from llmserve.tokenizer import get_tokenizer

    local = Renderer(get_tokenizer(tiny_model_dir))
    want = local.render_chat(MSGS, chat_template=TEMPLATE).token_ids
    assert prompt_ids(trusted, chat_template=TEMPLATE) == want != prompt_ids(trusted)
    t = trusted.post("/tokenize", {"model": "tiny", "messages": MSGS, "chat_template": TEMPLATE})
    assert t.status_code == 200 and t.json()["tokens"] == want
    # template variables, a template in chat_template_kwargs, reasoning_effort reach it
    # (the template fields of tests/e2e/test_every_request_field.py)
    hello = local.render_chat(MSGS, chat_template=TEMPLATE, chat_template_kwargs={"greeting": "Hi"}).token_ids
    assert prompt_ids(trusted, chat_template=TEMPLATE, chat_template_kwargs={"greeting": "Hi"}) == hello != want
    assert prompt_ids(trusted, chat_template_kwargs={"chat_template": TEMPLATE}) == want
    effort = "{{ reasoning_effort }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    for extra, text in (({"reasoning_effort": "high"}, "high|Name a colour."), ({}, "|Name a colour."),
                        ({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}},
                         "low|Name a colour.")):  # an explicit template variable wins, as in vLLM
        ids = prompt_ids(trusted, chat_template=effort, **extra)
        assert trusted.post("/detokenize", {"model": "tiny", "tokens": ids}).json()["prompt"] == text
        chunks = trusted.stream_chunks(CHAT, {"model": "tiny", "messages": MSGS, "max_tokens": 1, "stream": True,
                                              "return_token_ids": True, "chat_template": effort, **extra})
        assert chunks[0]["prompt_token_ids"] == ids  # streamed too


def _sample_rss(pid: int, stop: threading.Event, peak: list[int]) -> None:
    proc = psutil.Process(pid)
    while not stop.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.01)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_are_stopped_and_others_served(trusted, name):
    template, status, param = HOSTILE[name]
    stop, peak, result = threading.Event(), [0], {}
    sampler = threading.Thread(target=_sample_rss, args=(trusted.proc.pid, stop, peak))
    sampler.start()

    def hostile() -> None:
        t0 = time.perf_counter()
        result["r"] = trusted.post(CHAT, {"model": "tiny", "messages": MSGS, "max_tokens": 1, "chat_template": template},
                                   headers={"X-Request-Timeout": "2"})
        result["s"] = time.perf_counter() - t0

    attack = threading.Thread(target=hostile)
    attack.start()
    try:
        others = [trusted.post(CHAT, {"model": "tiny", "messages": MSGS, "max_tokens": 1}),
                  trusted.post(CHAT, {"model": "tiny", "messages": MSGS, "max_tokens": 1, "chat_template": TEMPLATE}),
                  trusted.http.get("/health")]
        attack.join(60)
    finally:
        stop.set()
        sampler.join()
    r = result["r"]
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert "chat_template" in r.json()["error"]["message"] or param == "messages"
    assert [o.status_code for o in others] == [200, 200, 200]
    assert peak[0] < 1 << 30, f"API server RSS peaked at {peak[0] >> 20} MiB"
    print(f"\n{name}: {r.status_code} in {result['s']:.2f} s; API server peak RSS {peak[0] >> 20} MiB")


def _workers(srv) -> set[int]:
    """The server's live template workers (a killed one may linger as a zombie until reaped)."""
    pids = set()
    for c in psutil.Process(srv.proc.pid).children():
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "llmserve.entrypoints.template_sandbox" in " ".join(c.cmdline()):
                pids.add(c.pid)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):  # ended between the listing and the look
            continue
    return pids


def test_a_client_disconnect_kills_the_render(trusted):
    """The render bound is 60 s and this template runs longer: the worker is gone soon
    after the client hangs up only because the disconnect killed it."""
    prompt_ids(trusted, chat_template=TEMPLATE)
    deadline = time.monotonic() + 30
    while len(_workers(trusted)) < 2 and time.monotonic() < deadline:  # both workers up (one may be new)
        time.sleep(0.2)
    before = _workers(trusted)
    with pytest.raises(httpx.ReadTimeout):
        trusted.post(CHAT, {"model": "tiny", "messages": MSGS, "max_tokens": 1, "chat_template": ENDLESS}, timeout=1.0)
    deadline = time.monotonic() + 30
    while before <= _workers(trusted) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not before <= _workers(trusted), "the render's worker still runs after the client left"
    assert prompt_ids(trusted, chat_template=TEMPLATE)  # and request templates still render
