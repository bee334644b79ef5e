"""``LoRAConfig`` (vLLM's): how many adapters, how large, in what dtype."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# vLLM's allowed ranks (LoRAConfig.max_lora_rank).
POSSIBLE_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoRAConfig:
    """max_lora_rank: the largest rank an adapter may have (each adapter's weights are
    padded to it in the batched kernels); max_loras: distinct adapters in one step (the
    slots of the stacked weights); max_cpu_loras: adapters kept loaded (None: max_loras);
    lora_dtype: the adapters' dtype ("auto": the model's). Raises ValueError naming the
    field, as vLLM."""

    max_lora_rank: int = 16
    max_loras: int = 1
    max_cpu_loras: Optional[int] = None
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False

    def __post_init__(self) -> None:
        if self.max_lora_rank not in POSSIBLE_MAX_RANKS:
            raise ValueError(f"max_lora_rank ({self.max_lora_rank}) must be one of {POSSIBLE_MAX_RANKS}.")
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras ({self.max_loras}) must be >= 1.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")
        if self.lora_dtype not in _DTYPES:
            raise ValueError(f"lora_dtype must be one of {_DTYPES}, got {self.lora_dtype!r}")

    @property
    def cpu_capacity(self) -> int:
        """Adapters kept loaded: max_cpu_loras, or max_loras when unset."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
