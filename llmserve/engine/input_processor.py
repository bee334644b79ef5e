"""Turns user prompts and SamplingParams into EngineCoreRequests (vLLM's
InputProcessor): tokenizes, validates lengths and token ids, resolves max_tokens and
the stop/EOS token ids."""
from __future__ import annotations

import time
from typing import Any, Optional, Union

from llmserve.beam_search import BeamSearchParams
from llmserve.config import CacheConfig, ModelConfig
from llmserve.engine.messages import EncoderInputs, EngineCoreRequest
from llmserve.engine.pooling_inputs import (classified_prefix, compress_token_type_ids, task_hint, truncate_start,
                                           truncate_text_ids)
from llmserve.pooler_config import PoolerConfig
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import ContextLengthExceededError, SamplingParams, SamplingParamsError
from llmserve.structured_output.grammar import validate_structured_outputs
from llmserve.tokenizer import check_encodable

# The most bad ids an error message lists (the body stays small for huge requests).
MAX_LISTED_IDS = 100
# The pooler of a generating model's embeddings (PoolingParams.hidden_state_embed): the last
# token's hidden state, normalised, as vLLM's embed conversion of a causal LM (--convert embed).
HIDDEN_STATE_POOLER = PoolerConfig("LAST", True)


def list_ids(ids: list[Any]) -> str:
    """``ids`` for an error message: all of them, or the first MAX_LISTED_IDS and the count."""
    if len(ids) <= MAX_LISTED_IDS:
        return ", ".join(map(str, ids))
    return ", ".join(map(str, ids[:MAX_LISTED_IDS])) + f", ... ({len(ids)} in all)"


def _is_token_id(t: Any, vocab_size: int) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size


# SamplingParams fields that change the sampled token only: beams are ranked by raw
# logprobs (core/beam_search.py), so these would be silently ignored; they are refused.
_BEAM_REFUSED = (("stop", None), ("logit_bias", None), ("allowed_token_ids", None), ("bad_words", None),
                 ("structured_outputs", None), ("prompt_logprobs", None), ("min_tokens", 0),
                 ("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0))


def check_beam_search(params: SamplingParams, beam: BeamSearchParams, max_num_seqs: Optional[int]) -> None:
    """Refuse what a beam search cannot honour, as SamplingParamsError naming the field:
    ``n`` (the beam width) above max_num_seqs (every beam is a running sequence), and the
    fields in ``_BEAM_REFUSED`` (stop strings, logit_bias, allowed_token_ids, bad_words,
    structured outputs, prompt_logprobs, min_tokens, penalties)."""
    if max_num_seqs is not None and beam.beam_width > max_num_seqs:
        raise SamplingParamsError(
            f"Beam search with n (beam_width) = {beam.beam_width} needs that many running sequences, "
            f"more than max_num_seqs = {max_num_seqs}.", "n")
    for name, default in _BEAM_REFUSED:
        value = getattr(params, name)
        if value not in (default, [], {}, ""):
            raise SamplingParamsError(f"{name} is not supported with beam search (use_beam_search).", name)


def _has_token_ids(prompt: Any) -> bool:
    """The prompt came as token ids (a list, or a dict with ``prompt_token_ids``)."""
    return isinstance(prompt, list) or (isinstance(prompt, dict) and "prompt_token_ids" in prompt)


def truncate_prompt(ids: list[int], truncate_prompt_tokens: Optional[int], max_model_len: int,
                    side: Optional[str] = None) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep at most that many prompt tokens (-1: the
    model's context length), the last ones (``side`` "left", the default: the start is
    cut) or the first ones ("right"). None keeps the prompt as it is.

    Raises SamplingParamsError (param ``truncate_prompt_tokens``) for 0, a value below
    -1, or one above max_model_len (vLLM's rule)."""
    n = truncate_prompt_tokens
    if n is None:
        return ids
    if n == -1:
        n = max_model_len
    if n < 1:
        raise SamplingParamsError(
            f"truncate_prompt_tokens must be at least 1, or -1 for the model's context length, got {n}.",
            "truncate_prompt_tokens")
    if n > max_model_len:
        raise SamplingParamsError(
            f"truncate_prompt_tokens value ({n}) is greater than max_model_len ({max_model_len}). "
            "Please select a smaller truncation size.", "truncate_prompt_tokens")
    if len(ids) <= n:
        return ids
    return list(ids[:n]) if side == "right" else list(ids[-n:])


# A prompt: text, or {"prompt_token_ids": [...], optional "prompt": text}, or {"prompt": text}.
PromptType = Union[str, dict[str, Any], list[int]]


def check_prompt_fits(n_prompt: int, requested: Optional[int], max_model_len: int) -> None:
    """The server's context rules for a generation (vLLM's words): a prompt of
    ``n_prompt`` tokens must leave room for output (ContextLengthExceededError naming
    ``prompt``), and ``requested`` output tokens (None: as many as fit) must fit beside
    it (naming ``max_tokens``). The HTTP layer applies them too, to a request admission
    control would refuse (a 400 comes before a 429)."""
    if n_prompt >= max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{n_prompt} input tokens, which leaves no room for output. Please reduce the length of "
            f"the input.", "prompt")
    if requested is not None and requested > max_model_len - n_prompt:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} in the completion). "
            f"Please reduce the length of the prompt or of max_tokens.", "max_tokens")


class InputProcessor:
    """The one owner of request validation and derived fields (vLLM's ``InputProcessor``).

    Args:
      model_config: max_model_len, vocab_size, max_logprobs and the generation-config
        defaults (``get_diff_sampling_param()``: the default output budget) and EOS ids
        (``extra_eos_token_ids``), computed once by ``create_engine_config()``.
      tokenizer: the HF tokenizer (its ``eos_token_id`` is the request's EOS).
      strict_max_tokens: raise when prompt + max_tokens exceeds max_model_len (the
        server's behaviour) instead of letting the request stop at the limit with
        finish_reason "length" (the offline behaviour).
      cache_config: its ``kv_sharing_fast_prefill`` forbids prompt_logprobs (vLLM).
      scheduler_config: its ``policy``; a request priority other than 0 needs "priority"
        (vLLM: "Priority scheduling is not enabled" otherwise).
    """

    def __init__(self, model_config: ModelConfig, tokenizer, strict_max_tokens: bool = False, *,
                 cache_config: Optional[CacheConfig] = None, scheduler_config: Any = None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.strict_max_tokens = strict_max_tokens
        self.eos_token_id: Optional[int] = tokenizer.eos_token_id
        # The tokenizer's EOS ends generation on its own (unless ignore_eos); the others
        # the generation config lists become stop ids.
        self.extra_eos_ids: frozenset[int] = frozenset(
            model_config.extra_eos_token_ids) - {self.eos_token_id}
        self.default_max_tokens: Optional[int] = model_config.get_diff_sampling_param().get("max_tokens")
        self.kv_sharing_fast_prefill = bool(cache_config and cache_config.kv_sharing_fast_prefill)
        self.vocab_size = model_config.vocab_size
        self.priority_enabled = scheduler_config is None or getattr(scheduler_config, "policy", None) == "priority"
        self.max_num_seqs: Optional[int] = getattr(scheduler_config, "max_num_seqs", None)
        # Whisper's decoder prompt is its special tokens, written out: no BOS/EOS added.
        self.encoder_decoder = model_config.is_encoder_decoder

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """Returns (prompt text or None, prompt token ids). Raises ValueError."""
        if isinstance(prompt, dict) and "decoder_prompt" in prompt:  # vLLM's explicit enc-dec form
            return self.tokenize_prompt(prompt["decoder_prompt"])
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
        return self.tokenizer.encode(text, add_special_tokens=not self.encoder_decoder)

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: Optional[float] = None, priority: int = 0,
                       beam_search_params: Optional[BeamSearchParams] = None,
                       ) -> tuple[EngineCoreRequest, Optional[str]]:
        """Validate and build the EngineCoreRequest, with a copy of ``params`` whose
        derived fields are filled: max_tokens (never None), all_stop_token_ids,
        bad_words_token_ids. ``params`` itself is not changed.

        Raises SamplingParamsError (a ValueError) naming the field: ``prompt`` when the
        prompt is empty, holds token ids outside [0, vocab_size) or leaves no room for
        output; ``max_tokens`` (strict mode) when prompt + max_tokens exceeds
        max_model_len; ``logprobs``/``prompt_logprobs`` above max_logprobs (or
        prompt_logprobs with kv_sharing_fast_prefill); ``allowed_token_ids``,
        ``logit_bias``, ``bad_words`` for ids outside the vocabulary or bad text;
        ``structured_outputs`` for a schema, regex, choice or grammar that cannot compile.
        ``beam_search_params``: a beam search in the engine (``check_beam_search`` says
        what it refuses).
        """
        if "generate" not in self.model_config.supported_tasks:
            advice = ("It is a sequence-classification model (no LM head): use classify, score or reward."
                      if "classify" in self.model_config.supported_tasks else
                      "Try passing `--runner generate` to use the model as a generative model.")
            raise SamplingParamsError(
                f"This model does not support text generation: it is served as a pooling model. {advice}", "model")
        if priority != 0 and not self.priority_enabled:
            raise SamplingParamsError(
                f"Got priority {priority} but priority scheduling is not enabled "
                "(start the engine with --scheduling-policy priority).", "priority")
        encoder_inputs = self._encoder_inputs(prompt)
        text, ids = self.tokenize_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            kept = truncate_prompt(ids, params.truncate_prompt_tokens, self.model_config.max_model_len)
            if len(kept) != len(ids):  # the text no longer matches the ids
                text, ids = None, kept
        self._check_prompt(ids)
        params = params.clone()
        params._verify_types()  # a field set after construction (e.g. sp.logprobs = 1.5) fails here, not in a step
        requested = params.max_tokens
        params.max_tokens = self._max_tokens(len(ids), requested)
        if requested is None and params.min_tokens > params.max_tokens:
            # vLLM: a min_tokens beyond the room the context leaves is clamped when the
            # caller did not set max_tokens (it asked for "as much as fits").
            params.min_tokens = params.max_tokens
        self._check_logprobs(params)
        self._check_vocab(params)
        if not params.ignore_eos:
            params.all_stop_token_ids |= self.extra_eos_ids
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_ids(params.bad_words)
        if params.structured_outputs is not None:
            # A constraint that cannot compile is a 400 now, not a failure in the engine.
            validate_structured_outputs(params.structured_outputs)
        if beam_search_params is not None:
            check_beam_search(params, beam_search_params, self.max_num_seqs)
        req = EngineCoreRequest(request_id=request_id, prompt_token_ids=ids, sampling_params=params,
                                eos_token_id=self.eos_token_id,
                                arrival_time=arrival_time if arrival_time is not None else time.time(),
                                priority=priority, encoder_inputs=encoder_inputs,
                                beam_search_params=beam_search_params)
        return req, text

    def _encoder_inputs(self, prompt: PromptType) -> Optional[EncoderInputs]:
        """An encoder-decoder prompt's audio (``multi_modal_data={"audio": (samples,
        sample_rate)}``, at the top level or in ``encoder_prompt``, as vLLM) -> its Whisper
        log-mel features. Raises SamplingParamsError (``multi_modal_data``) for audio a
        text model cannot take, a Whisper prompt without audio, or bad audio."""
        mm = None
        if isinstance(prompt, dict):
            enc = prompt.get("encoder_prompt")
            mm = (enc.get("multi_modal_data") if isinstance(enc, dict) else None) or prompt.get("multi_modal_data")
        if not self.encoder_decoder:
            if mm:
                raise SamplingParamsError("This model takes no multi_modal_data (it is a text model)",
                                          "multi_modal_data")
            return None
        audio = mm.get("audio") if isinstance(mm, dict) else None
        if isinstance(audio, list) and len(audio) == 1:
            audio = audio[0]
        if not isinstance(audio, tuple) or len(audio) != 2:
            raise SamplingParamsError("This model needs one audio input: multi_modal_data="
                                      "{'audio': (samples, sample_rate)}", "multi_modal_data")
        from llmserve.multimodal.audio import to_mono_16k, whisper_features
        try:
            x = to_mono_16k(*audio)
            feats = whisper_features(x, int(getattr(self.model_config.hf_config, "num_mel_bins", 80)))
        except ValueError as e:
            raise SamplingParamsError(f"multi_modal_data.audio: {e}", "multi_modal_data") from None
        return EncoderInputs(feats.tobytes(), tuple(feats.shape), str(feats.dtype),
                             num_encoder_tokens=feats.shape[-1] // 2)

    def process_pooling_inputs(self, request_id: str, prompt: PromptType, params: PoolingParams,
                               arrival_time: Optional[float] = None, priority: int = 0,
                               ) -> tuple[EngineCoreRequest, Optional[str]]:
        """The EngineCoreRequest of a pooling request (``pooling_params`` set, no
        sampling params), with a copy of ``params`` whose task is set ("embed" when None).

        ``truncate_prompt_tokens`` (-1: max_model_len) keeps the last k of given token ids;
        a text prompt is cut as the tokenizer cuts, its first tokens and its special tokens
        kept (vLLM's right truncation for pooling, ``pooling_inputs.truncate_text_ids``).
        A text pair's ``token_type_ids`` (prompt dict) travel compressed in the params
        (``compressed_token_type_ids``). A decoder's classification (``classify``/``score``)
        runs the prompt up to its last non-pad token (``pooling_inputs.classified_prefix``).
        Raises SamplingParamsError naming the field: ``model`` when the model is not a
        pooling model (suggesting ``--runner pooling``) or lacks the task; ``prompt`` when
        empty, out of vocabulary or longer than max_model_len; ``dimensions`` when the
        model does not allow it; ``truncate_prompt_tokens`` above max_model_len;
        ``token_type_ids`` when they do not fit the prompt."""
        mc = self.model_config
        task = params.task or "embed"
        hidden = self._hidden_state_embed(params, task)
        if task not in mc.supported_tasks and not hidden:
            raise SamplingParamsError(
                f"This model does not support the {task!r} pooling task (it supports "
                f"{list(mc.supported_tasks)}). {task_hint(task)}", "model")
        pc = HIDDEN_STATE_POOLER if hidden else mc.pooler_config
        params = params.verify(task, int(mc.hf_config.hidden_size), list(pc.matryoshka_dimensions or ()),
                               pc.is_matryoshka)
        text, ids = self.tokenize_prompt(prompt)
        types = compress_token_type_ids(prompt, len(ids))
        k = params.truncate_prompt_tokens
        if k is not None:
            if k > mc.max_model_len:
                raise SamplingParamsError(
                    f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({mc.max_model_len}). "
                    f"Please select a smaller truncation size.", "truncate_prompt_tokens")
            k = mc.max_model_len if k == -1 else k
            if k > 0 and len(ids) > k and text is not None and not _has_token_ids(prompt):
                ids = truncate_text_ids(self.tokenizer, text, k, not self.encoder_decoder)  # [CLS] .. [SEP]
            types = truncate_start(types, len(ids), min(k, len(ids)))
            ids = ids[-k:] if len(ids) > k else ids
        self._check_prompt(ids, pooling=True)
        if task in ("classify", "score") and not mc.is_encoder_only:
            kept = classified_prefix(ids, getattr(mc.hf_config, "pad_token_id", None))
            text, ids = (text, ids) if len(kept) == len(ids) else (None, kept)
        params.compressed_token_type_ids = types
        req = EngineCoreRequest(request_id=request_id, prompt_token_ids=ids, sampling_params=None,
                                eos_token_id=None,
                                arrival_time=arrival_time if arrival_time is not None else time.time(),
                                priority=priority, pooling_params=params)
        return req, text

    def _hidden_state_embed(self, params: PoolingParams, task: str) -> bool:
        """True for an embedding a generating decoder serves from its hidden states
        (``params.hidden_state_embed``, task "embed"; not an encoder-decoder)."""
        mc = self.model_config
        return (params.hidden_state_embed and task == "embed" and mc.runner == "generate"
                and not mc.is_encoder_decoder)

    def _check_prompt(self, ids: list[int], pooling: bool = False) -> None:
        max_len = self.model_config.max_model_len
        if not ids:
            raise SamplingParamsError("The prompt cannot be empty.", "prompt")
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise SamplingParamsError(  # its position, not the value (which may be thousands of digits)
                    f"The token id at position {i} of the prompt is out of vocabulary (valid ids are "
                    f"0..{self.vocab_size - 1}).", "prompt")
        if pooling and len(ids) > max_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{len(ids)} tokens in the input for embedding generation. Please reduce the length of the "
                f"input (or set truncate_prompt_tokens).", "input")
        if not pooling:
            check_prompt_fits(len(ids), None, max_len)

    def _max_tokens(self, n: int, requested: Optional[int]) -> int:
        """The output budget: ``requested``, or when None the smaller of the room left and
        the generation config's default budget. Strict mode refuses a budget that does not
        fit; offline it stops at the limit with "length"."""
        max_len = self.model_config.max_model_len
        room = max_len - n
        if requested is None:
            return min(room, self.default_max_tokens) if self.default_max_tokens is not None else room
        if self.strict_max_tokens:
            check_prompt_fits(n, requested, max_len)
        return requested

    def _check_logprobs(self, params: SamplingParams) -> None:
        """vLLM's limits: at most max_logprobs per position (-1 asks for the whole
        vocabulary); no prompt_logprobs with kv_sharing_fast_prefill."""
        limit = self.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is None or limit == -1:
                continue
            n = self.vocab_size if asked == -1 else asked
            if n > limit:
                raise SamplingParamsError(
                    f"Requested {name} of {n}, which is greater than max allowed: {limit}", name)
        if params.prompt_logprobs is not None and self.kv_sharing_fast_prefill:
            raise SamplingParamsError(
                "prompt_logprobs is not supported with kv_sharing_fast_prefill: prompt logprobs need "
                "the hidden states of every prompt token.", "prompt_logprobs")

    def _check_vocab(self, params: SamplingParams) -> None:
        """Every token-id field must hold ids in [0, vocab_size); the error names the
        field, every bad id (up to MAX_LISTED_IDS) and the vocabulary size."""
        for name, ids in (("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", list(params.logit_bias or ())),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids or () if not _is_token_id(t, self.vocab_size)]
            if bad:
                if name == "logit_bias":  # keys may be any text: name each as sent
                    bad = [t if isinstance(t, int) else repr(t) for t in bad]
                raise SamplingParamsError(
                    f"{name}: token ids out of vocabulary: {list_ids(bad)} (the vocabulary has "
                    f"{self.vocab_size} tokens, valid ids are 0..{self.vocab_size - 1}).", name)

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
