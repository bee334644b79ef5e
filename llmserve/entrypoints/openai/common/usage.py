"""Usage blocks of chat and completion responses, and the server flags that shape them
(vLLM's ``--enable-prompt-tokens-details`` and ``--enable-force-include-usage``).

The handlers call :meth:`UsageOptions.usage` for every usage they send and
:meth:`UsageOptions.stream_usage` to decide whether a stream carries usage, so both
flags act on every endpoint, streamed or not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from llmserve.entrypoints.openai.common.protocol import PromptTokenUsageInfo, UsageInfo


@dataclass(frozen=True)
class UsageOptions:
    """enable_prompt_tokens_details: add ``prompt_tokens_details.cached_tokens`` (the
    prompt tokens served from the prefix cache, ``RequestOutput.num_cached_tokens``);
    sent even when it is 0, as OpenAI does (vLLM leaves it out at 0).
    enable_force_include_usage: every stream ends with a usage chunk, whatever the
    request's ``stream_options`` (vLLM's ``should_include_usage``)."""

    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False

    def usage(self, prompt_tokens: int, completion_tokens: int, num_cached_tokens: Optional[int] = 0) -> UsageInfo:
        """The usage block: token counts (all choices) and, when enabled, the cache hit."""
        details = None
        if self.enable_prompt_tokens_details:
            details = PromptTokenUsageInfo(cached_tokens=int(num_cached_tokens or 0))
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)

    def stream_usage(self, stream_options: Any) -> tuple[bool, bool]:
        """``(include_usage, continuous_usage_stats)`` of a stream: the request's
        ``stream_options``, with usage forced on by ``--enable-force-include-usage``."""
        if stream_options is None:
            return self.enable_force_include_usage, False
        include = bool(stream_options.include_usage) or self.enable_force_include_usage
        return include, bool(include and stream_options.continuous_usage_stats)

    @classmethod
    def from_args(cls, args: Any) -> "UsageOptions":
        return cls(enable_prompt_tokens_details=bool(getattr(args, "enable_prompt_tokens_details", False)),
                   enable_force_include_usage=bool(getattr(args, "enable_force_include_usage", False)))


def sum_cached_tokens(outputs: Any) -> int:
    """Prefix-cache hits of several prompts' RequestOutputs (None entries skipped)."""
    return sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outputs if o is not None)
