"""llmserve: an LLM inference and serving engine (continuous batching on a paged KV
cache; offline ``LLM`` API and an OpenAI-compatible server)."""
import importlib

__version__ = "0.1.0"

# Public name -> module. Imported lazily: importing any llmserve module (e.g. the
# ground-floor ``llmserve.core.outputs``) must not pull in the rest, nor torch.
_LAZY = {
    "LLM": "llmserve.entrypoints.llm",
    "AsyncLLM": "llmserve.engine.async_llm",
    "SamplingParams": "llmserve.sampling_params",
    "RequestOutputKind": "llmserve.sampling_params",
    "StructuredOutputsParams": "llmserve.sampling_params",
    "RequestOutput": "llmserve.outputs",
    "CompletionOutput": "llmserve.outputs",
    "PoolingRequestOutput": "llmserve.outputs",
    "EmbeddingRequestOutput": "llmserve.outputs",
    "ScoringRequestOutput": "llmserve.outputs",
    "ClassificationOutput": "llmserve.outputs",
    "ClassificationRequestOutput": "llmserve.outputs",
    "PoolingParams": "llmserve.pooling_params",
    "EngineArgs": "llmserve.engine_args",
    "AsyncEngineArgs": "llmserve.engine_args",
    "StreamingInput": "llmserve.engine.streaming_input",
    "TextPrompt": "llmserve.inputs",
    "TokensPrompt": "llmserve.inputs",
    "BeamSearchParams": "llmserve.beam_search",
}

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutputKind", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "PoolingRequestOutput", "EmbeddingRequestOutput", "ScoringRequestOutput", "ClassificationOutput",
           "ClassificationRequestOutput", "PoolingParams",
           "EngineArgs", "AsyncEngineArgs", "StreamingInput", "TextPrompt", "TokensPrompt", "BeamSearchParams", "__version__"]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
