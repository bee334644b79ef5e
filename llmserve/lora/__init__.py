"""LoRA adapters (issue 28): requests name an adapter (``LoRARequest``); the engine loads
PEFT directories and GGUF LoRA files (``models.py``), keeps up to ``max_cpu_loras`` loaded
and runs up to ``max_loras`` of them in one step over one base model (``layers.py``,
``llmserve.ops.lora_ops``)."""
from llmserve.lora.config import LoRAConfig
from llmserve.lora.errors import LoRAAdapterError, LoRANotFoundError
from llmserve.lora.request import LoRARequest

__all__ = ["LoRAAdapterError", "LoRAConfig", "LoRANotFoundError", "LoRARequest"]
