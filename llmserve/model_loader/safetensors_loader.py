"""Weights from a Hugging Face directory of ``*.safetensors`` files (one or sharded)."""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors import safe_open


def safetensors_files(path: str) -> list[str]:
    """The checkpoint files of an HF directory: those named in
    ``model.safetensors.index.json`` when present, else ``model*.safetensors``, else every
    ``*.safetensors``. Raises ValueError when there is none."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    preferred = [f for f in files if f.startswith("model")]
    files = preferred or files
    if not files:
        raise ValueError(f"no .safetensors weights in model directory {path!r}")
    return [os.path.join(path, f) for f in files]


def iterate_safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of the directory's checkpoint, in the
    stored dtype (memory-mapped, one tensor at a time)."""
    for fname in safetensors_files(path):
        with safe_open(fname, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
