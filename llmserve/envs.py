"""Environment variables (vLLM's ``vllm.envs``): each ``LLMSERVE_*`` variable, and the
``VLLM_*`` variable of the same meaning, read when the llmserve name is not set, so a
deployment written for vLLM keeps its settings. Listed in the README.
"""
from __future__ import annotations

import os
from typing import Optional

# llmserve name -> (vLLM name with the same meaning or None, what it does)
ENV_VARS: dict[str, tuple[Optional[str], str]] = {
    "LLMSERVE_API_KEY": ("VLLM_API_KEY", "default of --api-key"),
    "LLMSERVE_ENABLE_MULTIPROCESSING": ("VLLM_ENABLE_V1_MULTIPROCESSING",
                                        "0: the offline LLM runs the EngineCore in-process (default 1)"),
    "LLMSERVE_LOGGING_LEVEL": ("VLLM_LOGGING_LEVEL", "log level of the engine process (default INFO)"),
    "LLMSERVE_LOGGING_CONFIG_PATH": ("VLLM_LOGGING_CONFIG_PATH", "default of --log-config-file"),
    "LLMSERVE_ENGINE_STARTUP_TIMEOUT": ("VLLM_ENGINE_READY_TIMEOUT_S",
                                        "seconds the client waits for the engine process to be ready (600)"),
    "LLMSERVE_OUTPUT_PROC_CHUNK_SIZE": ("VLLM_V1_OUTPUT_PROC_CHUNK_SIZE",
                                        "outputs processed per chunk between event-loop yields (128)"),
    "LLMSERVE_CPU_KVCACHE_SPACE": ("VLLM_CPU_KVCACHE_SPACE",
                                   "KV cache size in GiB when --kv-cache-memory is not given (default 4)"),
    "LLMSERVE_HTTP_TIMEOUT_KEEP_ALIVE": ("VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
                                         "default of --timeout-keep-alive, in seconds (5)"),
    "LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING": ("VLLM_ALLOW_RUNTIME_LORA_UPDATING",
                                             "1/true: serve /v1/load_lora_adapter and /v1/unload_lora_adapter"),
    "LLMSERVE_SERVER_DEV_MODE": ("VLLM_SERVER_DEV_MODE",
                                 "1: serve the dev endpoints (POST /sleep, POST /wake_up, GET /is_sleeping "
                                 "with --enable-sleep-mode)"),
    "LLMSERVE_CPU_OPS": (None, "0: use the pure-torch paths instead of the C++ CPU kernels"),
    "LLMSERVE_ONEDNN_LINEAR": (None, "0: keep dense weights and F.linear instead of oneDNN-packed linears"),
    "LLMSERVE_PACKED_WEIGHTS": (None, "0: dequantize GGUF Q4_0/Q4_1/Q8_0 weights only (no packed small-step GEMMs)"),
    "LLMSERVE_TRANSFORMERS_IMPORT_CACHE": (None, "0: transformers builds its lazy-import tables at each start "
                                                 "(no ~/.cache/llmserve/transformers-imports)"),
}


def get(name: str, default: Optional[str] = None) -> Optional[str]:
    """``$name``, else its vLLM twin (see :data:`ENV_VARS`), else ``default``.
    Raises KeyError for a name not in :data:`ENV_VARS` (one list of what is read)."""
    vllm_name = ENV_VARS[name][0]
    value = os.environ.get(name)
    if value is None and vllm_name is not None:
        value = os.environ.get(vllm_name)
    return default if value is None else value
