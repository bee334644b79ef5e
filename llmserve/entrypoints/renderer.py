"""The one renderer: chat messages -> chat-template text -> prompt token ids, and text
prompts -> token ids (vLLM's renderer / ``chat_utils``).

:class:`Renderer` is synchronous and serves the offline ``LLM.chat`` and
``LLM.apply_chat_template``; :class:`AsyncRenderer` runs the same calls in a pool of
``renderer_num_workers`` threads (``loop.run_in_executor``) for the OpenAI server's chat,
completion, tokenize and responses handlers, so a large chat template or a long prompt
never blocks the event loop (``/health`` and the streams keep answering).

A chat template writes every special token itself, so rendered chat text is tokenized
with ``add_special_tokens=False`` by default (vLLM's rule); a text prompt gets them.

A request's own ``chat_template`` is refused by :class:`AsyncRenderer` (400 naming the
field) unless ``--trust-request-chat-template``; a trusted one renders in the
:class:`~llmserve.entrypoints.template_sandbox.TemplateSandbox` worker processes (time
and memory bounds), never in the API server.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, TypeVar, Union

from llmserve.engine.pooling_inputs import truncate_pair_ids, truncate_text_ids
from llmserve.entrypoints.chat_utils import apply_chat_template, check_custom_roles, conversation_for_template
from llmserve.entrypoints.template_sandbox import RequestTemplateConfig, TemplateSandbox
from llmserve.sampling_params import SamplingParamsError
from llmserve.tokenizer import check_encodable, resolve_chat_template

T = TypeVar("T")


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt ready for the engine: ``text`` (None for a token-id prompt) and its
    ``token_ids`` (list[int]); ``token_type_ids``: each token's segment, for a text pair
    (cross-encoder scoring; None otherwise)."""

    text: Optional[str]
    token_ids: list[int]
    token_type_ids: Optional[list[int]] = None

    def to_engine_prompt(self) -> dict[str, Any]:
        """The prompt dict ``AsyncLLM.generate`` / ``LLM.generate`` take (token ids plus
        the text for detokenization and logs, and a pair's ``token_type_ids``)."""
        prompt: dict[str, Any] = {"prompt_token_ids": self.token_ids}
        if self.text is not None:
            prompt["prompt"] = self.text
        if self.token_type_ids is not None:
            prompt["token_type_ids"] = self.token_type_ids
        return prompt


class Renderer:
    """Messages -> template text -> token ids with one tokenizer.

    Args:
      tokenizer: a HF tokenizer (``apply_chat_template``, ``encode``).
      chat_template: the default template (a file path or literal Jinja, as
        ``--chat-template``); None uses the tokenizer's own.
      prompt_limit: the server's cheap length check (a ``PromptCharLimit``: ``check(texts,
        param)`` raises a 400 for text that cannot fit the context), run before the
        template and the tokenizer unless a call passes ``check_length=False`` (a request
        that asks for truncation); None checks nothing (offline).
    Raises ValueError (field ``chat_template``) for a template value that is neither.
    """

    def __init__(self, tokenizer: Any, chat_template: Optional[str] = None, prompt_limit: Any = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = resolve_chat_template(chat_template)
        self.prompt_limit = prompt_limit

    def check_length(self, texts: Iterable[Optional[str]], param: str) -> None:
        """``prompt_limit.check`` (when there is one): a 400 naming ``param`` for text
        that certainly does not fit the context, before any tokenizing."""
        if self.prompt_limit is not None:
            self.prompt_limit.check(texts, param)

    def render_messages(self, messages: Iterable[Any], *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, chat_template: Optional[str] = None,
                        chat_template_kwargs: Optional[dict[str, Any]] = None,
                        tools: Optional[list[dict[str, Any]]] = None, check_length: bool = True) -> str:
        """The template text of ``messages`` (pydantic messages or dicts; content parts
        joined). ``chat_template`` (file path or literal) overrides the default one.

        Raises SamplingParamsError (400) for unsupported content parts or roles, a
        template error, or both ``add_generation_prompt`` and ``continue_final_message``.
        """
        template = resolve_chat_template(chat_template) if chat_template else self.chat_template
        messages = list(messages)
        check_custom_roles(messages, template or getattr(self.tokenizer, "chat_template", None))
        conversation = self.conversation(messages, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, check_length=check_length)
        return apply_chat_template(
            self.tokenizer, conversation, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=template,
            chat_template_kwargs=chat_template_kwargs, tools=tools)

    def conversation(self, messages: Iterable[Any], *, add_generation_prompt: bool, continue_final_message: bool,
                     check_length: bool = True) -> list[dict[str, Any]]:
        """The checks before a template runs, then the messages as the plain dicts a
        template reads (``conversation_for_template``). Raises SamplingParamsError (400)
        for both ``add_generation_prompt`` and ``continue_final_message``, text that
        cannot fit the context (with ``check_length``), or a bad message."""
        if continue_final_message and add_generation_prompt:
            raise SamplingParamsError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to true.",
                "continue_final_message")
        if check_length and self.prompt_limit is not None:
            from llmserve.entrypoints.openai.common.limits import message_texts

            messages = list(messages)
            self.check_length(message_texts(messages), "messages")
        return conversation_for_template(messages, continue_final_message)

    def encode(self, text: str, *, add_special_tokens: bool, param: str = "prompt",
               check_length: bool = True) -> list[int]:
        """Token ids (list[int]) of ``text``. Raises SamplingParamsError naming ``param``
        for text that is not valid Unicode (a lone surrogate) or, with ``check_length``,
        that certainly does not fit the context (see ``prompt_limit``)."""
        if check_length:
            self.check_length([text], param)
        check_encodable(text, param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_pair(self, text: str, text_pair: str, *, add_special_tokens: bool = True,
                    check_length: bool = True, param: str = "text_2",
                    truncate: Optional[int] = None) -> RenderedPrompt:
        """Two texts as one cross-encoder input, as the tokenizer joins a pair
        (``tokenizer(text=..., text_pair=...)``: [CLS] a [SEP] b [SEP] for BERT) with its
        ``token_type_ids`` when it returns them (vLLM's ``_cross_encoding_score``).
        ``truncate``: at most this many tokens (``truncate_prompt_tokens``, -1 resolved),
        cut as the tokenizer's ``truncation=True`` cuts (longest text first, from its end,
        special tokens kept; ``pooling_inputs.truncate_pair_ids``), not the last tokens:
        those would drop the query. Raises SamplingParamsError naming ``param`` as
        :meth:`encode` does."""
        if check_length:
            self.check_length([text, text_pair], param)
        check_encodable(text, param)
        check_encodable(text_pair, param)
        enc = self.tokenizer(text=text, text_pair=text_pair, add_special_tokens=add_special_tokens)
        ids, types = list(enc["input_ids"]), enc.get("token_type_ids")
        types = None if types is None else list(types)
        if truncate is not None and len(ids) > truncate:
            cut = truncate_pair_ids(self.tokenizer, text, text_pair, truncate, ids, types, add_special_tokens)
            ids, types = cut if cut is not None else (ids, types)
        return RenderedPrompt(None, ids, types)

    def render_chat(self, messages: Iterable[Any], *, add_special_tokens: bool = False,
                    **template_kwargs: Any) -> RenderedPrompt:
        """``render_messages`` then ``encode`` (errors name ``messages``).
        template_kwargs: the keyword arguments of :meth:`render_messages`."""
        text = self.render_messages(messages, **template_kwargs)
        return RenderedPrompt(text, self.encode(text, add_special_tokens=add_special_tokens, param="messages",
                                                check_length=template_kwargs.get("check_length", True)))

    def render_prompt(self, prompt: Union[str, list[int]], *, add_special_tokens: bool = True,
                      check_length: bool = True, param: str = "prompt",
                      truncate: Optional[int] = None) -> RenderedPrompt:
        """A completion prompt: text is tokenized; token ids pass as they are (the
        engine's InputProcessor checks them against the vocabulary). ``truncate`` (a
        pooling request's ``truncate_prompt_tokens``, -1 resolved): text is cut to that
        many tokens as the tokenizer's truncation cuts, its first tokens and its special
        tokens kept (``pooling_inputs.truncate_text_ids``); token ids are left to the engine."""
        if isinstance(prompt, str):
            if truncate is not None:
                check_encodable(prompt, param)
                return RenderedPrompt(prompt, truncate_text_ids(self.tokenizer, prompt, truncate, add_special_tokens))
            return RenderedPrompt(prompt, self.encode(prompt, add_special_tokens=add_special_tokens, param=param,
                                                      check_length=check_length))
        return RenderedPrompt(None, list(prompt))


class AsyncRenderer:
    """A :class:`Renderer` whose calls run in a pool of ``num_workers`` threads.

    num_workers: ``--renderer-num-workers`` (int >= 1). Jinja rendering and the Python
    parts of tokenization hold the GIL, but in a worker thread they only take turns with
    the event loop (every few ms) instead of stopping it for the whole render.
    request_templates: how a request's own ``chat_template`` is handled (vLLM's
    ``--trust-request-chat-template``; default: refused). When trusted, such templates
    render in a :class:`TemplateSandbox` (worker processes with a time and memory bound).
    Raises ValueError (field ``renderer_num_workers``) for num_workers < 1.
    """

    def __init__(self, renderer: Renderer, num_workers: int = 1,
                 request_templates: Optional[RequestTemplateConfig] = None) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"renderer_num_workers must be an integer >= 1, got {num_workers!r}")
        self.renderer = renderer
        self.num_workers = num_workers
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="llmserve-renderer")
        self.request_templates = request_templates or RequestTemplateConfig()
        self._sandbox = (TemplateSandbox(renderer.tokenizer, renderer.prompt_limit, self.request_templates)
                         if self.request_templates.trust else None)

    @classmethod
    def from_args(cls, renderer: Renderer, args: Any) -> "AsyncRenderer":
        """From the serve flags (``--renderer-num-workers``, ``--trust-request-chat-template``
        and the ``--request-chat-template-*`` bounds)."""
        return cls(renderer, getattr(args, "renderer_num_workers", None) or 1, RequestTemplateConfig.from_args(args))

    def _request_template(self, kwargs: dict[str, Any]) -> Optional[str]:
        """Take the request's template out of ``kwargs`` (``chat_template``, or
        ``chat_template_kwargs.chat_template``, which wins as in vLLM, where the kwargs
        update the template arguments). None when there is none (or it is empty: the
        server's template). Raises SamplingParamsError (400 naming the field) when the
        server does not trust request templates, or for a template that is not a string."""
        template = kwargs.pop("chat_template", None)
        extra = kwargs.get("chat_template_kwargs")
        smuggled = extra.get("chat_template") if isinstance(extra, dict) else None
        if template is None and smuggled is None:
            return None
        param = "chat_template" if smuggled is None else "chat_template_kwargs"
        if not self.request_templates.trust:
            raise SamplingParamsError(
                f"`{param}{'' if smuggled is None else '.chat_template'}`: a chat template sent with the request "
                "is refused: this server does not run with --trust-request-chat-template (vLLM's rule). "
                "Leave it out to use the model's chat template.", param)
        if smuggled is not None:
            kwargs["chat_template_kwargs"] = {k: v for k, v in extra.items() if k != "chat_template"}
            template = smuggled
        if not isinstance(template, str):
            raise SamplingParamsError(f"`{param}` must hold the template as a string.", param)
        return template or None

    async def _render_request_template(self, messages: Iterable[Any], template: str, kwargs: dict[str, Any]) -> str:
        """Checks and message parsing in the thread pool, the template in the sandbox."""
        add_generation_prompt = kwargs.get("add_generation_prompt", True)
        continue_final_message = kwargs.get("continue_final_message", False)
        check_length = kwargs.get("check_length", True)
        messages = list(messages)
        check_custom_roles(messages, template)
        conversation = await self._run(self.renderer.conversation, messages, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, check_length=check_length)
        sandbox: Any = self._sandbox  # made in __init__ when trusted, and _request_template checked that
        return await sandbox.render(
            conversation, template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template_kwargs=kwargs.get("chat_template_kwargs"),
            tools=kwargs.get("tools"), check_length=check_length)

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def render_messages(self, messages: Iterable[Any], **kwargs: Any) -> str:
        """:meth:`Renderer.render_messages` in the pool; a request ``chat_template`` is
        refused or sandboxed (see the class docstring)."""
        template = self._request_template(kwargs)
        if template is None:
            return await self._run(self.renderer.render_messages, messages, **kwargs)
        return await self._render_request_template(messages, template, kwargs)

    async def render_chat(self, messages: Iterable[Any], *, add_special_tokens: bool = False,
                          **kwargs: Any) -> RenderedPrompt:
        """:meth:`Renderer.render_chat` in the pool; a request ``chat_template`` is
        refused or sandboxed (see the class docstring)."""
        template = self._request_template(kwargs)
        if template is None:
            return await self._run(self.renderer.render_chat, messages, add_special_tokens=add_special_tokens, **kwargs)
        text = await self._render_request_template(messages, template, kwargs)
        return RenderedPrompt(text, await self.encode(text, add_special_tokens=add_special_tokens, param="messages",
                                                      check_length=kwargs.get("check_length", True)))

    async def render_prompts(self, prompts: list[Union[str, list[int]]], *, add_special_tokens: bool = True,
                             check_length: bool = True, param: str = "prompt",
                             truncate: Optional[int] = None) -> list[RenderedPrompt]:
        """:meth:`Renderer.render_prompt` of each prompt, in the pool (one task per prompt;
        each is length-checked on its own before it is tokenized)."""
        return list(await asyncio.gather(*(
            self._run(self.renderer.render_prompt, p, add_special_tokens=add_special_tokens,
                      check_length=check_length, param=param, truncate=truncate) for p in prompts)))

    async def render_pairs(self, pairs: list[tuple[str, str]], *, add_special_tokens: bool = True,
                           check_length: bool = True, param: str = "text_2",
                           truncate: Optional[int] = None) -> list[RenderedPrompt]:
        """:meth:`Renderer.render_pair` of each (text, text_pair), in the pool."""
        return list(await asyncio.gather(*(
            self._run(self.renderer.render_pair, a, b, add_special_tokens=add_special_tokens,
                      check_length=check_length, param=param, truncate=truncate) for a, b in pairs)))

    async def encode(self, text: str, *, add_special_tokens: bool, param: str = "prompt",
                     check_length: bool = True) -> list[int]:
        """:meth:`Renderer.encode` in the pool."""
        return await self._run(self.renderer.encode, text, add_special_tokens=add_special_tokens, param=param,
                               check_length=check_length)

    async def run_in_pool(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in the pool (tokenizer work that is not a render, such
        as ``/detokenize`` of a long id list)."""
        return await self._run(fn, *args, **kwargs)

    def shutdown(self) -> None:
        """Stop the pool: queued renders are dropped, running ones finish in the background;
        the request-template workers are killed."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._sandbox is not None:
            self._sandbox.shutdown()
