"""Turns user prompts and SamplingParams into EngineCoreRequests (vLLM's
InputProcessor): tokenizes, validates lengths and token ids, resolves max_tokens and
the stop/EOS token ids."""
from __future__ import annotations

import time
from typing import Any, Optional, Union

from llmserve.config import ModelConfig
from llmserve.engine.messages import EngineCoreRequest
from llmserve.sampling_params import SamplingParams, SamplingParamsError
from llmserve.tokenizer import check_encodable

# A prompt: text, or {"prompt_token_ids": [...], optional "prompt": text}, or {"prompt": text}.
PromptType = Union[str, dict[str, Any], list[int]]


class InputProcessor:
    """Args: model_config; tokenizer (HF); generation_config: the model's defaults dict
    (may hold "eos_token_id" as an int or list); strict_max_tokens: raise when
    prompt + max_tokens exceeds max_model_len (the server's behaviour) instead of letting
    the request stop at the limit with finish_reason "length" (the offline behaviour)."""

    def __init__(self, model_config: ModelConfig, tokenizer, generation_config: Optional[dict] = None,
                 strict_max_tokens: bool = False) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.strict_max_tokens = strict_max_tokens
        self.eos_token_id: Optional[int] = tokenizer.eos_token_id
        gen_eos = (generation_config or {}).get("eos_token_id")
        if isinstance(gen_eos, int):
            gen_eos = [gen_eos]
        self.extra_eos_ids: set[int] = set(gen_eos or []) - {self.eos_token_id}
        self.vocab_size = model_config.vocab_size

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """Returns (prompt text or None, prompt token ids). Raises ValueError."""
        if isinstance(prompt, str):
            return prompt, self._encode_prompt(prompt)
        if isinstance(prompt, list):
            return None, list(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self._encode_prompt(prompt["prompt"])
        raise ValueError("prompt must be a string, a list of token ids, or a dict with "
                         "'prompt' or 'prompt_token_ids'")

    def _encode_prompt(self, text: str) -> list[int]:
        """Token ids of a text prompt, special tokens added. Raises SamplingParamsError
        for text that is not valid Unicode."""
        check_encodable(text, "prompt")
        return self.tokenizer.encode(text, add_special_tokens=True)

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: Optional[float] = None, priority: int = 0,
                       ) -> tuple[EngineCoreRequest, Optional[str]]:
        """Validate and build the EngineCoreRequest.

        Raises ValueError (SamplingParamsError with ``param``) when the prompt is empty,
        holds token ids outside [0, vocab_size), is not shorter than max_model_len, or
        (strict mode) prompt + max_tokens exceeds max_model_len.
        """
        text, ids = self.tokenize_prompt(prompt)
        max_len = self.model_config.max_model_len
        n = len(ids)
        if n == 0:
            raise SamplingParamsError("The prompt cannot be empty.", "prompt")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise SamplingParamsError(
                    f"Token id {t!r} is out of vocabulary (valid ids are 0..{self.vocab_size - 1}).", "prompt")
        if n >= max_len:
            raise SamplingParamsError(
                f"This model's maximum context length is {max_len} tokens. However, your request has "
                f"{n} input tokens, which leaves no room for output. Please reduce the length of the input.",
                "prompt")
        params = params.clone()
        room = max_len - n
        if params.max_tokens is None:
            params.max_tokens = room
        elif params.max_tokens > room and self.strict_max_tokens:
            raise SamplingParamsError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion). "
                f"Please reduce the length of the prompt or of max_tokens.", "max_tokens")
        if not params.ignore_eos:
            params.all_stop_token_ids |= self.extra_eos_ids
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_ids(params.bad_words)
        if params.allowed_token_ids is not None:
            bad = [t for t in params.allowed_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise SamplingParamsError(f"allowed_token_ids out of vocabulary: {bad[:5]}", "allowed_token_ids")
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
            if bad:
                raise SamplingParamsError(f"logit_bias token ids out of vocabulary: {bad[:5]}", "logit_bias")
        req = EngineCoreRequest(request_id=request_id, prompt_token_ids=ids, sampling_params=params,
                                eos_token_id=self.eos_token_id,
                                arrival_time=arrival_time if arrival_time is not None else time.time(),
                                priority=priority)
        return req, text

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word tokenized with and without a leading space (vLLM's rule)."""
        out: list[list[int]] = []
        for w in words:
            check_encodable(w, "bad_words")
            for variant in (w, " " + w.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out
