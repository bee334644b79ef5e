"""The Messages API fields accepted with no effect (``anthropic/accepted_fields.py``):
``metadata``, ``service_tier``, ``speed``, ``inference_geo`` and ``cache_control`` (on the
request, system blocks, content blocks at any depth, tools) pass with every value
Anthropic takes and are refused with the values it refuses, naming the path, on
``/v1/messages`` and ``count_tokens`` alike (both go through ``to_chat_request``). The
fresh-user trial found wrong types and unknown values answered 200."""
import pytest

from llmserve.entrypoints.anthropic.accepted_fields import MAX_CACHE_BREAKPOINTS
from llmserve.entrypoints.anthropic.conversion import to_chat_request
from llmserve.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from llmserve.sampling_params import SamplingParamsError

ASK = {"role": "user", "content": "Hi"}
EPHEMERAL = {"type": "ephemeral"}
TOOL = {"name": "f", "input_schema": {"type": "object"}}


def _text(cache_control):
    return {"type": "text", "text": "Hi", "cache_control": cache_control}


def _both(fields):
    """The messages and count_tokens requests of the same fields."""
    return [AnthropicMessagesRequest(model="m", max_tokens=8, **fields),
            AnthropicCountTokensRequest(model="m", **fields)]


GOOD = [
    {"metadata": {"user_id": "u-1"}}, {"metadata": {"user_id": None}}, {"metadata": {}}, {"metadata": None},
    {"service_tier": "auto"}, {"service_tier": "standard_only"}, {"speed": "fast"}, {"speed": None},
    {"inference_geo": "us"}, {"cache_control": EPHEMERAL}, {"cache_control": None},
    {"system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
    {"messages": [{"role": "user", "content": [_text({"type": "ephemeral", "ttl": "5m"})]}]},
    {"messages": [{"role": "user", "content": [_text({"type": "ephemeral", "scope": "global"})]}]},  # a beta key
    {"tools": [{**TOOL, "cache_control": EPHEMERAL}]},
    {"messages": [{"role": "user", "content": [_text(EPHEMERAL)] * MAX_CACHE_BREAKPOINTS + [_text(None)]}]},
]


@pytest.mark.parametrize("fields", GOOD)
def test_every_value_anthropic_takes_passes(fields):
    for request in _both({"messages": [ASK], **fields}):
        to_chat_request(request, auto_tools=False)


USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}
BAD = [  # (fields, param)
    ({"metadata": ["u"]}, "metadata"),
    ({"metadata": {"user_id": 5}}, "metadata.user_id"),
    ({"metadata": {"user_id": "u" * 257}}, "metadata.user_id"),
    ({"metadata": {"session": "s"}}, "metadata.session"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"service_tier": 1}, "service_tier"),
    ({"speed": "slow"}, "speed"),
    ({"inference_geo": 5}, "inference_geo"),
    ({"cache_control": "ephemeral"}, "cache_control"),
    ({"cache_control": {}}, "cache_control.type"),
    ({"system": [{"type": "text", "text": "S", "cache_control": {"type": "persistent"}}]},
     "system.0.cache_control.type"),
    ({"messages": [{"role": "user", "content": [_text({"type": "ephemeral", "ttl": "2h"})]}]},
     "messages.0.content.0.cache_control.ttl"),
    ({"messages": [ASK, USE, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
        _text({"type": "ephemeral", "ttl": 300})]}]}]}, "messages.2.content.0.content.0.cache_control.ttl"),
    ({"tools": [{**TOOL, "cache_control": True}]}, "tools.0.cache_control"),
    ({"messages": [{"role": "user", "content": [_text(EPHEMERAL)] * (MAX_CACHE_BREAKPOINTS + 1)}]}, None),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[str(b[1]) + f"-{i}" for i, b in enumerate(BAD)])
def test_a_value_anthropic_refuses_is_a_400_naming_its_path(fields, param):
    for request in _both({"messages": [ASK], **fields}):
        with pytest.raises(SamplingParamsError) as e:
            to_chat_request(request, auto_tools=False)
        assert e.value.param == param
        if param is None:  # Anthropic's own words for too many breakpoints
            assert str(e.value).startswith("A maximum of 4 blocks with cache_control may be provided. Found 5.")
        else:
            assert str(e.value).startswith(param + ":"), str(e.value)
