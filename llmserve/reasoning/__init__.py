"""Reasoning parsers (vLLM's ``vllm.reasoning``):
``ReasoningParserManager.get_reasoning_parser(name)`` returns a :class:`ReasoningParser`
class, built with the tokenizer (and ``chat_template_kwargs=``). Registered:
``deepseek_r1``, ``qwen3``. Imports nothing of the server (the engine uses
``is_reasoning_end``)."""
from llmserve.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager
from llmserve.reasoning.basic_parsers import (BaseThinkingReasoningParser, DeepSeekR1ReasoningParser,
                                              Qwen3ReasoningParser)

__all__ = ["ReasoningParser", "ReasoningParserManager", "BaseThinkingReasoningParser",
           "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser"]
