"""The first structured-output request imports the grammar backend in a worker thread,
once, and only a body that may ask for a grammar waits for it
(llmserve/structured_output/backend_import.py)."""
from __future__ import annotations

import asyncio
import sys
import threading

from llmserve.structured_output import backend_import


def _fake_backend(tmp_path, monkeypatch, name: str, seconds: float = 0.3):
    (tmp_path / f"{name}.py").write_text(
        "import threading, time\n"
        "IMPORTED_IN = threading.current_thread().name\n"
        "COUNT = globals().get('COUNT', 0) + 1\n"
        f"time.sleep({seconds})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_markers_cover_every_front_door_that_builds_a_grammar():
    assert backend_import.may_need_grammar(b'{"response_format": {"type": "json_object"}}')
    assert backend_import.may_need_grammar(b'{"tool_choice": "required", "tools": []}')
    assert backend_import.may_need_grammar(b'{"structured_outputs": {"regex": "a+"}}')
    assert backend_import.may_need_grammar(b'{"guided_json": {}}')
    assert backend_import.may_need_grammar(b'{"model": "m", "format": "json"}')  # Ollama
    assert backend_import.may_need_grammar(b'{"text": {"format": {"type": "json_schema"}}}')  # Responses
    assert not backend_import.may_need_grammar(b'{"messages": [{"role": "user", "content": "hi"}]}')


def test_import_runs_once_in_a_worker_thread_while_the_loop_keeps_running(tmp_path, monkeypatch):
    name = "llmserve_fake_grammar_backend"
    _fake_backend(tmp_path, monkeypatch, name)
    body = b'{"response_format": {"type": "json_object"}}'

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        await asyncio.gather(*(backend_import.prepare_grammar_backend(body, name) for _ in range(3)))
        task.cancel()
        return ticks

    ticks = asyncio.run(main())
    module = sys.modules[name]
    assert module.IMPORTED_IN != threading.main_thread().name
    assert module.COUNT == 1
    assert ticks >= 5  # the loop ran while the (0.3 s) import did


def test_a_body_without_markers_imports_nothing(tmp_path, monkeypatch):
    name = "llmserve_fake_grammar_backend2"
    _fake_backend(tmp_path, monkeypatch, name, seconds=0)
    asyncio.run(backend_import.prepare_grammar_backend(b'{"prompt": "hi"}', name))
    assert name not in sys.modules


def test_a_failed_import_is_left_to_the_request(tmp_path, monkeypatch, caplog):
    monkeypatch.delitem(sys.modules, "llmserve_no_such_backend", raising=False)
    asyncio.run(backend_import.prepare_grammar_backend(b'{"tool_choice": "required"}', "llmserve_no_such_backend"))
    assert "llmserve_no_such_backend" in caplog.text
