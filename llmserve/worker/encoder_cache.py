"""Per-request encoder outputs of an encoder-decoder model (Whisper), vLLM's
``EncoderCacheManager`` on the runner side.

At a request's first scheduled step its encoder input (``Request.encoder_inputs``: log-mel
features) runs through the model's encoder, batched with the other new requests of the
step; the decoder's cross-attention K/V computed from it are kept here until the request
finishes (``free``), so later steps only run the decoder. Preempted requests keep theirs.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch


def encoder_input_tensor(enc: Any, device: torch.device) -> torch.Tensor:
    """An ``EncoderInputs`` (bytes + shape + dtype) -> a tensor of that shape."""
    arr = np.frombuffer(enc.data, dtype=np.dtype(enc.dtype)).reshape(tuple(enc.shape))
    return torch.from_numpy(arr.copy()).to(device)


class EncoderCache:
    """Cross-attention K/V per request id (the model's ``encode`` output)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cross: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self._cross)

    def cross_kv(self, reqs: Sequence[Any], model: Any) -> list[Any]:
        """The cross K/V of each of ``reqs`` (in order), running the encoder once for
        those without one (one batched call per feature shape). Raises ValueError for a
        request without encoder input."""
        # Beams of one request (core/beam_search.py) share its encoder output.
        keys = [getattr(r, "encoder_cache_key", None) or r.request_id for r in reqs]
        new = [r for r, k in zip(reqs, keys) if k not in self._cross]
        new = list({getattr(r, "encoder_cache_key", None) or r.request_id: r for r in new}.values())
        by_shape: dict[tuple, list[Any]] = {}
        for r in new:
            if r.encoder_inputs is None:
                raise ValueError(f"request {r.request_id}: an encoder-decoder model needs an encoder "
                                 "input (audio) with every request")
            by_shape.setdefault(tuple(r.encoder_inputs.shape), []).append(r)
        for group in by_shape.values():
            feats = torch.stack([encoder_input_tensor(r.encoder_inputs, self.device) for r in group])
            for r, kv in zip(group, model.encode(feats)):
                self._cross[getattr(r, "encoder_cache_key", None) or r.request_id] = kv
        return [self._cross[k] for k in keys]

    def free(self, req_ids) -> None:
        """Drop the outputs of finished requests."""
        for rid in req_ids:
            self._cross.pop(rid, None)
