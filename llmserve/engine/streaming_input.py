"""Streaming input for ``AsyncLLM.generate`` (vLLM's ``StreamingInput``, PR #28973).

The prompt is an async generator of chunks: each a ``StreamingInput``, text, or a list of
token ids. The first chunk starts a resumable request; every later chunk is sent to the
engine as a ``StreamingInputChunk``: once the request has answered the previous chunk,
the engine appends the new tokens to its context (its KV cache is reused) and generates
again. When the generator ends, a final chunk closes the input and the request finishes
after answering the last one. The output stream carries every generated token.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

from llmserve.engine.messages import StreamingInputChunk
from llmserve.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)


@dataclass
class StreamingInput:
    """One input chunk: ``prompt`` (text, token ids, or a prompt dict) and, optionally,
    the sampling parameters for the answer to this chunk (default: the request's)."""

    prompt: Any
    sampling_params: Optional[SamplingParams] = None


ChunkType = Union[StreamingInput, str, list, dict]


def is_streaming_prompt(prompt: Any) -> bool:
    """True for an async generator / iterator of chunks (not a text, ids or dict prompt)."""
    return hasattr(prompt, "__aiter__")


def split_chunk(chunk: ChunkType) -> tuple[Any, Optional[SamplingParams]]:
    """(prompt, sampling params or None) of one chunk."""
    if isinstance(chunk, StreamingInput):
        return chunk.prompt, chunk.sampling_params
    return chunk, None


def chunk_token_ids(prompt: Any, tokenizer) -> list[int]:
    """Token ids of a later chunk: text is encoded without special tokens (it continues
    the context). Raises SamplingParamsError for a chunk of another type."""
    if isinstance(prompt, dict):
        prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt.get("prompt", "")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    if isinstance(prompt, list):
        return list(prompt)
    raise SamplingParamsError("a streaming-input chunk must be text, token ids, a prompt dict "
                              "or a StreamingInput", "prompt")


async def feed_later_chunks(chunks: AsyncIterator[ChunkType], request_id: str, params: SamplingParams,
                            engine_core, input_processor, on_error) -> None:
    """Send every later chunk of ``chunks`` to the engine, then the end of input. Each
    chunk goes through ``input_processor.process_inputs`` (the one place that validates
    and derives: vocabulary, length, stop ids); its own sampling params, if any, replace
    the request's for its answer. A bad chunk or a failing generator is handed to
    ``on_error`` (which fails the request)."""
    try:
        async for chunk in chunks:
            prompt, chunk_params = split_chunk(chunk)
            ids = chunk_token_ids(prompt, input_processor.tokenizer)
            req, _ = input_processor.process_inputs(request_id, ids, chunk_params or params)
            await engine_core.add_streaming_input_async(StreamingInputChunk(
                request_id, req.prompt_token_ids, req.sampling_params if chunk_params is not None else None))
        await engine_core.add_streaming_input_async(StreamingInputChunk(request_id, final=True))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the caller of generate() gets it
        on_error(e)
