"""llmserve: an LLM inference and serving engine (continuous batching on a paged KV
cache; offline ``LLM`` API and an OpenAI-compatible server)."""
from llmserve.engine_args import AsyncEngineArgs, EngineArgs
from llmserve.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "PoolingRequestOutput", "EngineArgs", "AsyncEngineArgs", "__version__"]


def __getattr__(name):  # lazy: importing llmserve must not import torch
    if name == "LLM":
        from llmserve.entrypoints.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from llmserve.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
