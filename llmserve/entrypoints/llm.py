"""The offline API (vLLM's ``LLM``): batch generation and chat on one engine."""
from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from llmserve.engine.input_processor import PromptType
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine_args import EngineArgs, UsageContext
from llmserve.entrypoints.renderer import Renderer
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """An LLM for offline inference.

    ``LLM(model=..., **kwargs)`` takes every EngineArgs field (dtype, max_model_len,
    max_num_seqs, max_num_batched_tokens, kv_cache_memory, enable_prefix_caching, seed...).
    The EngineCore runs in a child process unless LLMSERVE_ENABLE_MULTIPROCESSING=0.

    Raises ValueError for an unknown model or bad arguments.
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        multiprocess = kwargs.pop("multiprocess_mode", None)
        known = {f for f in EngineArgs.__dataclass_fields__}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments: {sorted(unknown)}")
        self.engine_args = EngineArgs(**kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args, multiprocess_mode=multiprocess,
                                                     usage_context=UsageContext.LLM_CLASS)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def _params_for(self, params, n: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"sampling_params: got {len(params)} for {n} prompts; give one or one per prompt")
        return params

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, priority: Optional[list[int]] = None) -> list[RequestOutput]:
        """Generate completions for prompts, returned in input order.

        prompts: a string, a list of strings, a list of token ids ({"prompt_token_ids":
        [...]}) or a list of such dicts. sampling_params: one for all prompts, or one per
        prompt. Each request's output is FINAL_ONLY.

        Raises ValueError for bad prompts/params (nothing is left running then).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif prompts and isinstance(prompts, list) and all(isinstance(t, int) for t in prompts):
            prompts = [{"prompt_token_ids": prompts}]
        prompts = list(prompts)
        params = self._params_for(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm, priority)

    def _run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool,
             priority: Optional[list[int]]) -> list[RequestOutput]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                sp = sp.clone()
                sp.output_kind = RequestOutputKind.FINAL_ONLY
                rid = str(next(self._counter))
                engine.add_request(rid, p, sp, priority=priority[i] if priority else 0)
                ids.append(rid)
        except BaseException:
            engine.abort_request(ids)
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[Optional[RequestOutput]] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def chat(self, messages, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, chat_template: Optional[str] = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: Optional[dict] = None, tools: Optional[list] = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a
        list of conversations, through the model's chat template (or ``chat_template``).

        Rendered by the same Renderer as the OpenAI server's chat handler and /tokenize,
        so the same messages give the same prompt token ids. Raises ValueError
        (SamplingParamsError) for unsupported content parts or roles, a template error,
        or both add_generation_prompt and continue_final_message.
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        renderer = Renderer(self.get_tokenizer())
        prompts = [renderer.render_chat(
            c, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
            tools=tools).to_engine_prompt() for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

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

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __del__(self) -> None:
        eng = getattr(self, "llm_engine", None)
        if eng is not None:
            try:
                eng.shutdown()
            except Exception:
                pass
