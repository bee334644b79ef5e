"""Benchmark request samplers shared by ``llmserve bench serve|throughput|latency``.

``sample_random_requests`` follows vLLM's RandomDataset: prompt and output lengths are
drawn uniformly around the asked lengths and prompts are random token ids (sent to the
server as token-id prompts, so the input length is exact). The same seed gives the same
requests in every benchmark, so online and offline numbers are comparable.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special tokens (``all_special_ids`` plus added tokens
    marked special)."""
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}
    for tid, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(tid))
    return ids


def sample_random_requests(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                           range_ratio: float = 0.0, seed: int = 0) -> list[tuple[list[int], int]]:
    """``num_prompts`` random requests as ``(prompt_token_ids, output_len)`` pairs.

    Lengths are uniform integers in ``[int(L * (1 - range_ratio)), int(L * (1 + range_ratio))]``
    (at least 1) for L = input_len and output_len; token ids are uniform over the
    vocabulary (``len(tokenizer)``) minus the special tokens. Everything comes from
    ``numpy.random.default_rng(seed)``: the same arguments give the same requests.

    Raises ValueError for num_prompts < 1, lengths < 1 or range_ratio outside [0, 1).
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be at least 1, got {input_len}, {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    special = special_token_ids(tokenizer)
    vocab = np.arange(len(tokenizer), dtype=np.int64)
    allowed = vocab[~np.isin(vocab, np.fromiter(special, dtype=np.int64, count=len(special)))]

    def lengths(n: int) -> np.ndarray:
        low = max(1, int(n * (1 - range_ratio)))
        high = max(low, int(n * (1 + range_ratio)))
        return rng.integers(low, high + 1, size=num_prompts)

    in_lens, out_lens = lengths(input_len), lengths(output_len)
    return [(allowed[rng.integers(0, len(allowed), size=int(il))].tolist(), int(ol))
            for il, ol in zip(in_lens, out_lens)]
