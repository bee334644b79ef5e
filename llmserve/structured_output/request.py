"""The structured-output state of one engine request (vLLM's ``StructuredOutputRequest``)."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Optional

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured_output.backend_xgrammar import XgrammarGrammar
from llmserve.structured_output.grammar import GrammarKey


class StructuredOutputRequest:
    """params: the request's constraint; key: its grammar key; future: the grammar being
    compiled on the manager's CompileQueue (None once taken; cancelling it withdraws the
    request from that compile); grammar: the request's matcher
    once compiled; reasoning_ended: whether the grammar applies yet (True without a
    reasoning parser); error: the compile error, when compilation failed."""

    __slots__ = ("params", "key", "future", "grammar", "reasoning_ended", "error")

    def __init__(self, params: StructuredOutputsParams, key: GrammarKey, reasoning_ended: bool) -> None:
        self.params = params
        self.key = key
        self.future: Optional[Future] = None
        self.grammar: Optional[XgrammarGrammar] = None
        self.reasoning_ended = reasoning_ended
        self.error: Optional[str] = None

    def is_ready(self) -> bool:
        """True once compilation ended (with a grammar or an error); takes the result."""
        if self.grammar is not None or self.error is not None:
            return True
        fut = self.future
        if fut is None or not fut.done():
            return False
        self.future = None
        try:
            self.grammar = fut.result()
        except Exception as e:  # noqa: BLE001 - reported on the request, never kills the engine
            self.error = f"{type(e).__name__}: {e}"
        return True

    def cancel(self) -> None:
        if self.future is not None:
            self.future.cancel()
            self.future = None
