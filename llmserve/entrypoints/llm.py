"""The offline API (vLLM's ``LLM``): batch generation and chat on one engine."""
from __future__ import annotations

import functools
import itertools
import logging
import warnings
from typing import Any, Callable, Optional, Sequence, Union

from tqdm.auto import tqdm

from llmserve.beam_search import BeamSearchOutput, BeamSearchParams
from llmserve.engine.input_processor import PromptType
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.request_kwargs import refuse_unhonoured
from llmserve.engine_args import (EngineArgs, UsageContext, check_kwargs, log_non_default_args,
                                  make_compilation_config, make_kv_transfer_config, make_worker_cls)
from llmserve.entrypoints.llm_pooling import PoolingMixin
from llmserve.entrypoints.renderer import Renderer
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

ParamsArg = Union[SamplingParams, Sequence[SamplingParams], None]


def _normalize_kwargs(kwargs: dict[str, Any]) -> None:
    """vLLM's ``LLM.__init__`` handling of its kwargs, in place: ``swap_space`` is popped
    with a DeprecationWarning; a class ``worker_cls`` is cloudpickled; a dict
    ``kv_transfer_config`` becomes ``KVTransferConfig`` (invalid: logged, ValueError
    "Invalid 'kv_transfer_config' provided: ..."); an int ``compilation_config`` becomes
    ``CompilationConfig(mode=CompilationMode(n))``; ``data_parallel_size > 1`` raises,
    pointing to the multi-process example."""
    if "swap_space" in kwargs:
        kwargs.pop("swap_space")
        warnings.warn("swap_space is deprecated and has no effect (the engine never swaps KV to "
                      "CPU memory); remove it.", DeprecationWarning, stacklevel=3)
    if "worker_cls" in kwargs:
        kwargs["worker_cls"] = make_worker_cls(kwargs["worker_cls"])
    if "kv_transfer_config" in kwargs:
        kwargs["kv_transfer_config"] = make_kv_transfer_config(kwargs["kv_transfer_config"])
    if "compilation_config" in kwargs:
        kwargs["compilation_config"] = make_compilation_config(kwargs["compilation_config"])
    dp = int(kwargs.get("data_parallel_size", 1))
    if dp > 1 and kwargs.get("distributed_executor_backend") != "external_launcher":
        raise ValueError(
            f"LLM(data_parallel_size={dp}) is not supported for single-process usage and may hang. "
            "Please use the explicit multi-process data-parallel example at "
            "'examples/offline_inference/data_parallel.py'.")


@functools.cache
def _warn_renderer_workers(n: int) -> None:
    """Logged once per process (and value), however many LLMs are built."""
    logger.warning("renderer_num_workers=%d has no effect on the offline LLM: it renders prompts on the "
                   "calling thread; it applies to the server's async path.", n)


class LLM(PoolingMixin):
    """An LLM for offline inference (vLLM's ``LLM``). Generating models: ``generate``,
    ``chat``; pooling models (``runner="pooling"``): ``encode``, ``embed``, ``score``.

    ``LLM(model=..., **kwargs)`` takes every EngineArgs field (dtype, max_model_len,
    max_num_seqs, max_num_batched_tokens, kv_cache_memory, enable_prefix_caching, seed,
    compilation_config, kv_transfer_config, worker_cls...) with vLLM's normalisations (see
    ``_normalize_kwargs``), plus ``multiprocess_mode`` (run the EngineCore in a child
    process; default: unless LLMSERVE_ENABLE_MULTIPROCESSING=0). Stats logging is off
    unless ``disable_log_stats=False`` is given, as in vLLM. The arguments that differ from
    their defaults are logged once.

    Raises TypeError for an unknown keyword (naming the closest one), ValueError for an
    unknown model or bad arguments.
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        multiprocess = kwargs.pop("multiprocess_mode", None)
        _normalize_kwargs(kwargs)
        check_kwargs("LLM()", kwargs, [n for n in EngineArgs.__dataclass_fields__])
        kwargs.setdefault("disable_log_stats", True)
        engine_args = EngineArgs(**kwargs)
        if engine_args.renderer_num_workers > 1:
            _warn_renderer_workers(engine_args.renderer_num_workers)
        self._init_engine(engine_args, multiprocess)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, multiprocess_mode: Optional[bool] = None) -> "LLM":
        """``cls(**vars(engine_args))``, as vLLM's ``LLM.from_engine_args``: every
        ``__init__`` guard applies (the data-parallel refusal, the renderer warning)."""
        return cls(**vars(engine_args), multiprocess_mode=multiprocess_mode)

    def _init_engine(self, engine_args: EngineArgs, multiprocess: Optional[bool]) -> None:
        log_non_default_args(engine_args)
        self.engine_args = engine_args
        self.llm_engine = LLMEngine.from_engine_args(engine_args, multiprocess_mode=multiprocess,
                                                     usage_context=UsageContext.LLM_CLASS)
        self.model_config = self.llm_engine.model_config
        self.default_sampling_params: Optional[dict[str, Any]] = None
        self._counter = itertools.count()
        self._enqueued: list[str] = []  # enqueue()d ids not yet returned
        self._finished: dict[str, RequestOutput] = {}  # their outputs, when another call ran them

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the model's generation-config defaults
        (``model_config.get_diff_sampling_param()``), or plain ``SamplingParams()`` when it
        has none; what ``generate``/``chat`` use when ``sampling_params`` is None (vLLM)."""
        if self.default_sampling_params is None:
            self.default_sampling_params = self.model_config.get_diff_sampling_param()
        if self.default_sampling_params:
            return SamplingParams.from_optional(**self.default_sampling_params)
        return SamplingParams()

    def _params_for(self, params: ParamsArg, n: int) -> list[SamplingParams]:
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"The lengths of prompts and params must be the same: got {len(params)} "
                             f"sampling_params for {n} prompts; give one or one per prompt.")
        return params

    @staticmethod
    def _prompt_list(prompts: Union[PromptType, Sequence[PromptType]]) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if prompts and isinstance(prompts, list) and all(isinstance(t, int) for t in prompts):
            return [{"prompt_token_ids": prompts}]
        return list(prompts)

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]], sampling_params: ParamsArg = None,
                 use_tqdm: Union[bool, Callable[..., tqdm]] = True, lora_request: Any = None,
                 priority: Optional[list[int]] = None,
                 tokenization_kwargs: Optional[dict[str, Any]] = None) -> list[RequestOutput]:
        """Generate completions for prompts, returned in input order.

        prompts: a string, a list of strings, a list of token ids ({"prompt_token_ids":
        [...]}) or a list of such dicts. sampling_params: one for all prompts, or one per
        prompt; None: ``get_default_sampling_params()``. use_tqdm: show a progress bar; a
        callable builds it (e.g. ``functools.partial(tqdm, leave=False)``), as vLLM.
        lora_request: a ``LoRARequest`` for all prompts or one (or None) per prompt (needs
        ``enable_lora``). Each request's output is FINAL_ONLY. vLLM's keyword arguments
        only; ``tokenization_kwargs`` raises NotImplementedError when given.

        Raises ValueError for bad prompts/params (nothing is left running then).
        """
        refuse_unhonoured("LLM.generate", tokenization_kwargs=tokenization_kwargs)
        self._check_generate("generate")
        prompts = self._prompt_list(prompts)
        ids = self._add_requests(prompts, self._params_for(sampling_params, len(prompts)), priority,
                                 lora_request=lora_request)
        return self._run_engine(ids, use_tqdm)

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]], params: BeamSearchParams,
                    lora_request: Any = None, use_tqdm: Union[bool, Callable[..., tqdm]] = False,
                    concurrency_limit: Optional[int] = None) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's ``LLM.beam_search``), in the engine: the
        beams of all prompts advance together, one forward step per token, sharing the
        prompt's KV blocks (core/beam_search.py). Ranking follows transformers'
        ``generate(num_beams=beam_width, length_penalty=..., early_stopping=...)``.

        prompts: strings, {"prompt": ...} / {"prompt_token_ids": [...]} dicts, a list of
        token ids, or chat conversations (lists of {"role", "content"} messages, rendered
        through the chat template). concurrency_limit: at most this many prompts in the
        engine at once (None: all). lora_request: the adapter (or one per prompt) every
        beam runs with. Returns one BeamSearchOutput per prompt, in order,
        each with ``beam_width`` sequences, best first. Raises ValueError for bad params
        (beam_width above max_num_seqs) or prompts.
        """
        self._check_generate("beam_search")
        prompts = [self._beam_prompt(p) for p in self._beam_prompt_list(prompts)]
        limit = concurrency_limit or len(prompts) or 1
        sp = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=params.ignore_eos,
                            logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
        outs: list[RequestOutput] = []
        for lo in range(0, len(prompts), limit):
            chunk_lora = lora_request[lo:lo + limit] if isinstance(lora_request, (list, tuple)) else lora_request
            ids = self._add_requests(prompts[lo:lo + limit], [sp] * len(prompts[lo:lo + limit]), None,
                                     beam_search_params=params, lora_request=chunk_lora)
            outs += self._run_engine(ids, use_tqdm)
        from llmserve.engine.beam_output import to_beam_search_output

        return [to_beam_search_output(o, self.get_tokenizer()) for o in outs]

    @staticmethod
    def _beam_prompt_list(prompts) -> list:
        if prompts and isinstance(prompts, list) and isinstance(prompts[0], dict) and "role" in prompts[0]:
            return [prompts]  # one conversation
        return LLM._prompt_list(prompts)

    def _beam_prompt(self, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):  # a conversation
            return Renderer(self.get_tokenizer()).render_chat(prompt).to_engine_prompt()
        return prompt

    def _check_generate(self, method: str) -> None:
        tasks = self.llm_engine.get_supported_tasks()
        if "generate" not in tasks:
            advice = ("This is a sequence-classification model (no LM head): use LLM.classify, LLM.score or "
                      "LLM.reward." if "classify" in tasks else
                      "Try passing `--runner generate` to use the model as a generative model.")
            raise ValueError(f"LLM.{method}() is only supported for generative models. {advice}")

    def get_supported_tasks(self) -> tuple[str, ...]:
        """What this model can do: ("generate",), ("encode", "embed"), or a classification
        model's ("classify", "token_classify"[, "score"]) (vLLM's)."""
        return self.llm_engine.get_supported_tasks()

    def enqueue(self, prompts: Union[PromptType, Sequence[PromptType]], sampling_params: ParamsArg = None,
                priority: Optional[list[int]] = None) -> list[str]:
        """Add prompts to the engine without running it (vLLM's ``LLM.enqueue``); returns
        their request ids. ``wait_for_completion()`` runs the engine and returns them.
        Raises ValueError for a pooling model, as ``generate``."""
        self._check_generate("enqueue")
        prompts = self._prompt_list(prompts)
        ids = self._add_requests(prompts, self._params_for(sampling_params, len(prompts)), priority)
        self._enqueued += ids
        return ids

    def enqueue_chat(self, messages, sampling_params: ParamsArg = None, chat_template: Optional[str] = None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     chat_template_kwargs: Optional[dict] = None, tools: Optional[list] = None) -> list[str]:
        """``enqueue`` for conversations, rendered through the chat template like ``chat``
        (vLLM's ``LLM.enqueue_chat``); returns the request ids. Raises ValueError for a
        pooling model, as ``chat``."""
        self._check_generate("enqueue_chat")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(
            c, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools, **(chat_template_kwargs or {}))}
            for c in convs]
        return self.enqueue(prompts, sampling_params)

    def wait_for_completion(self, use_tqdm: Union[bool, Callable[..., tqdm]] = True) -> list[RequestOutput]:
        """Run the engine until every enqueued request finishes; their outputs in enqueue
        order (vLLM's ``LLM.wait_for_completion``)."""
        ids = self._enqueued
        outputs = self._run_engine(ids, use_tqdm)
        self._enqueued, self._finished = [], {}
        return outputs

    def _add_requests(self, prompts: list, params: list[SamplingParams],
                      priority: Optional[list[int]], beam_search_params: Optional[BeamSearchParams] = None,
                      lora_request: Any = None) -> list[str]:
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority: got {len(priority)} for {len(prompts)} prompts")
        if isinstance(lora_request, (list, tuple)) and len(lora_request) != len(prompts):
            raise ValueError(f"lora_request: got {len(lora_request)} for {len(prompts)} prompts")
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                sp = sp.clone()
                sp.output_kind = RequestOutputKind.FINAL_ONLY
                rid = str(next(self._counter))
                lora = lora_request[i] if isinstance(lora_request, (list, tuple)) else lora_request
                engine.add_request(rid, p, sp, priority=priority[i] if priority else 0,
                                   beam_search_params=beam_search_params, lora_request=lora)
                ids.append(rid)
        except BaseException:
            engine.abort_request(ids)
            raise
        return ids

    def _run_engine(self, ids: list[str], use_tqdm: Union[bool, Callable[..., tqdm]]) -> list[RequestOutput]:
        engine = self.llm_engine
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[Optional[RequestOutput]] = [self._finished.get(rid) for rid in ids]
        keep = set(self._enqueued)
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
                    elif out.finished and out.request_id in keep:  # enqueued; kept for wait_for_completion
                        self._finished[out.request_id] = out
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def chat(self, messages, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: Union[bool, Callable[..., tqdm]] = True, lora_request: Any = None,
             chat_template: Optional[str] = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: Optional[dict] = None, tools: Optional[list] = None,
             mm_processor_kwargs: Optional[dict[str, Any]] = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a
        list of conversations, through the model's chat template (or ``chat_template``).

        Rendered by the same Renderer as the OpenAI server's chat handler and /tokenize,
        so the same messages give the same prompt token ids. Raises ValueError
        (SamplingParamsError) for unsupported content parts or roles, a template error,
        or both add_generation_prompt and continue_final_message. vLLM's keyword
        arguments: ``chat_template_content_format`` "auto" or "string" (text parts joined,
        as the server's flag), "openai" and ``mm_processor_kwargs`` raise NotImplementedError.
        """
        if chat_template_content_format not in ("auto", "string"):
            refuse_unhonoured("LLM.chat", chat_template_content_format=chat_template_content_format)
        refuse_unhonoured("LLM.chat", mm_processor_kwargs=mm_processor_kwargs)
        self._check_generate("chat")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        renderer = Renderer(self.get_tokenizer())
        prompts = [renderer.render_chat(
            c, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
            tools=tools).to_engine_prompt() for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, messages: list[dict], chat_template: Optional[str] = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            tools: Optional[list] = None, **kwargs: Any) -> list[int]:
        """Render messages with the chat template and tokenize (the shared Renderer);
        returns the prompt token ids. ``kwargs`` are extra template variables.

        Raises ValueError if both add_generation_prompt and continue_final_message are set.
        """
        return Renderer(self.get_tokenizer()).render_chat(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template_kwargs=kwargs, tools=tools).token_ids

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the engine's weights and KV cache (vLLM's ``LLM.sleep``; needs
        ``enable_sleep_mode=True``). Level 1 keeps the model files in the page cache for a
        fast wake; level 2 drops them too. The next ``generate`` wakes the engine, or call
        ``wake_up``. Raises ValueError: sleep mode off, level not 1 or 2, LoRA on."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Reload what ``sleep`` freed (vLLM's ``LLM.wake_up``; ``tags``: "weights",
        "kv_cache"; None: both). ValueError for an unknown tag."""
        self.llm_engine.wake_up(tags)

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __del__(self) -> None:
        eng = getattr(self, "llm_engine", None)
        if eng is not None:
            try:
                eng.shutdown()
            except Exception:
                pass
