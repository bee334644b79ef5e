"""Sampling: logits -> tokens and logprobs (vLLM v1 ``vllm/v1/sample``).

Public API::

    meta = SamplingMetadata.build(reqs, vocab_size, device)   # reqs: list[SamplingRequestState]
    out = Sampler()(logits, meta)          # SamplerOutput(sampled_token_ids, logprobs_tensors)
    compute_prompt_logprobs(logits, target_token_ids, num_logprobs) -> LogprobsTensors
"""
from llmserve.sample.logprobs import LogprobsTensors, compute_prompt_logprobs
from llmserve.sample.metadata import (SamplingMetadata, SamplingRequestState, SeededStream, make_generator,
                                      validate_token_ids)
from llmserve.sample.sampler import Sampler, SamplerOutput, greedy_argmax

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRequestState",
    "compute_prompt_logprobs",
    "greedy_argmax",
    "make_generator",
    "SeededStream",
    "validate_token_ids",
]
