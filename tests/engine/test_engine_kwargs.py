"""The engine-client entry points take exactly vLLM's keyword arguments (issue 28, item 5):
a name vLLM does not have is a TypeError, a vLLM argument this engine cannot honour is
an error when given, and an adapter that cannot run is an error, never the base model."""
from __future__ import annotations

import asyncio
import inspect

import pytest

from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.llm_engine import LLMEngine
from llmserve.entrypoints.llm import LLM
from llmserve.sampling_params import SamplingParams

# vLLM's keyword arguments of each entry point (v0.11+), plus llmserve's own extensions.
VLLM_KWARGS = {
    AsyncLLM.generate: {"lora_request", "trace_headers", "priority", "data_parallel_rank", "prompt_text",
                        "tokenization_kwargs", "session_id", "reasoning_ended", "reasoning_parser_kwargs"},
    AsyncLLM.add_request: {"arrival_time", "lora_request", "tokenization_kwargs", "trace_headers", "priority",
                           "data_parallel_rank", "prompt_text", "reasoning_ended"},
    AsyncLLM.encode: {"lora_request", "trace_headers", "priority", "truncate_prompt_tokens", "tokenization_kwargs"},
    LLMEngine.add_request: {"arrival_time", "lora_request", "tokenization_kwargs", "trace_headers", "priority",
                            "prompt_text"},
    LLM.generate: {"use_tqdm", "lora_request", "priority", "tokenization_kwargs"},
    LLM.chat: {"use_tqdm", "lora_request", "chat_template", "chat_template_content_format", "add_generation_prompt",
               "continue_final_message", "tools", "chat_template_kwargs", "mm_processor_kwargs"},
    LLM.embed: {"truncate_prompt_tokens", "use_tqdm", "pooling_params", "lora_request", "tokenization_kwargs"},
    LLM.encode: {"truncate_prompt_tokens", "use_tqdm", "lora_request", "pooling_task", "tokenization_kwargs"},
}
OURS = {"tenant", "resumable", "beam_search_params"}  # llmserve's extensions (issues 34, 29, streaming input)


@pytest.mark.parametrize("fn", list(VLLM_KWARGS), ids=lambda f: f.__qualname__)
def test_each_entry_point_takes_vllms_keywords_and_no_catch_all(fn):
    params = inspect.signature(fn).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), fn
    assert VLLM_KWARGS[fn] <= set(params), VLLM_KWARGS[fn] - set(params)
    assert set(params) - VLLM_KWARGS[fn] - OURS - {"self"} <= set(list(params)[:4]), set(params)


def test_a_stray_keyword_is_a_type_error_not_a_silent_drop():
    sp = SamplingParams(max_tokens=1)
    with pytest.raises(TypeError, match="lora_requests"):
        AsyncLLM.generate(None, "Hi", sp, "r", lora_requests=object())  # a typo of lora_request
    with pytest.raises(TypeError):
        asyncio.run(AsyncLLM.add_request(None, "r", "Hi", sp, adapter="x"))
    with pytest.raises(TypeError):
        LLMEngine.add_request(None, "r", "Hi", sp, lora="x")
    with pytest.raises(TypeError):
        LLM.generate(None, "Hi", sp, adapter="x")


def test_vllm_keywords_without_behaviour_here_are_refused_when_given():
    async def first(gen):
        return await gen.__anext__()
    sp = SamplingParams(max_tokens=1)
    with pytest.raises(NotImplementedError, match="tokenization_kwargs"):
        asyncio.run(first(AsyncLLM.generate(None, "Hi", sp, "r", tokenization_kwargs={"truncation": True})))
    with pytest.raises(NotImplementedError, match="lora_request"):  # streaming input cannot carry an adapter yet
        async def chunks():
            yield "Hi"
        asyncio.run(first(AsyncLLM.generate(None, chunks(), sp, "r", lora_request=object())))
    with pytest.raises(NotImplementedError, match="prompt_text"):
        LLMEngine.add_request(None, "r", "Hi", sp, prompt_text="Hi")
    with pytest.raises(NotImplementedError, match="mm_processor_kwargs"):
        LLM.chat(None, [{"role": "user", "content": "Hi"}], mm_processor_kwargs={"x": 1})


def test_an_adapter_on_an_engine_without_lora_is_an_error(llm_fp32):
    from llmserve.lora.request import LoRARequest

    with pytest.raises(ValueError, match="enable_lora|enable-lora|LoRA"):
        llm_fp32.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False,
                          lora_request=LoRARequest("x", 1, "/nonexistent"))
