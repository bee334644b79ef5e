"""A finished beam search (``EngineCoreOutput.beam_sequences``) -> a RequestOutput with
one CompletionOutput per beam, best first (what vLLM's ``EngineClient.beam_search``
yields), and RequestOutput -> vLLM's ``BeamSearchOutput`` for ``LLM.beam_search``."""
from __future__ import annotations

from typing import Optional

from llmserve.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from llmserve.core.outputs import BeamSequenceOutput, FinishReason
from llmserve.outputs import CompletionOutput, Logprob, RequestOutput
from llmserve.sampling_params import SamplingParams

__all__ = ["beam_completions", "to_beam_search_output"]


def _kept_tokens(seq: BeamSequenceOutput, include_stop: bool) -> list[int]:
    """The beam's tokens as returned: the EOS/stop token that ended it only with
    ``include_stop_str_in_output`` (vLLM drops it otherwise)."""
    if seq.finish_reason == FinishReason.STOP and not include_stop and seq.token_ids:  # FinishReason.STOP
        return seq.token_ids[:-1]
    return list(seq.token_ids)


def beam_completions(seqs: list[BeamSequenceOutput], params: SamplingParams, tokenizer,
                     beam_params: Optional[BeamSearchParams], aborted: bool = False) -> list[CompletionOutput]:
    """One CompletionOutput per beam: text decoded with the request's
    skip_special_tokens; logprobs (the chosen token's, one dict per token) when the
    request asked for logprobs; cumulative_logprob always (natural log). aborted: the
    search was ended early (a deadline): every beam's finish_reason is "abort" (a
    finished hypothesis among them still drops its EOS as it would have)."""
    include_stop = bool(beam_params and beam_params.include_stop_str_in_output)
    outs = []
    for i, seq in enumerate(seqs):
        ids = _kept_tokens(seq, include_stop)
        text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens) if params.detokenize else ""
        lps = None
        if params.logprobs is not None:
            lps = [{t: Logprob(lp, None, tokenizer.decode([t]))} for t, lp in zip(ids, seq.logprobs)]
        outs.append(CompletionOutput(index=i, text=text, token_ids=ids, cumulative_logprob=seq.cum_logprob,
                                     logprobs=lps, finish_reason=str(FinishReason.ABORT if aborted else FinishReason(seq.finish_reason)),
                                     stop_reason=None if aborted else seq.stop_reason))
    return outs


def to_beam_search_output(out: RequestOutput, tokenizer) -> BeamSearchOutput:
    """vLLM's ``LLM.beam_search`` layout: each sequence's tokens are the prompt's plus the
    generated ones and its text decodes them all."""
    prompt = list(out.prompt_token_ids or [])
    seqs = []
    for c in out.outputs:
        tokens = prompt + list(c.token_ids)
        lps = c.logprobs or []
        seqs.append(BeamSearchSequence(tokens=tokens, logprobs=lps, cum_logprob=c.cumulative_logprob or 0.0,
                                       text=tokenizer.decode(tokens, skip_special_tokens=True),
                                       finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return BeamSearchOutput(sequences=seqs)
