"""``use_beam_search`` on /v1/completions and /v1/chat/completions (vLLM's fields):
``n`` is the beam width and the number of choices returned, ``length_penalty`` and
``early_stopping`` (true, false or "never") as transformers define them. The search runs in
the engine (core/beam_search.py); the choices arrive together when it ends, so a stream
sends them at the end (vLLM does the same).

``temperature`` scales the logits the beams are scored on (the engine's beam rows are
``log_softmax(logits / temperature)``, as vLLM's; 0 and 1 score raw logprobs).
Refused with a 400 naming the field, since the beams are ranked by those logprobs and
arrive at the end: ``stop`` strings, ``logit_bias``, ``allowed_token_ids``, ``bad_words``,
structured outputs (``response_format``, ``structured_outputs``), ``min_tokens``, the
penalties, top alternatives (``logprobs`` > 0 on completions, ``top_logprobs`` > 0 on
chat), ``stream_options.continuous_usage_stats`` (no running usage before the beams
exist); ``n`` above ``max_num_seqs`` is refused by the engine's InputProcessor.
"""
from __future__ import annotations

from typing import Any, Optional

from llmserve.beam_search import BeamSearchParams
from llmserve.sampling_params import SamplingParams, SamplingParamsError

__all__ = ["beam_search_request", "beam_sampling_params"]

# Request fields refused with use_beam_search, and the value that means "not given".
_REFUSED = (("stop", (None, [], "")), ("logit_bias", (None, {})), ("allowed_token_ids", (None,)),
            ("bad_words", (None, [])), ("structured_outputs", (None,)), ("min_tokens", (0,)),
            ("repetition_penalty", (None, 1.0)), ("frequency_penalty", (None, 0.0)),
            ("presence_penalty", (None, 0.0)), ("top_logprobs", (None, 0)), ("prompt_logprobs", (None,)))


def _check(request: Any) -> None:
    for name, unset in _REFUSED:
        if getattr(request, name, None) not in unset:
            raise SamplingParamsError(f"{name} is not supported with use_beam_search.", name)
    logprobs = getattr(request, "logprobs", None)
    if not isinstance(logprobs, bool) and logprobs not in (None, 0):  # completions: top alternatives
        raise SamplingParamsError("logprobs > 0 is not supported with use_beam_search (each token's own "
                                  "logprob is: logprobs=0).", "logprobs")
    fmt = getattr(request, "response_format", None)
    if fmt is not None and getattr(fmt, "type", "text") != "text":
        raise SamplingParamsError("response_format is not supported with use_beam_search.", "response_format")
    opts = request.stream_options
    if opts is not None and opts.continuous_usage_stats:
        raise SamplingParamsError("stream_options.continuous_usage_stats cannot be honoured with use_beam_search: "
                                  "the beams arrive together when the search ends.", "stream_options")


def beam_search_request(request: Any, params: SamplingParams, max_model_len: int) -> Optional[BeamSearchParams]:
    """The BeamSearchParams of a request with ``use_beam_search`` (None without it).
    Raises SamplingParamsError naming a field the search cannot honour."""
    if not getattr(request, "use_beam_search", False):
        return None
    _check(request)
    try:
        return BeamSearchParams(beam_width=request.n or 1, max_tokens=params.max_tokens or max_model_len,
                                ignore_eos=params.ignore_eos, temperature=params.temperature or 0.0,
                                length_penalty=request.length_penalty,
                                include_stop_str_in_output=params.include_stop_str_in_output,
                                early_stopping=request.early_stopping)
    except ValueError as e:
        raise SamplingParamsError(str(e), "n" if getattr(e, "param", None) == "beam_width" else
                                  getattr(e, "param", None)) from e


def beam_sampling_params(params: SamplingParams) -> SamplingParams:
    """The request's SamplingParams for its beam search: one sequence (the beams are the
    engine's), greedy rows, the model's default penalties and sampling knobs off (the
    beams are ranked by logprobs, at BeamSearchParams.temperature; what the user set was
    checked by ``_check``)."""
    sp = params.clone()
    sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed = 1, 0.0, 1.0, 0, 0.0, None
    sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty = 1.0, 0.0, 0.0
    return sp
