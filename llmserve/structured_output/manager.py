"""``StructuredOutputManager`` (vLLM's ``v1/structured_output/__init__.py``): lives in the
engine process next to the scheduler.

* ``grammar_init`` queues a request's grammar on the ``CompileQueue`` (compile_queue.py:
  several workers, large grammars kept off one of them, one compile per key, an aborted
  request's compile skipped or its result dropped); the scheduler keeps the request in
  ``WAITING_FOR_FSM`` until ``StructuredOutputRequest.is_ready``.
* ``grammar_bitmask`` builds, once per step, one int32 bitmask with a row per constrained
  request that samples in the step (a chunked prefill that ends mid-prompt samples
  nothing and gets no row); the runner applies it to those logits rows before sampling.
* ``accept_token`` advances a request's matcher with its sampled token; True means the
  grammar terminated, and the request finishes with ``stop``.

Nothing is built until the first constrained request: the tokenizer (for xgrammar's
``TokenizerInfo``) and the reasoning parser load lazily in the pool thread, so engines
that never see one pay nothing.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING, Any, Optional

from llmserve.structured_output.backend_xgrammar import XgrammarBackend, XgrammarGrammar
from llmserve.structured_output.compile_queue import CompileQueue
from llmserve.structured_output.config import StructuredOutputsConfig
from llmserve.structured_output.grammar import grammar_key
from llmserve.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from llmserve.config import VllmConfig
    from llmserve.core.request import Request
    from llmserve.core.sched_output import ScheduledRequest

logger = logging.getLogger(__name__)

# A grammar whose spec (JSON schema text, regex, EBNF, choices) has at least this many
# characters is "large" for the CompileQueue: it may not take the last worker, which
# stays free for small ones. Measured (SmolLM2 tokenizer, one thread, this 2-core machine):
# json_object and choice compile in ~5 ms; a JSON-schema enum of 5,000 strings (~70 KiB)
# in 0.04 s, of 20,000 (~280 KiB) in 1.3-2.4 s, of 40,000 (~575 KiB) in 3.9 s. The size is
# only a proxy: a short regex such as [a-z]{1,2000} takes 0.46 s and counts as small.
LARGE_GRAMMAR_CHARS = 16 * 1024


class StructuredOutputManager:
    """Compiles, masks and advances the grammars of one engine's requests.

    Args: vllm_config (its ``structured_outputs_config``, model vocab size and tokenizer),
    tokenizer: optional, to skip loading it (tests, the in-process engine).
    ``reasoner`` may be set directly (tests inject a fake with
    ``is_reasoning_end(input_ids: list[int]) -> bool``)."""

    def __init__(self, vllm_config: "VllmConfig", tokenizer: Any = None) -> None:
        self.vllm_config = vllm_config
        self.config: StructuredOutputsConfig = getattr(vllm_config, "structured_outputs_config", None) \
            or StructuredOutputsConfig()
        self._tokenizer = tokenizer
        self.backend: Optional[XgrammarBackend] = None
        self.reasoner: Any = None
        self._init_lock = threading.Lock()
        self._queue: Optional[CompileQueue] = None
        # Seconds spent compiling (not counting cache hits); for the bench's report.
        self.compile_seconds = 0.0
        # One bitmask buffer, reused every step (grown when more rows sample): a fresh
        # 32 x 1536-word allocation per step took 3.3% of the engine's time at 32 JSON-schema
        # streams (py-spy; new pages faulted in each time).
        self._bitmask: Any = None

    # ---- lazy set-up (in the pool thread) --------------------------------
    def _ensure_backend(self) -> XgrammarBackend:
        with self._init_lock:
            if self.backend is None:
                tok = self._tokenizer
                if tok is None:
                    from llmserve.tokenizer import get_model_tokenizer
                    tok = self._tokenizer = get_model_tokenizer(self.vllm_config.model_config)
                mc = self.vllm_config.model_config
                stop = sorted({tok.eos_token_id, *mc.extra_eos_token_ids} - {None})
                self.backend = XgrammarBackend(tok, mc.vocab_size, stop)
                name = self.config.reasoning_parser
                if name and self.reasoner is None:
                    from llmserve.reasoning import ReasoningParserManager  # only with --reasoning-parser
                    self.reasoner = ReasoningParserManager.get_reasoning_parser(name)(tok)
            return self.backend

    def _compile_key(self, key: Any) -> Any:
        """The CompiledGrammar of ``key`` (in a worker): from the cache, else compiled."""
        backend = self._ensure_backend()
        hit = backend.cached(key)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        compiled = backend.compile_uncached(key)
        self.compile_seconds += time.perf_counter() - t0
        return compiled

    def _matcher(self, sor: StructuredOutputRequest, prompt_token_ids: list[int], compiled: Any) -> XgrammarGrammar:
        """The request's matcher over ``compiled`` (in the worker that compiled it), after
        deciding whether its prompt already ended the reasoning."""
        if sor.reasoning_ended is None:  # vLLM: a prompt may already close the reasoning
            sor.reasoning_ended = self._reasoning_ended_in(prompt_token_ids)
        return XgrammarGrammar(compiled)

    def _compile_queue(self) -> CompileQueue:
        if self._queue is None:
            self._queue = CompileQueue(self._compile_key, lambda key, compiled: self._ensure_backend().keep(key, compiled),
                                       self.config.max_compile_workers, LARGE_GRAMMAR_CHARS)
        return self._queue

    def _reasoning_ended_in(self, prompt_token_ids: list[int]) -> bool:
        return (self.reasoner is None or self.config.enable_in_reasoning
                or bool(self.reasoner.is_reasoning_end(prompt_token_ids)))

    # ---- per request -------------------------------------------------------
    def grammar_init(self, request: "Request", reasoning_ended: Optional[bool] = None) -> None:
        """Attach a StructuredOutputRequest to ``request`` and start compiling its grammar
        off the step loop. ``reasoning_ended``: from the front end (None: decided here)."""
        params = request.sampling_params.structured_outputs
        key = grammar_key(params, not self.config.disable_any_whitespace)
        if not self.config.reasoning_parser:
            reasoning_ended = True
        sor = StructuredOutputRequest(params, key, reasoning_ended)
        request.structured_output_request = sor
        prompt = list(request.prompt_token_ids)
        finish = functools.partial(self._matcher, sor, prompt)
        hit = self.backend.cached(key) if self.backend is not None else None
        # A cached grammar is "small" whatever its size: only a matcher to build.
        sor.future = self._compile_queue().submit(key, 0 if hit is not None else len(key[1]), finish)

    def grammar_restart(self, request: "Request") -> None:
        """Streaming input: a new prompt chunk starts a new generation, so its grammar
        starts over. Same constraint (the chunk kept the request's params, or sent the
        same one): the compiled matcher is reset, and whether reasoning has ended is
        decided again on the grown prompt. Another constraint: a new grammar compiles (the
        caller waits for it as for a new request). None: the request runs unconstrained."""
        params = request.sampling_params.structured_outputs
        old = request.structured_output_request
        if params is None:
            if old is not None:
                old.cancel()
            request.structured_output_request = None
            return
        key = grammar_key(params, not self.config.disable_any_whitespace)
        if old is not None and old.key == key and old.grammar is not None:
            old.grammar.reset()
            old.reasoning_ended = (True if not self.config.reasoning_parser
                                   else self._reasoning_ended_in(list(request.prompt_token_ids)))
            return
        if old is not None:
            old.cancel()
        self.grammar_init(request)

    def wait_for_compile(self, requests: list["Request"], timeout: float) -> None:
        """Block up to ``timeout`` seconds until one of these requests' grammars is
        compiled (the engine calls this when nothing else can run)."""
        futs = [r.structured_output_request.future for r in requests
                if r.structured_output_request.future is not None]
        if futs:
            wait(futs, timeout=timeout, return_when=FIRST_COMPLETED)

    def should_fill_bitmask(self, request: "Request") -> bool:
        """Whether the request's grammar masks its next token (compiled, and the reasoning
        before it has ended). A compiled grammar still waiting for the end of the reasoning
        gets a row too (see grammar_bitmask): every token but the stop tokens."""
        sor = request.structured_output_request
        return sor.grammar is not None and (sor.reasoning_ended or self.config.enable_in_reasoning)

    def grammar_bitmask(self, scheduled: list["ScheduledRequest"]) -> tuple[Any, dict[str, int]]:
        """(int32 bitmask [R, ceil(V/32)], {request_id: bitmask row}) for the constrained
        requests that sample this step; (None, {}) when there are none. A request whose
        grammar waits for the end of its reasoning gets a row that allows every token but
        its stop tokens (EOS, ``stop_token_ids``): the reasoning is free, but the request
        cannot end before the constrained answer, so a finish "stop" always carries an
        answer the grammar accepted and a reasoning that never ends runs into "length"
        (case C59: otherwise an EOS while thinking ended the request "stop" with no
        content to validate). The bitmask is a
        view of a buffer the next call overwrites: the step that gets it must use it (or
        copy it, as the multiprocess executor's pickling does) before the next schedule."""
        rows: list["Request"] = []
        for s in scheduled:
            req = s.request
            sor = req.structured_output_request
            if (sor is not None and sor.grammar is not None
                    and s.num_computed_tokens + s.num_scheduled_tokens >= req.num_tokens):
                rows.append(req)
        if not rows:
            return None, {}
        bitmask = self._bitmask_buffer(len(rows))
        index: dict[str, int] = {}
        for i, req in enumerate(rows):
            if self.should_fill_bitmask(req):
                req.structured_output_request.grammar.fill_bitmask(bitmask, i)
            else:
                _forbid(bitmask, i, _stop_ids(req))
            index[req.request_id] = i
        return bitmask, index

    def _bitmask_buffer(self, rows: int) -> Any:
        """The first ``rows`` rows of the reused bitmask buffer, every bit set."""
        buf = self._bitmask
        if buf is None or buf.shape[0] < rows:
            buf = self._bitmask = self.backend.allocate_token_bitmask(max(rows, 16, 2 * (0 if buf is None else buf.shape[0])))
        view = buf[:rows]
        view.fill_(-1)
        return view

    def accept_token(self, request: "Request", token_id: int) -> bool:
        """Advance the request's matcher with its newly sampled token (the last of
        ``request.output_token_ids``). Returns True when the grammar has terminated.
        While reasoning lasts the matcher stays put; the step whose token ends the
        reasoning (``is_reasoning_end`` on the output so far) does not advance it either."""
        sor = request.structured_output_request
        if sor.grammar is None:
            return False
        if not sor.reasoning_ended and not self.config.enable_in_reasoning:
            if self.reasoner is not None and self.reasoner.is_reasoning_end(list(request.output_token_ids)):
                sor.reasoning_ended = True
            return False
        if not sor.grammar.accept_token(token_id):
            # The mask allows only accepted tokens; this happens only when a sampling
            # fallback overrode it (every allowed token blocked by other constraints).
            logger.warning("Request %s: sampled token %d is not allowed by its grammar; the "
                           "request stops here", request.request_id, token_id)
            return True
        return sor.grammar.is_terminated()

    def shutdown(self) -> None:
        if self._queue is not None:
            self._queue.shutdown()


def _stop_ids(request: "Request") -> set[int]:
    """The token ids that would end ``request`` now (EOS unless ignored, its stop ids)."""
    params = request.sampling_params
    ids = set(params.all_stop_token_ids)
    if request.eos_token_id is not None and not params.ignore_eos:
        ids.add(request.eos_token_id)
    return ids


def _forbid(bitmask: Any, row: int, token_ids: set[int]) -> None:
    """Clear the bits of ``token_ids`` in ``bitmask[row]`` (int32 words, bit ``t % 32`` of
    word ``t // 32`` is token ``t``); ids past the bitmask's width are left alone."""
    words = bitmask.shape[1]
    for t in token_ids:
        word, bit = divmod(t, 32)
        if 0 <= word < words:
            value = (int(bitmask[row, word]) & 0xFFFFFFFF) & ~(1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
