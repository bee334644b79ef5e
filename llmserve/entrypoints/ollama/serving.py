"""Ollama's generation and embedding routes over the OpenAI handlers (one engine path).

Each Ollama request is mapped to the common request and served by the handler the
OpenAI routes use, through its ``wire=False`` seam; only the wire format is Ollama's
(``stream.py``):
- ``/api/chat`` -> ChatCompletionRequest -> ``OpenAIServingChat``: messages (with
  ``tool_calls`` arguments as objects, ``tool`` messages with ``tool_name``), ``tools``,
  ``options`` (``options.py``), ``format`` (structured outputs), ``think`` (the chat
  template's ``enable_thinking``; needs ``--reasoning-parser`` to be split out).
  A final assistant message with text is continued, not answered: the template leaves
  it open (the chat path's ``continue_final_message``; Ollama's templates render the
  last assistant message unclosed) and the reply holds only the new text.
- ``/api/generate`` -> the chat handler with ``system`` + ``prompt`` as one user turn
  (Ollama applies the model's template), or, with ``raw`` or ``suffix``, the
  completion handler (the prompt as it is; ``suffix`` is the completions' fill-in-the-
  middle, a 400 naming ``suffix`` when the model has no FIM tokens), or with ``template``
  (the request's Go template, rendered as Ollama does: go_template.py). The completion
  handler answers SSE only, so its events are read back as chunk objects.
- ``/api/embed`` / ``/api/embeddings`` -> EmbeddingRequest -> the embedding handler
  (a pooling model: served alone or with ``--extra-model``).

Tools: Ollama lets the model decide whether to call one (OpenAI's ``tool_choice:
"auto"``). With ``--enable-auto-tool-choice --tool-call-parser`` that is what happens.
Without a parser the server cannot tell a call from text, so a turn that ends with the
user's message must call one of the tools (``"required"``: the call is enforced by
structured outputs), and a turn that ends with tool results or continues the
assistant's own text answers in text (tools still shown to the template); the response
header ``X-Llmserve-Tool-Choice`` says which. An enforced call is one call (OpenAI's
``parallel_tool_calls: false``): the grammar closes the array after it, so a small model
that would repeat the call until ``num_predict`` or the context ran out (SmolLM2 through
langchain-ollama's ``bind_tools``: 2,000 tokens of the same call, then an error) stops
after its first. A parser (``auto``) lets the model make several.
"""
from __future__ import annotations

import functools
import json
from types import SimpleNamespace
from typing import Any, AsyncGenerator, Awaitable, Callable, Optional

import numpy as np

from llmserve.entrypoints.assistant_prefill import continuation_fields
from llmserve.entrypoints.ollama.context_fit import fit_chat, fit_completion, over_context, truncating
from llmserve.entrypoints.ollama.go_template import TemplateError, render_prompt
from llmserve.entrypoints.ollama.names import resolve
from llmserve.entrypoints.ollama.options import (build_request, check_options, context_size, in_ollama_terms,
                                                 sampling_fields, structured_fields)
from llmserve.entrypoints.ollama.protocol import (OllamaChatRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest,
                                                  OllamaGenerateRequest, OllamaMessage, OllamaToolCall)
from llmserve.entrypoints.ollama.stream import OllamaWire, RunStats, StreamError
from llmserve.entrypoints.openai.chat_completion.context_room import prompt_bytes_bound, prompt_tokens, room_left
from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from llmserve.entrypoints.openai.completion.protocol import CompletionRequest, CompletionStreamResponse
from llmserve.entrypoints.openai.embeddings.protocol import EmbeddingRequest
from llmserve.entrypoints.openai.infill.fim import find_fim_tokens, gguf_path_of
from llmserve.sampling_params import ContextLengthExceededError, SamplingParamsError

# Ollama's roles, and OpenAI's ``developer`` (the renderer makes it a system message unless the
# template names it, as on every chat route; Ollama passes any role to the template).
ROLES = ("system", "user", "assistant", "tool", "developer")


def served_name(state: Any, name: str, pull_hint: bool = False) -> str:
    """The served model (or LoRA adapter) ``name`` calls by Ollama's rule (names.py: case
    and the default tag ``:latest`` do not matter). Raises OllamaModelNotFound (404, Ollama's
    words; ``pull_hint`` for the embedding routes')."""
    names = state.openai_serving_models.model_names + state.openai_serving_models.lora_names
    return resolve(name, names, pull_hint)


def handler(state: Any, attr: str, model: str, any_model: bool = False) -> Any:
    """The handler ``attr`` (``openai_serving_chat``...) of the model named ``model``
    (on a multi-model server, the one that model's engine serves). Raises
    ModelNotFoundError, or a 400 naming ``model`` when it cannot serve the route (not
    with ``any_model``: ModelRoutedHandler.handler_for)."""
    routed = getattr(state, attr)
    if hasattr(type(routed), "handler_for"):
        return routed.handler_for(SimpleNamespace(model=model), any_model)
    return routed


# ----------------------------------------------------------------------------- messages
def _tool_call(call: OllamaToolCall, i: int, j: int) -> dict[str, Any]:
    """A history tool call as the common request's; its ``arguments`` are an object
    (OllamaToolCallFunction refuses any other JSON type, as Ollama's decoder does)."""
    fn = call.function
    if fn is None or fn.name is None:
        raise SamplingParamsError(f"messages[{i}].tool_calls[{j}] needs a function with a name.", "messages")
    return {"id": call.id or f"call_{i}_{j}", "type": "function",
            "function": {"name": fn.name, "arguments": json.dumps(fn.arguments or {})}}


def openai_message(m: OllamaMessage, i: int) -> dict[str, Any]:
    """One Ollama message as the common request's message. Raises SamplingParamsError
    (``messages``) for images (no vision model runs here) or an unknown role."""
    if m.images:
        raise SamplingParamsError(f"messages[{i}].images: this server runs no vision model; send text only.",
                                  "messages")
    if m.role not in ROLES:
        raise SamplingParamsError(f"messages[{i}].role must be one of {list(ROLES)}.", "messages")
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.role == "assistant" and m.tool_calls:
        out["tool_calls"] = [_tool_call(c, i, j) for j, c in enumerate(m.tool_calls)]
    if m.role == "assistant" and m.thinking:
        out["reasoning_content"] = m.thinking  # templates that show past reasoning read this name
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id or f"call_{i}"
        if m.tool_name:
            out["name"] = m.tool_name
    return out


def _tool_choice(chat: Any, messages: list[dict[str, Any]], prefill: bool) -> str:
    if chat.enable_auto_tools and chat.tool_parser_cls is not None:
        return "auto"
    return "none" if prefill or (messages and messages[-1]["role"] == "tool") else "required"


def does_not_support(model: str, capability: str, why: str, param: str) -> SamplingParamsError:
    """Ollama's 400 for a request that needs a capability the model lacks, in its words
    (routes.go: ``"NAME" does not support thinking``, ``... does not support insert``;
    clients such as Ollama's own CLI match that phrase to retry without the feature),
    then ``why`` here; names ``param``."""
    return SamplingParamsError(f"{json.dumps(model, ensure_ascii=False)} does not support {capability} ({why}).",
                               param)


def _think_fields(think: Any, chat: Any, model: str = "") -> dict[str, Any]:
    """``think`` (true/false or "low"/"medium"/"high") -> the template's switches.
    Raises SamplingParamsError (``think``) when the server cannot split reasoning out
    (Ollama's ``"NAME" does not support thinking``, ``model`` the requested name)."""
    if think is None:
        return {}
    if isinstance(think, str) and think not in ("low", "medium", "high"):
        raise SamplingParamsError('think must be true, false, "low", "medium" or "high".', "think")
    if think is not False and chat.reasoning_parser_cls is None:
        raise does_not_support(model, "thinking", "think: this server splits reasoning out only when started with "
                               "--reasoning-parser", "think")
    kwargs: dict[str, Any] = {"enable_thinking": think is not False}
    if isinstance(think, str):
        kwargs["reasoning_effort"] = think
    return {"chat_template_kwargs": kwargs}


MAX_TOP_LOGPROBS = 20  # Ollama's bound (routes.go: "top_logprobs must be between 0 and 20")


def _logprob_fields(req: Any, completion: bool) -> dict[str, Any]:
    """``logprobs`` / ``top_logprobs`` (alternatives per token, 0-20) as the common
    request's fields: the chat request's pair, or the completion request's one count.
    Ollama checks the range whether or not ``logprobs`` is set, and ignores
    ``top_logprobs`` without it. Raises SamplingParamsError (``top_logprobs``)."""
    top = req.top_logprobs or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise SamplingParamsError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
    if not req.logprobs:
        return {}
    return {"logprobs": top} if completion else {"logprobs": True, "top_logprobs": top}


def _common_fields(req: Any, name: str, completion: bool = False) -> dict[str, Any]:
    # always streamed inside: the times of the first and last tokens give Ollama's durations
    return {"model": name, "stream": True, **sampling_fields(req.options), **structured_fields(req.format),
            **_logprob_fields(req, completion)}


def chat_request(req: OllamaChatRequest, name: str, chat: Any) -> tuple[ChatCompletionRequest, Optional[str]]:
    """The common request of ``/api/chat`` and the tool choice it took (None: no tools).
    A final assistant message with text is continued (Ollama's templates leave it open):
    ``assistant_prefill.continuation_fields``."""
    messages = [openai_message(m, i) for i, m in enumerate(req.messages)]
    prefill = continuation_fields(messages)
    fields = {**_common_fields(req, name), "messages": messages, **_think_fields(req.think, chat, req.model),
              **prefill}
    choice = None
    if req.tools:
        choice = _tool_choice(chat, messages, bool(prefill))
        fields.update(tools=req.tools, tool_choice=choice)
        if choice == "required":  # one enforced call (module docstring)
            fields["parallel_tool_calls"] = False
    return build_request(ChatCompletionRequest, **fields), choice


def generate_request(req: OllamaGenerateRequest, name: str, chat: Any) -> Any:
    """The common request of ``/api/generate``: a chat request (template applied), or a
    completion request with ``raw``, ``suffix`` or ``template`` (the request's Go template
    rendered as Ollama renders it: go_template.py; ``.Suffix`` is the template's to use).
    Raises SamplingParamsError for ``images`` (no vision model), a template this server
    cannot read (naming ``template``), and, as Ollama
    does (routes.go), for ``raw`` with ``template``, ``system`` or ``context``: a raw
    prompt goes to the model as it is, so they would be dropped without a word. ``context``
    is served by serve_generate (_with_context)."""
    if req.images:
        raise SamplingParamsError("images: this server runs no vision model; send text only.", "images")
    if req.raw and (req.template or req.system or req.context):
        raise SamplingParamsError("raw mode does not support template, system, or context (raw: true sends the "
                                  "prompt as it is; write the system text into it, or leave raw out).", "raw")
    if req.template:  # the request's own template (a Go template, as Ollama's) makes the prompt text
        try:
            prompt = render_prompt(req.template, req.system, req.prompt or "", req.suffix)
        except TemplateError as e:
            raise SamplingParamsError(f"template: {e} (Ollama's Go template subset read here: "
                                      "llmserve/entrypoints/ollama/go_template.py).", "template") from None
        return build_request(CompletionRequest, **_common_fields(req, name, completion=True), prompt=prompt,
                             stream_options={"include_usage": True})
    # An empty suffix is no suffix (Ollama's Go field is a plain string: "" is unset): the
    # template applies, as without one.
    if req.suffix and find_fim_tokens(chat.tokenizer, gguf_path_of(chat.model_config)) is None:
        raise does_not_support(req.model, "insert", "suffix needs fill-in-the-middle, and this model's tokenizer "
                               "has no FIM tokens such as <|fim_prefix|>, <fim_prefix> or <PRE>", "suffix")
    if req.raw or req.suffix:
        return build_request(CompletionRequest, **_common_fields(req, name, completion=True), prompt=req.prompt or "",
                             suffix=req.suffix, stream_options={"include_usage": True})
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
        [{"role": "user", "content": req.prompt or ""}]
    return build_request(ChatCompletionRequest, **_common_fields(req, name), messages=messages,
                         **_think_fields(req.think, chat, req.model))


# ----------------------------------------------------------------------------- serving
async def completion_chunks(events: AsyncGenerator[str, None]) -> AsyncGenerator[CompletionStreamResponse, None]:
    """The completion handler's SSE events back as chunk objects (the chat handler has
    the ``wire=False`` seam; the completion handler answers SSE only). An in-band error
    event is raised as StreamError."""
    try:
        async for event in events:
            data = event.strip().removeprefix("data:").strip()
            if data == "[DONE]":
                return
            obj = json.loads(data)
            if "error" in obj:
                raise StreamError(obj["error"].get("message", "the generation failed"))
            yield CompletionStreamResponse.model_validate(obj)
    finally:
        await events.aclose()


def _default_budget(handler: Any, room: int) -> Optional[int]:
    """The output budget of a request that sets none, with ``room`` tokens left in its
    context: that room, capped by the model's default budget (what the engine does with
    the server's context); None when nothing is left (the engine then reports the prompt
    as too long)."""
    cap = handler.default_sampling_params.get("max_tokens")
    return (min(room, cap) if cap else room) if room > 0 else None


async def _budget(chat: Any, common: ChatCompletionRequest, context: int) -> None:
    """``common.max_tokens`` so that prompt + answer fit ``context`` tokens: a
    ``num_predict`` above the room the prompt leaves becomes that room (Ollama generates
    until the context is full rather than refusing: a 400 naming ``max_tokens``, a field
    its clients never sent), and no ``num_predict`` under an ``options.num_ctx`` smaller
    than the server's context is that room (the engine's default would be the server's).
    A prompt that fills the context alone is left to the engine's "prompt too long" 400."""
    if common.max_tokens is not None:
        room = await room_left(chat, common, common.max_tokens, context)
        if 0 < room < common.max_tokens:
            common.max_tokens = room
    elif context < chat.max_model_len:
        common.max_tokens = _default_budget(chat, context - await prompt_tokens(chat, common))


async def _refuse_over_context(chat: Any, common: ChatCompletionRequest, context: int) -> None:
    """``truncate: false`` with a prompt that fills an ``options.num_ctx`` smaller than the
    server's context: the 400 the engine gives for the server's (over_context). Raises
    SamplingParamsError."""
    if context < chat.max_model_len and prompt_bytes_bound(common) >= context:
        n = await prompt_tokens(chat, common)
        if n >= context:
            raise over_context(n, context)


async def _fit(req: Any, chat: Any, common: ChatCompletionRequest, context: int) -> ChatCompletionRequest:
    """``common`` shortened to the request's ``context`` (tokens: context_size) when
    Ollama's ``truncate`` allows (context_fit.py), refused past it when not, then its
    budget set to the room left (_budget); a prompt cut to its last tokens already has
    its budget, so it is not rendered again."""
    if truncating(req):
        common = await fit_chat(chat, common, context)
    else:
        await _refuse_over_context(chat, common, context)
    if common.truncate_prompt_tokens is None:
        await _budget(chat, common, context)
    return common


def ollama_terms(serve: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``serve`` with the errors raised before its answer starts naming the Ollama option
    the client sent (options.in_ollama_terms: ``options.stop``, not ``stop``)."""
    @functools.wraps(serve)
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return await serve(*args, **kwargs)
        except SamplingParamsError as e:
            raise in_ollama_terms(e) from None
    return wrapped


@ollama_terms
async def check_chat(state: Any, req: OllamaChatRequest) -> None:
    """What :func:`serve_chat` refuses before it renders the prompt (the model, the
    messages, options, format, think, tools, the common request's checks), with the same
    errors; nothing is rendered or run. Admission control runs it on a request it would
    refuse, so a malformed one gets its own 400, not a 429 (admission_precheck.py)."""
    name = served_name(state, req.model)
    if req.messages:
        chat = handler(state, "openai_serving_chat", name)
        chat_request(req, name, chat)[0].check()


@ollama_terms
async def check_generate(state: Any, req: OllamaGenerateRequest) -> None:
    """:func:`check_chat` for ``/api/generate`` (:func:`serve_generate`'s checks)."""
    name = served_name(state, req.model)
    if req.prompt or req.suffix:
        generate_request(req, name, handler(state, "openai_serving_chat", name)).check()


@ollama_terms
async def serve_chat(state: Any, req: OllamaChatRequest, request_id: Optional[str]) -> tuple[Any, dict[str, str]]:
    """``/api/chat``: (an async generator of NDJSON lines, or the one object; headers)."""
    name = served_name(state, req.model)
    wire = OllamaWire(req.model, chat=True, top_logprobs=req.top_logprobs or 0)  # the name as the request wrote it
    if not req.messages:
        return wire.loaded(req.keep_alive), {}
    chat = handler(state, "openai_serving_chat", name)
    common, choice = chat_request(req, name, chat)
    common = await _fit(req, chat, common, context_size(req.options, chat.max_model_len))
    stats = RunStats()
    chunks = await chat.create_chat_completion(common, request_id, wire=False)
    headers = {"X-Llmserve-Tool-Choice": choice} if choice else {}
    return (wire.lines(chunks, stats) if req.stream is not False else await wire.whole(chunks, stats)), headers


def _fit_raw(req: OllamaGenerateRequest, completion: Any, common: CompletionRequest) -> CompletionRequest:
    """A raw or fill-in-the-middle ``/api/generate`` request fitted to its context
    (context_size): over it, its last half context of tokens (``truncate``) or the 400 of
    over_context (``truncate: false``; past the server's context the engine's own);
    within it, the budget set to the room left (no ``num_predict``: Ollama's default is
    no limit, not the legacy 16) or capped by it."""
    context = context_size(req.options, completion.max_model_len)
    n = len(completion.tokenizer.encode(common.prompt + (common.suffix or "")))
    if n >= context:
        if truncating(req):
            return fit_completion(common, n, context)
        if context < completion.max_model_len:
            raise over_context(n, context)
        return common  # the engine's "prompt too long" 400
    if common.max_tokens is None:
        common.max_tokens = _default_budget(completion, context - n)
    else:
        common.max_tokens = min(common.max_tokens, context - n)
    return common


@ollama_terms
async def serve_generate(state: Any, req: OllamaGenerateRequest, request_id: Optional[str]) -> Any:
    """``/api/generate``: an async generator of NDJSON lines, or the one object."""
    name = served_name(state, req.model)
    wire = OllamaWire(req.model, chat=False, top_logprobs=req.top_logprobs or 0)  # the name as the request wrote it
    if not req.prompt and not req.suffix:
        return wire.loaded(req.keep_alive)
    chat = handler(state, "openai_serving_chat", name)
    common = generate_request(req, name, chat)
    stats = RunStats()
    if isinstance(common, CompletionRequest):
        completion = handler(state, "openai_serving_completion", name)
        if req.template:  # not raw: the earlier context goes first, and a context comes back
            common.prompt = await _context_text(chat, req) + common.prompt
            wire.context_of = _context_of(chat, common.prompt)
        common = _fit_raw(req, completion, common)
        chunks = completion_chunks(await completion.create_completion(common, request_id, openai_budget=False))
    elif req.context:
        chunks, prompt = await _with_context(state, req, name, chat, common, request_id)
        wire.context_of = _context_of(chat, prompt)
    else:
        common = await _fit(req, chat, common, context_size(req.options, chat.max_model_len))
        wire.context_of = _context_of(chat, await _prompt_text(chat, common))
        chunks = await chat.create_chat_completion(common, request_id, wire=False)
    return wire.lines(chunks, stats) if req.stream is not False else await wire.whole(chunks, stats)


async def _prompt_text(chat: Any, common: ChatCompletionRequest) -> str:
    """The text the chat template makes of ``common`` (what the engine will run)."""
    rendered = await chat.render(common)
    if rendered.text is not None:
        return rendered.text
    return chat.tokenizer.decode(rendered.token_ids, skip_special_tokens=False)


def _context_of(chat: Any, prompt: str) -> Callable[[str], Awaitable[list[int]]]:
    """Ollama's ``context`` of an answer: the token ids of the prompt's text and the
    answer's (tokenized together, as Ollama does), for the next request's ``context``."""
    async def context(answer: str) -> list[int]:
        return await chat.renderer.encode(prompt + answer, add_special_tokens=False)
    return context


async def _context_text(chat: Any, req: OllamaGenerateRequest) -> str:
    """The text of ``req.context`` (Ollama's token ids of an earlier answer; "" for none).
    Raises SamplingParamsError naming ``context.<i>`` for an id outside the vocabulary."""
    if not req.context:
        return ""
    vocab = chat.model_config.vocab_size
    for i, t in enumerate(req.context):
        if not 0 <= t < vocab:
            raise SamplingParamsError(f"context.{i}: the token id is out of vocabulary (valid ids are "
                                      f"0..{vocab - 1}).", f"context.{i}")
    return await chat.renderer.run_in_pool(chat.tokenizer.decode, list(req.context), skip_special_tokens=False)


async def _with_context(state: Any, req: OllamaGenerateRequest, name: str, chat: Any, common: ChatCompletionRequest,
                        request_id: Optional[str]) -> tuple[Any, str]:
    """A templated ``/api/generate`` with Ollama's (deprecated) ``context``: the text of
    those token ids, then the template's text of this turn, run as one completion (the
    chunks, and that prompt text). Raises SamplingParamsError naming ``context`` for an
    id outside the vocabulary."""
    prompt = await _context_text(chat, req) + await _prompt_text(chat, common)
    completion = handler(state, "openai_serving_completion", name)
    request = build_request(CompletionRequest, **_common_fields(req, name, completion=True), prompt=prompt,
                            stream_options={"include_usage": True})
    request = _fit_raw(req, completion, request)
    return completion_chunks(await completion.create_completion(request, request_id, openai_budget=False)), prompt


def embed_over_context(n: int, context: int) -> SamplingParamsError:
    """The 400 of an embedding input of ``n`` tokens over a ``context`` of tokens under
    ``truncate: false``: Ollama's words (``input exceeds maximum context length``, which
    clients match) first, then the counts and what to change; names ``input``."""
    return SamplingParamsError(f"input exceeds maximum context length: an input has {n} tokens and the context "
                               f"(options.num_ctx, at most the model's) is {context}. Shorten it, raise "
                               f"options.num_ctx or leave truncate on.", "input")


async def _refuse_long_inputs(embedding: Any, inputs: list[str], context: int) -> None:
    """``truncate: false``: raise :func:`embed_over_context` when an input's tokens
    (special tokens included, as they run) exceed ``context``."""
    try:
        prompts = await embedding.render_input(inputs, True)
    except ContextLengthExceededError:  # over the server's context (the renderer's check)
        prompts = await embedding.render_input(inputs, True, truncate_prompt_tokens=10 ** 9)
    longest = max(len(p.token_ids) for p in prompts)
    if longest > context:
        raise embed_over_context(longest, context)


async def _embed(state: Any, model: str, inputs: list[str], truncate: bool,
                 options: Optional[dict[str, Any]] = None) -> Any:
    """Embed ``inputs`` as Ollama's EmbedHandler does: each input's tokens are at most the
    context (``options.num_ctx``, never above the model's; context_size); a longer one
    keeps its first tokens (``truncate``, Ollama's default) or is a 400 (``truncate:
    false``, :func:`embed_over_context`)."""
    name = served_name(state, model, pull_hint=True)
    embedding = handler(state, "openai_serving_embedding", name, any_model=True)
    context = context_size(options, embedding.max_model_len)
    if not truncate:
        await _refuse_long_inputs(embedding, inputs, context)
    common = EmbeddingRequest(model=name, input=inputs, truncate_prompt_tokens=context if truncate else None)
    # Ollama embeds with any model: a generating one through its hidden states
    return await embedding.create_embedding(common, hidden_state_embed=True)


def ollama_vector(vector: list[float], dimensions: Optional[int]) -> list[float]:
    """One ``/api/embed`` vector as Ollama's EmbedHandler returns it: scaled to unit L2
    norm, then, with ``dimensions`` from 1 to below its length, cut to its first ``dimensions``
    values and scaled to unit norm again, whatever the model (Ollama does not ask whether
    it was trained for shorter vectors, as OpenAI's ``dimensions`` does). A zero vector
    stays zero."""
    v = np.asarray(vector, dtype=np.float64)
    if dimensions is not None and 0 < dimensions < v.size:
        v = v[:dimensions]
    norm = float(np.linalg.norm(v))
    return (v / norm if norm > 0 else v).tolist()


async def serve_embed(state: Any, req: OllamaEmbedRequest) -> dict[str, Any]:
    """``/api/embed``: ``{"model", "embeddings": [[float]], "prompt_eval_count", durations}``,
    ``model`` as the request wrote it (Ollama's answer)."""
    stats = RunStats()
    check_options(req.options)
    # "" (or null: go_json.py) is no input, as Ollama reads a string input; an empty string
    # inside a list is embedded
    inputs = ([req.input] if req.input else []) if isinstance(req.input, str) else list(req.input)
    if not inputs:
        served_name(state, req.model, pull_hint=True)
        return {"model": req.model, "embeddings": []}
    resp = await _embed(state, req.model, inputs, req.truncate is not False, options=req.options)
    return {"model": req.model, "embeddings": [ollama_vector(d.embedding, req.dimensions) for d in resp.data],
            "total_duration": stats.final_fields()["total_duration"], "load_duration": 0,
            "prompt_eval_count": resp.usage.prompt_tokens}


async def serve_embeddings(state: Any, req: OllamaEmbeddingsRequest) -> dict[str, Any]:
    """``/api/embeddings`` (Ollama's older route): ``{"embedding": [float]}``; an empty
    prompt gives an empty vector, as Ollama answers."""
    check_options(req.options)
    if not req.prompt:
        served_name(state, req.model, pull_hint=True)
        return {"embedding": []}
    resp = await _embed(state, req.model, [req.prompt], truncate=True, options=req.options)
    return {"embedding": resp.data[0].embedding}
