"""Issue 33's browser test: headless Chromium (Debian's ``chromium`` package, driven by
Playwright for Python through the system binary: no browser download) against the real
server of the default model (the session ``server``: float32, with an API key).

The playground asks for the key, lists the model, streams an answer that appears while it
is generated, shows its token counts and tok/s, keeps the conversation across a reload,
and stops a stream with Stop. The live view, while 8 streams run, shows 8 running rows
whose token counts grow from one refresh to the next, then the 8 finished requests with
their timelines drawn as bars.
"""
from __future__ import annotations

import json
import os
import threading

import httpx
import pytest

from e2e_utils import API_KEY, MODEL

CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is absent: install Debian's chromium (.ci/run does, as root)", allow_module_level=True)
playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright (the test extra) is not installed")
expect = playwright_api.expect
expect.set_options(timeout=60_000)  # a loaded 2-core machine; each wait ends as soon as it holds

# The network is closed here: nothing in the background may try to reach it.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
N_STREAMS = 8
STREAM_TOKENS = 128  # 8 rows decode 24 tokens in 0.6 s on an idle 2-core machine (measured): 128 give
# about 3 s, a dozen refreshes at REFRESH_MS, however fast the engine gets on a quiet machine
REFRESH_MS = 250  # the live view's refresh (1 s by default): 8 refreshes while the streams run


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One Chromium with a fresh profile for the module (the key, once entered, stays in
    its localStorage, as in a user's browser)."""
    with playwright_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_FLAGS, viewport={"width": 1280, "height": 800})
        context.set_default_timeout(60_000)
        yield context
        context.close()


# Records the first non-empty text of a pending (still streaming) assistant message.
WATCH_PARTIAL = """() => {
  window.__partialSeen = null;
  new MutationObserver(() => {
    const md = document.querySelector('.msg.assistant.pending .md');
    if (window.__partialSeen === null && md && md.textContent.trim()) window.__partialSeen = md.textContent;
  }).observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true});
}"""


def _errors(page) -> list[str]:
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    return errors


def _console_errors(page) -> list[str]:
    """Console errors, failed loads included (a page without an icon logged a 401 for
    /favicon.ico on every load)."""
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    return errors


def test_playground_streams_an_answer(server, browser):
    page = browser.new_page()
    errors = _errors(page)
    page.goto(server.url_for("/"))
    expect(page.locator("#key-dialog")).to_be_visible()  # /v1/models answered 401: the page asks
    page.fill("#key-input", API_KEY)
    page.click("#key-ok")
    expect(page.locator("#model option")).to_have_text([MODEL])
    page.fill("#max_tokens", "16")
    page.fill("#temperature", "0")
    page.fill("#prompt", "Name three colors.")
    page.evaluate(WATCH_PARTIAL)
    page.press("#prompt", "Enter")
    # the answer appears while it is streamed (the message is still pending), then finishes.
    # A 16-token answer can stream in under half a second, between two of Playwright's polls
    # (CI once missed it): a DOM observer records the partial text as it appears instead.
    done = page.locator(".msg.assistant:not(.pending)")
    expect(done.locator(".stats")).to_contain_text("tok/s")
    stats = done.locator(".stats").inner_text()
    assert "prompt" in stats and "generated tokens" in stats, stats
    answer = done.locator(".md").inner_text()
    assert answer.strip(), stats
    assert page.evaluate("window.__partialSeen"), "no text appeared before the answer finished"
    page.reload()  # the conversation is kept in the browser
    expect(page.locator(".msg.assistant .md")).to_have_text(answer)
    # Stop aborts the fetch: the answer ends early, marked stopped
    page.fill("#max_tokens", "400")
    # A prompt the model answers to the 400-token budget in float32, bfloat16 and packed
    # weights alike (the counting prompt ended at 122 tokens, before a slow click could land)
    page.fill("#prompt", "Write a long story about a dragon, at least 500 words.")
    page.press("#prompt", "Enter")
    expect(page.locator(".msg.assistant.pending .md")).not_to_be_empty()
    page.click("#stop")
    expect(page.locator(".msg.assistant").last.locator(".stats")).to_contain_text("stopped")
    expect(page.locator("#send")).to_be_visible()
    assert not errors, errors
    page.close()


# A stream as the server sends it when a reasoning and a tool parser are set (SmolLM2 has
# neither), with raw HTML in the content that must not reach the page as HTML.
RICH_STREAM = [
    {"delta": {"role": "assistant", "content": ""}},
    {"delta": {"reasoning": "Let me think.", "reasoning_content": "Let me think."}},
    {"delta": {"content": "**bold** <img src=x onerror=\"window.pwned=1\"> and\n```python\nprint(1)\n```\n"}},
    {"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": "{\"city\":"}}]}},
    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": " \"Paris\"}"}}]}},
    {"delta": {}, "finish_reason": "tool_calls"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_playground_renders_reasoning_tool_calls_and_sanitized_markdown(server, browser):
    """The page's side of a stream with reasoning, tool-call fragments and markdown with raw
    HTML (the stream is played back through Playwright's request routing; the request the
    page sent is checked: its settings, system prompt, tools and usage option)."""
    chunks = [{"id": "chatcmpl-x", "object": "chat.completion.chunk", "choices": [{"index": 0, **c}]}
              for c in RICH_STREAM] + [{"id": "chatcmpl-x", "choices": [],
                                        "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    sent = []

    def play(route):
        sent.append(route.request.post_data_json)
        route.fulfill(status=200, body=sse, headers={"Content-Type": "text/event-stream"})

    page = browser.new_page()
    errors = _errors(page)
    page.route("**/v1/chat/completions", play)
    page.goto(server.url_for("/"))
    expect(page.locator("#model option")).to_have_text([MODEL])  # the key is kept from the first test
    page.click("#new-chat")
    page.fill("#system", "Be brief.")
    page.fill("#tools", json.dumps(TOOLS))
    page.fill("#max_tokens", "33")
    page.fill("#prompt", "Weather in Paris?")
    page.press("#prompt", "Enter")
    msg = page.locator(".msg.assistant:not(.pending)").last
    expect(msg.locator(".stats")).to_contain_text("7 generated tokens")
    expect(msg.locator(".stats")).to_contain_text("tool_calls")
    expect(msg.locator(".reasoning summary")).to_have_text("Reasoning")
    expect(msg.locator(".reasoning-text")).to_have_text("Let me think.")  # once, not under both names
    expect(msg.locator(".md strong")).to_have_text("bold")
    expect(msg.locator(".md pre code")).to_have_text("print(1)\n")
    assert msg.locator(".md img[onerror]").count() == 0  # DOMPurify removed the handler
    expect(msg.locator(".tool-call .tool-name")).to_contain_text("get_weather")
    assert json.loads(msg.locator(".tool-call pre").inner_text()) == {"city": "Paris"}
    body = sent[-1]
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert body["messages"][-1] == {"role": "user", "content": "Weather in Paris?"}
    assert body["tools"] == TOOLS and body["max_tokens"] == 33 and body["model"] == MODEL
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert not errors, errors
    page.close()


def _stream(server, i: int, ids: list[str]) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell story {i} about a lighthouse."}],
            "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url_for("v1/chat/completions"), json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and not ids[i]:
                ids[i] = line.split('"id":"', 1)[1].split('"', 1)[0]


def _generated(page) -> list[int]:
    return [int(t) for t in page.locator("#active tr[data-state=running] .c-gen").all_inner_texts()]


def _grown_while_running(page, first: int) -> bool:
    for _ in range(100):
        page.wait_for_timeout(100)
        counts = _generated(page)
        if len(counts) < N_STREAMS:
            return False
        if sum(counts) > first:
            return True
    return False


@pytest.mark.slow  # ~8 s in Chromium; the pages' data and markup: tests/entrypoints/test_webui.py; `make test-all`
def test_live_view_shows_eight_streams_then_their_timelines(server, browser):
    page = browser.new_page()
    errors, console = _errors(page), _console_errors(page)
    page.goto(server.url_for("/live") + f"?refresh={REFRESH_MS}")
    expect(page.locator("#updated")).to_contain_text("updated")
    ids = [""] * N_STREAMS
    threads = [threading.Thread(target=_stream, args=(server, i, ids)) for i in range(N_STREAMS)]
    for t in threads:
        t.start()
    try:
        expect(page.locator("#active tr[data-state=running]")).to_have_count(N_STREAMS)
        # a later refresh shows more tokens while all 8 still run
        assert _grown_while_running(page, sum(_generated(page))), "the token counts did not grow"
    finally:
        for t in threads:
            t.join()
    assert all(ids), ids
    for rid in ids:  # each finished request, with its timeline as bars (decode at least)
        row = page.locator(f'#finished .tl-row[data-id="{rid}"]')
        expect(row.locator(".bar .seg.decode")).to_have_count(1)
        expect(row.locator(".bar .tick")).not_to_have_count(0)  # each scheduling
    expect(page.locator("#active tr[data-state]")).to_have_count(0)
    assert page.locator("#s-gen").inner_text() != "–"
    assert not errors, errors
    assert not console, console  # the key is in localStorage by now: no 401, no favicon fetch
    page.close()
