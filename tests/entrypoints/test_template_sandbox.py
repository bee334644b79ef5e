"""Request chat templates (issue 26 item 3): refused unless --trust-request-chat-template
(vLLM's rule), and when trusted rendered in killable worker processes with a time and a
memory bound (llmserve/entrypoints/template_sandbox.py). The server-level cases are in
tests/e2e/test_request_chat_templates.py."""
from __future__ import annotations

import argparse
import asyncio
import time

import pytest

from llmserve.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from llmserve.entrypoints.openai.common.limits import PromptCharLimit
from llmserve.entrypoints.openai.deadline import Deadline, RequestDeadlineExceeded, reset_deadline, set_deadline
from llmserve.entrypoints.openai.vllm_compat_args import COMPAT_FLAGS
from llmserve.entrypoints.renderer import AsyncRenderer, Renderer
from llmserve.entrypoints.template_sandbox import RequestTemplateConfig
from llmserve.sampling_params import SamplingParamsError

MSGS = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Name a colour."}]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}{{ greeting | default('') }}")
BIG_STRING = "{% set x = 'a' * 1000000000 %}{{ x | length }}"
LONG_LOOP = "{% for i in range(20000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"  # 2x10^8 steps


def parse(*flags: str) -> argparse.Namespace:
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(list(flags))
    validate_parsed_serve_args(args)
    return args


def test_the_flags_are_real_and_checked():
    assert "--trust-request-chat-template" not in COMPAT_FLAGS  # no longer a no-op
    cfg = RequestTemplateConfig.from_args(parse())
    assert cfg == RequestTemplateConfig() and cfg.trust is False and cfg.timeout_s == 5.0
    cfg = RequestTemplateConfig.from_args(parse("--trust-request-chat-template", "--request-chat-template-timeout",
                                                "0.5", "--request-chat-template-memory", "64MiB",
                                                "--request-chat-template-workers", "3"))
    assert (cfg.trust, cfg.timeout_s, cfg.memory_bytes, cfg.num_workers) == (True, 0.5, 64 << 20, 3)
    for flags, name in ((("--request-chat-template-timeout", "0"), "timeout"),
                        (("--request-chat-template-memory", "1MiB"), "memory"),
                        (("--request-chat-template-memory", "lots"), "memory"),
                        (("--request-chat-template-workers", "0"), "workers")):
        with pytest.raises(ValueError, match=f"request_chat_template_{name}"):
            parse(*flags)


def test_a_request_template_is_refused_unless_trusted(smol_tokenizer):
    renderer = AsyncRenderer(Renderer(smol_tokenizer))
    for kwargs, param in (({"chat_template": TEMPLATE}, "chat_template"),
                          ({"chat_template": ""}, "chat_template"),
                          ({"chat_template_kwargs": {"chat_template": TEMPLATE}}, "chat_template_kwargs")):
        for call in (renderer.render_chat, renderer.render_messages):
            with pytest.raises(SamplingParamsError, match="--trust-request-chat-template") as e:
                asyncio.run(call(MSGS, **kwargs))
            assert e.value.param == param
    # the server's own template and ordinary template variables are not affected
    ok = asyncio.run(renderer.render_chat(MSGS, chat_template_kwargs={"chat_template": None, "x": 1}))
    assert ok.token_ids == Renderer(smol_tokenizer).render_chat(MSGS).token_ids
    renderer.shutdown()


@pytest.fixture(scope="module")
def sandboxed(smol_tokenizer):
    """A trusted AsyncRenderer with two workers (one serves while a killed one is replaced)
    and a 1.5 s render bound."""
    renderer = AsyncRenderer(Renderer(smol_tokenizer, None, PromptCharLimit.for_tokenizer(smol_tokenizer, 2048)), 1,
                             RequestTemplateConfig(trust=True, timeout_s=1.5, memory_bytes=256 << 20, num_workers=2))
    yield renderer
    renderer.shutdown()
    assert not renderer._sandbox._workers


def workers_of(renderer) -> set[int]:
    return {w.proc.pid for w in renderer._sandbox._workers}


def killed(renderer, before: set[int]) -> int:
    """How many of the workers in ``before`` were killed (and forgotten) since."""
    return len(before - workers_of(renderer))


async def render(renderer, template, **kwargs):
    return await renderer.render_chat(MSGS, chat_template=template, **kwargs)


def test_a_trusted_template_renders_as_in_process(sandboxed, smol_tokenizer):
    """The worker runs the same apply_chat_template: same text and token ids, template
    variables, and a template in chat_template_kwargs (which wins, as in vLLM)."""
    local = Renderer(smol_tokenizer)
    for kwargs in ({}, {"chat_template_kwargs": {"greeting": "Bonjour"}}, {"add_generation_prompt": False}):
        got = asyncio.run(render(sandboxed, TEMPLATE, **kwargs))
        want = local.render_chat(MSGS, chat_template=TEMPLATE, **kwargs)
        assert (got.text, got.token_ids) == (want.text, want.token_ids)
    assert "Bonjour" in asyncio.run(render(sandboxed, TEMPLATE, chat_template_kwargs={"greeting": "Bonjour"})).text
    smuggled = asyncio.run(sandboxed.render_chat(MSGS, chat_template="{{ 'ignored' }}",
                                                 chat_template_kwargs={"chat_template": TEMPLATE}))
    assert smuggled.text == local.render_chat(MSGS, chat_template=TEMPLATE).text
    # a request template is a literal: a server file path is not read
    assert asyncio.run(render(sandboxed, "/etc/hostname")).text == "/etc/hostname"
    # template errors stay the 400s they were
    with pytest.raises(SamplingParamsError, match="Chat template error") as e:
        asyncio.run(render(sandboxed, "{% if %}"))
    assert e.value.param == "messages"
    with pytest.raises(SamplingParamsError, match="MAX_RANGE"):  # jinja2's sandbox refuses the big range itself
        asyncio.run(render(sandboxed, "{% for i in range(200000000) %}{% endfor %}"))


def test_a_template_that_needs_too_much_memory_is_a_400(sandboxed):
    before = workers_of(sandboxed)
    with pytest.raises(SamplingParamsError, match="needed more than 256 MiB") as e:
        asyncio.run(render(sandboxed, BIG_STRING))
    assert e.value.param == "chat_template"
    assert workers_of(sandboxed) == before  # MemoryError in the worker: it lives on
    # a rendered prompt longer than the context allows never leaves the worker
    with pytest.raises(SamplingParamsError, match="maximum context length") as e:
        asyncio.run(render(sandboxed, "{% for i in range(2000) %}{{ 'abcdefgh' * 1000 }}{% endfor %}"))


def test_a_long_render_is_killed_at_the_bound_and_the_worker_replaced(sandboxed, smol_tokenizer):
    before = workers_of(sandboxed)
    with pytest.raises(SamplingParamsError, match=r"within 1.5 s \(--request-chat-template-timeout\)") as e:
        asyncio.run(render(sandboxed, LONG_LOOP))
    assert e.value.param == "chat_template"
    assert killed(sandboxed, before) == 1  # the busy worker was killed
    # the replacement renders the next request (it waits for the new worker to start)
    assert asyncio.run(render(sandboxed, TEMPLATE)).text == Renderer(smol_tokenizer).render_messages(
        MSGS, chat_template=TEMPLATE)


def test_the_request_deadline_stops_a_render_with_a_408(sandboxed):
    expired = []

    async def with_timeout():
        token = set_deadline(Deadline(time.monotonic() + 0.5, on_expire=lambda: expired.append(1)))
        try:
            await render(sandboxed, LONG_LOOP)
        finally:
            reset_deadline(token)

    asyncio.run(render(sandboxed, TEMPLATE))  # a worker is ready
    before = workers_of(sandboxed)
    with pytest.raises(RequestDeadlineExceeded, match="chat_template"):
        asyncio.run(with_timeout())
    assert expired == [1] and killed(sandboxed, before) == 1


def test_a_cancelled_request_kills_its_render(sandboxed):
    """A client disconnect cancels the handler's task: the worker is killed then, not
    at the render bound."""
    async def cancel_soon():
        task = asyncio.ensure_future(render(sandboxed, LONG_LOOP))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(render(sandboxed, TEMPLATE))
    before = workers_of(sandboxed)
    asyncio.run(cancel_soon())
    assert killed(sandboxed, before) == 1  # killed and forgotten at the cancel
