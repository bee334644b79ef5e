"""Incremental detokenization with stop strings (vLLM's IncrementalDetokenizer).

New text is the decode of a short window of tokens minus the decode of the window's
already-read part, so the text never contains a broken UTF-8 character (a trailing
U+FFFD is held back until the next token completes it) and matches the tokenizer's own
``decode`` of the whole output.
"""
from __future__ import annotations

from typing import Optional

from llmserve.sampling_params import SamplingParams

_CONTEXT_TOKENS = 5  # prompt tokens used as left context for the first output token


class IncrementalDetokenizer:
    """Per-request detokenizer.

    Args: tokenizer (HF); prompt_token_ids; params (skip_special_tokens, stop strings,
    include_stop_str_in_output).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop or [])
        self.include_stop = params.include_stop_str_in_output
        # vLLM: stop strings are not checked until more than min_tokens tokens exist.
        self.min_tokens = params.min_tokens
        self.detokenize = params.detokenize
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.output_text = ""
        self.token_ids: list[int] = []
        # Characters withheld from streamed deltas so a partial stop string is never sent.
        self.stop_buffer_length = 0 if self.include_stop or not self.stop else max(len(s) for s in self.stop) - 1
        self._sent = 0
        self.num_dropped = 0  # tokens of the last update dropped after a stop string
        self.hidden_stops = _hidden_stop_tokens(tokenizer, self.stop) if self.skip_special_tokens else {}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> Optional[str]:
        """Add tokens; returns the stop string matched in the new text, if any (the text
        is then truncated). stop_terminated: the last token is an EOS/stop token whose text
        is not part of the output (unless include_stop_str_in_output). Several tokens at
        once (speculative decoding) are checked one by one, so a stop string ends the
        output at the token that completed it, as when they come one per step; the tokens
        after it are dropped (``num_dropped`` says how many)."""
        self.num_dropped = 0
        if len(new_token_ids) > 1 and self.stop and self.detokenize:
            last = len(new_token_ids) - 1
            for i, tok in enumerate(new_token_ids):
                stop = self.update([tok], stop_terminated and i == last)
                if stop is not None:
                    self.num_dropped = last - i
                    return stop
            return None
        self.token_ids.extend(new_token_ids)
        if not self.detokenize:
            return None
        hidden = self._hidden_stop(new_token_ids, stop_terminated)
        if hidden is not None:
            return hidden
        n_text = len(new_token_ids)
        if stop_terminated and not self.include_stop:
            n_text -= 1
        start_len = len(self.output_text)
        for tok in new_token_ids[:max(n_text, 0)]:
            self.ids.append(tok)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.output_text += full[len(prefix):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        if self.stop and len(self.output_text) > start_len and len(self.token_ids) > self.min_tokens:
            return self._check_stop(start_len)
        return None

    def _hidden_stop(self, new_token_ids: list[int], stop_terminated: bool) -> Optional[str]:
        """The stop string whose special token (skipped from the text) was just generated,
        with the text ending before it (or holding the string with
        include_stop_str_in_output); None when no such token came, or when it is the EOS
        or stop token that ends the request anyway (stop_terminated)."""
        if len(new_token_ids) != 1 or stop_terminated or len(self.token_ids) <= self.min_tokens:
            return None
        stop = self.hidden_stops.get(new_token_ids[0])
        if stop is not None and self.include_stop:
            self.output_text += stop
        return stop

    def _check_stop(self, start_len: int) -> Optional[str]:
        best: Optional[tuple[int, str]] = None
        for s in self.stop:
            lo = max(0, start_len - len(s) + 1)
            idx = self.output_text.find(s, lo)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.output_text = self.output_text[:idx + len(s)] if self.include_stop else self.output_text[:idx]
        return s

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The whole text (delta=False) or what is new since the last call (delta=True);
        while running, the last stop_buffer_length characters are withheld."""
        n = len(self.output_text) if finished else max(0, len(self.output_text) - self.stop_buffer_length)
        if not delta:
            return self.output_text[:n]
        if n <= self._sent:
            return ""
        out = self.output_text[self._sent:n]
        self._sent = n
        return out


def _hidden_stop_tokens(tokenizer, stops: list[str]) -> dict[int, str]:
    """{token id: stop string} for the stop strings that are one special token which
    skip_special_tokens leaves out of the text (``"<|im_end|>"``): matched on the text
    alone they could never fire, so generation ran on to max_tokens (vLLM issue 2123,
    koboldcpp issues 791 and 812, which now stop on such a token)."""
    out: dict[int, str] = {}
    for stop in stops:
        try:
            tid = tokenizer.convert_tokens_to_ids(stop)
        except (AttributeError, TypeError, ValueError, KeyError):  # a tokenizer without the lookup
            continue
        if not isinstance(tid, int) or tid < 0:
            continue
        if tokenizer.decode([tid], skip_special_tokens=False) == stop and \
                tokenizer.decode([tid], skip_special_tokens=True) == "":
            out[tid] = stop
    return out
