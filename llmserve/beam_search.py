"""Beam search parameters and results (vLLM's ``vllm/beam_search.py`` names and fields).

``BeamSearchParams`` crosses the process boundary inside ``EngineCoreRequest`` (a msgspec
Struct); the search itself runs in the engine (``core/beam_search.py``): every live beam
of a request is a row of the same forward step, and beams share KV blocks. Ground floor:
imports nothing of llmserve but ``outputs``' Logprob type.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import msgspec

from llmserve.outputs import Logprob

__all__ = ["BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput"]


def _field_error(message: str, param: str) -> ValueError:
    from llmserve.sampling_params import SamplingParamsError

    return SamplingParamsError(message, param)


class BeamSearchParams(msgspec.Struct, omit_defaults=True, array_like=True, gc=False):
    """Beam search settings (vLLM's ``BeamSearchParams``, plus transformers' early_stopping).

    beam_width: live beams per step and sequences returned (>= 1). max_tokens: new tokens
    per beam (>= 1). ignore_eos: EOS does not end a beam. temperature: >= 0; beams are
    scored with ``log_softmax(logits / temperature)`` (vLLM applies the temperature before
    the log-softmax its beams are ranked on); 0 (the default) and 1 score them on the raw
    log-probabilities (transformers' ``log_softmax`` of the logits). The returned
    ``logprobs`` and ``cum_logprob`` are those scores.
    length_penalty: a finished hypothesis scores ``cum_logprob / generated_len **
    length_penalty`` (generated_len counts the EOS token; transformers' BeamSearchScorer).
    include_stop_str_in_output: keep the EOS token in the returned tokens and text.
    early_stopping: True, False or "never", as transformers defines them (True: stop once
    beam_width hypotheses are finished; False: stop when the best running beam cannot beat
    the worst finished one at its current length; "never": at max_tokens length when
    length_penalty > 0). Raises ValueError (naming the field) for bad values.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: Union[bool, str] = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise _field_error(f"beam_width must be an integer >= 1, got {self.beam_width!r}.", "beam_width")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise _field_error(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.", "max_tokens")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise _field_error("temperature must be a finite number >= 0.", "temperature")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise _field_error("length_penalty must be a finite number.", "length_penalty")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _field_error(f"{name} must be true or false.", name)
        if self.early_stopping not in (True, False, "never"):
            raise _field_error(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}.",
                               "early_stopping")


@dataclass
class BeamSearchSequence:
    """One returned beam (vLLM's ``BeamSearchSequence``): ``tokens`` are the prompt's
    followed by the generated ones (vLLM's layout); ``logprobs`` one {token: Logprob}
    per generated token; ``cum_logprob`` the sum of the generated tokens' logprobs
    (natural log, float); ``text`` the decoded ``tokens``; ``finish_reason`` "stop"
    (EOS) or "length"."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    multi_modal_data: Optional[dict] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None


@dataclass
class BeamSearchOutput:
    """The result of one prompt's beam search (vLLM's ``BeamSearchOutput``): the best
    ``beam_width`` sequences, best first (by length-penalised score)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
