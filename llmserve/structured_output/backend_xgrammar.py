"""The xgrammar backend (vLLM's ``v1/structured_output/backend_xgrammar.py``): one
``TokenizerInfo`` built from the engine's tokenizer with the model's logits vocabulary
size, one ``GrammarCompiler``, a cache of compiled grammars keyed by
``(kind, spec, any_whitespace)``, and one ``GrammarMatcher`` per request."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

from llmserve.structured_output.grammar import GrammarKey, build_grammar


class XgrammarGrammar:
    """One request's matcher over a compiled grammar.

    accept_token advances it; fill_bitmask writes the allowed next tokens into one row of
    an int32 bitmask [rows, ceil(V / 32)] (bit t of word t // 32 set = token t allowed);
    rollback(k) undoes the last k accepted tokens; is_terminated is True once a stop token
    was accepted after the grammar completed."""

    __slots__ = ("matcher", "num_processed_tokens")

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_processed_tokens = 0

    def accept_token(self, token_id: int) -> bool:
        """Advance with one sampled token; False when the grammar does not allow it."""
        ok = self.matcher.accept_token(token_id)
        if ok:
            self.num_processed_tokens += 1
        return ok

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()
        self.num_processed_tokens = 0


class XgrammarBackend:
    """Compiles constraints for one tokenizer.

    Args: tokenizer (a Hugging Face tokenizer), vocab_size (columns of the model's logits,
    which may exceed the tokenizer's length), stop_token_ids (tokens that end a completed
    grammar: the model's EOS ids), cache_size (compiled grammars kept, LRU).
    ``compile`` is thread-safe and may run in a worker thread; it raises ValueError for a
    constraint that does not convert."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None)
        # xgrammar's own cache is off: with it, compile_grammar of a JSON-schema enum of
        # 20,000 strings took 12.3-14.3 s instead of 1.7-2.4 s (xgrammar 0.2.9, same
        # process, alternating; /tmp/m/gram/cache.py), it has no size limit by default,
        # and it would keep the result of a compile whose request was aborted while it
        # ran (the manager drops those). The LRU cache below, keyed by the spec, is kept.
        # max_threads=1: one compile per worker thread (the manager runs several).
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[GrammarKey, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def cached(self, key: GrammarKey) -> Any:
        """The CompiledGrammar of ``key`` when it is in the cache (now most recently
        used), else None."""
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def compile_uncached(self, key: GrammarKey) -> Any:
        """Compile ``key`` (the cache is neither read nor written). Raises ValueError for
        a constraint that does not convert, RuntimeError for one xgrammar cannot compile."""
        return self.compiler.compile_grammar(build_grammar(key))

    def keep(self, key: GrammarKey, compiled: Any) -> None:
        """Put a compiled grammar in the LRU cache (the oldest leaves past cache_size)."""
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def compile(self, key: GrammarKey) -> Any:
        """The CompiledGrammar of ``key`` (from the cache when compiled before)."""
        hit = self.cached(key)
        if hit is not None:
            return hit
        compiled = self.compile_uncached(key)
        self.keep(key, compiled)
        return compiled

    def new_grammar(self, key: GrammarKey) -> XgrammarGrammar:
        return XgrammarGrammar(self.compile(key))

    def allocate_token_bitmask(self, rows: int) -> torch.Tensor:
        """int32 [rows, ceil(vocab_size / 32)], all bits set (every token allowed)."""
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(rows, self.vocab_size)
