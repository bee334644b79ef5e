"""start_engine_and_frontend's on_tokenizer: the caller's tokenizer work runs in the
tokenizer's thread before the start returns (the server's prompt-length limit, while the
engine loads), and its failure does not fail the start."""
from __future__ import annotations

import threading


def test_on_tokenizer_runs_in_the_frontend_thread_and_its_error_is_left_to_the_caller(monkeypatch):
    from llmserve.engine import llm_engine

    monkeypatch.setattr(llm_engine, "load_frontend", lambda config: "tok")
    seen = []
    started = llm_engine.start_engine_and_frontend(
        None, lambda: "client", lambda t: seen.append((t, threading.current_thread().name)))
    assert started == ("client", "tok")
    assert seen[0][0] == "tok" and seen[0][1].startswith("llmserve-frontend")

    def fails(tokenizer):
        raise ValueError("bad vocabulary")

    assert llm_engine.start_engine_and_frontend(None, lambda: "client", fails) == ("client", "tok")
    assert llm_engine.start_engine_and_frontend(None, lambda: "client") == ("client", "tok")
