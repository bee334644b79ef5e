"""The Hugging Face transformers baseline of ``llmserve bench throughput --backend hf``.

What it measures is transformers' own ``generate`` with static batching, as vLLM's
``benchmarks/benchmark_throughput.py::run_hf`` does: the requests are cut, in input order,
into batches of ``batch_size``; each batch is left-padded to its longest prompt and runs
until its longest requested output (``min_new_tokens = max_new_tokens``, so EOS never ends
it early). Only the tokens each request asked for count as output tokens; the padding and
the extra tokens generated for shorter requests are the cost of static batching.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import torch

from llmserve.benchmarks.results import TokenRates
# The reference model's loading is runtime code (the compressed-tensors writer uses it):
# it lives in the model loader and is re-exported here under its old names.
from llmserve.model_loader.hf_reference import load_hf_config, load_hf_model, resolve_model_files

__all__ = ["HFResult", "resolve_model_files", "load_hf_config", "load_hf_model", "run_hf"]


@dataclass
class HFResult(TokenRates):
    """Result of one ``run_hf``.

    elapsed_s: wall time (s) of all ``generate`` calls (model loading excluded).
    num_requests; prompt_tokens: sum of prompt lengths (no padding);
    output_tokens: sum of each request's own requested output length;
    generated_tokens: tokens transformers actually generated (batch size x longest output,
    per batch), >= output_tokens. outputs: per request, its first ``output_len`` generated
    token ids (kept only when ``keep_outputs``).
    """

    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    generated_tokens: int
    outputs: list[list[int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("outputs")
        d.update(self.rates())
        return d


@torch.inference_mode()
def run_hf(
    model: Any,
    requests: Sequence[tuple[Sequence[int], int]],
    batch_size: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    pad_token_id: Optional[int] = None,
    keep_outputs: bool = False,
) -> HFResult:
    """Run ``requests`` (prompt token ids, requested output length) through
    ``model.generate`` in static batches of ``batch_size``, in input order.

    Each batch is left-padded to its longest prompt and generates exactly its longest
    requested output (``min_new_tokens = max_new_tokens``: EOS is ignored, as with
    ``ignore_eos`` in llmserve). ``temperature`` 0 is greedy; otherwise plain sampling at
    that temperature (top_p 1, no top_k), seeded with ``seed``. Only each request's own
    output length counts in ``output_tokens``.

    Raises ValueError for an empty request list, batch_size < 1, an empty prompt or an
    output length < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size: must be at least 1, got {batch_size}")
    if not requests:
        raise ValueError("requests: empty")
    for i, (ids, out_len) in enumerate(requests):
        if len(ids) == 0:
            raise ValueError(f"requests[{i}]: empty prompt")
        if out_len < 1:
            raise ValueError(f"requests[{i}]: output length must be at least 1, got {out_len}")
    if pad_token_id is None:
        cfg = model.generation_config
        pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
        if isinstance(pad_token_id, (list, tuple)):
            pad_token_id = pad_token_id[0]
        if pad_token_id is None:
            pad_token_id = 0
    sample_kwargs: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sample_kwargs = {"do_sample": True, "temperature": float(temperature), "top_p": 1.0, "top_k": 0}
    torch.manual_seed(seed)
    prompt_tokens = sum(len(ids) for ids, _ in requests)
    output_tokens = sum(n for _, n in requests)
    generated = 0
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b:b + batch_size]
        max_prompt = max(len(ids) for ids, _ in batch)
        max_new = max(n for _, n in batch)
        input_ids = torch.full((len(batch), max_prompt), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), max_prompt), dtype=torch.long)
        for row, (ids, _) in enumerate(batch):
            input_ids[row, max_prompt - len(ids):] = torch.as_tensor(list(ids), dtype=torch.long)
            attention_mask[row, max_prompt - len(ids):] = 1
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                             max_new_tokens=max_new, min_new_tokens=max_new,
                             pad_token_id=pad_token_id, use_cache=True, **sample_kwargs)
        new = out[:, max_prompt:]
        generated += new.numel()
        if keep_outputs:
            outputs.extend(new[row, :n].tolist() for row, (_, n) in enumerate(batch))
    elapsed = time.perf_counter() - start
    return HFResult(elapsed_s=elapsed, num_requests=len(requests), prompt_tokens=prompt_tokens,
                    output_tokens=output_tokens, generated_tokens=generated, outputs=outputs)
