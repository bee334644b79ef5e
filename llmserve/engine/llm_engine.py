"""LLMEngine: the synchronous engine front-end used by ``LLM`` (vLLM's v1 LLMEngine, a
thin legacy shell): InputProcessor -> EngineCoreClient (``make_client``: in-process or a
child process) -> OutputProcessor.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping, Optional, Union

from llmserve.beam_search import BeamSearchParams
from llmserve.config import EngineConfig
from llmserve.engine.tenant_context import tenant_fields
from llmserve.engine.core_client import EngineCoreClient
from llmserve.engine.input_processor import InputProcessor, PromptType
from llmserve.lora.request import check_lora_request
from llmserve.engine.output_processor import OutputProcessor, register_incarnations
from llmserve.engine.parallel_sampling import ParentRequest
from llmserve.engine.request_kwargs import refuse_unhonoured
from llmserve.engine_args import EngineArgs, UsageContext
from llmserve.outputs import RequestOutput
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams
from llmserve import envs

logger = logging.getLogger(__name__)


def multiprocessing_enabled() -> bool:
    """``LLMSERVE_ENABLE_MULTIPROCESSING`` (default 1): run the EngineCore in a child process."""
    return envs.get("LLMSERVE_ENABLE_MULTIPROCESSING", "1") not in ("0", "false", "False")


def load_frontend(config: EngineConfig):
    """The model's tokenizer (the generation-config defaults are already in
    ``config.model_config``, read once by ``create_engine_config()``)."""
    from llmserve.tokenizer import get_model_tokenizer

    return get_model_tokenizer(config.model_config)


def start_engine_and_frontend(config: EngineConfig, make_client: Callable[[], Any],
                              on_tokenizer: Optional[Callable[[Any], Any]] = None) -> tuple[Any, Any]:
    """Start the engine client (``make_client()``, which loads the model, in a child
    process or here) while the tokenizer loads in a thread, so the two overlap.
    ``on_tokenizer(tokenizer)``: more of the caller's start-up work on the tokenizer, run
    in that thread too (best effort: an error is logged and left for the caller's own
    call to raise). Returns (client, tokenizer); on failure of either, the client is shut
    down and the error raised."""

    def frontend_work() -> Any:
        tokenizer = load_frontend(config)
        if on_tokenizer is not None:
            try:
                on_tokenizer(tokenizer)
            except Exception as e:  # noqa: BLE001 - a warm-up; the caller meets the error itself
                logger.debug("tokenizer warm-up failed: %s", e)
        return tokenizer

    with ThreadPoolExecutor(1, thread_name_prefix="llmserve-frontend") as pool:
        frontend = pool.submit(frontend_work)
        client = make_client()
        try:
            tokenizer = frontend.result()
        except BaseException:
            client.shutdown()
            raise
    return client, tokenizer


class LLMEngine:
    """Synchronous engine (vLLM's ``LLMEngine``). Raises ValueError from add_request on
    bad input.

    Args: vllm_config (EngineConfig / VllmConfig); executor_class (default
    ``Executor.get_class(vllm_config)``); log_stats; multiprocess_mode (default
    ``LLMSERVE_ENABLE_MULTIPROCESSING``, on): the EngineCore in a child process
    (SyncMPClient) or in this one (InprocClient), via ``EngineCoreClient.make_client``.
    """

    def __init__(self, vllm_config: EngineConfig, executor_class: Optional[type] = None, log_stats: bool = False,
                 usage_context: UsageContext = UsageContext.ENGINE_CONTEXT, stat_loggers: Optional[list] = None,
                 multiprocess_mode: Optional[bool] = None) -> None:
        from llmserve.executor import Executor

        if isinstance(executor_class, bool):  # the old signature: LLMEngine(config, multiprocess_mode)
            executor_class, multiprocess_mode = None, executor_class
        self.vllm_config = self.config = vllm_config
        self.model_config = vllm_config.model_config
        self.log_stats = log_stats
        if executor_class is None:
            executor_class = Executor.get_class(vllm_config)
        if multiprocess_mode is None:
            multiprocess_mode = multiprocessing_enabled()
        if vllm_config.restart_config.enabled:
            logger.warning("restart_engine_on_failure is honoured by AsyncLLM (the server) only; the "
                           "offline engine still raises EngineDeadError when its engine process dies")
        self.engine_core, self.tokenizer = start_engine_and_frontend(
            vllm_config, lambda: EngineCoreClient.make_client(multiprocess_mode, False, vllm_config,
                                                              executor_class, log_stats))
        self.input_processor = InputProcessor(self.model_config, self.tokenizer,
                                              cache_config=vllm_config.cache_config,
                                              scheduler_config=vllm_config.scheduler_config)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=False)
        self._aborted_outputs: list[RequestOutput] = []  # from abort_request, for the next step()

    @classmethod
    def from_vllm_config(cls, vllm_config: EngineConfig, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
                         stat_loggers: Optional[list] = None, disable_log_stats: bool = False,
                         multiprocess_mode: Optional[bool] = None) -> "LLMEngine":
        from llmserve.executor import Executor

        return cls(vllm_config, executor_class=Executor.get_class(vllm_config), log_stats=not disable_log_stats,
                   usage_context=usage_context, stat_loggers=stat_loggers, multiprocess_mode=multiprocess_mode)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
                         stat_loggers: Optional[list] = None,
                         multiprocess_mode: Optional[bool] = None) -> "LLMEngine":
        """create_engine_config() -> Executor.get_class(config) -> LLMEngine."""
        from llmserve.executor import Executor

        if isinstance(usage_context, bool) or usage_context is None:  # old positional multiprocess_mode
            usage_context, multiprocess_mode = UsageContext.ENGINE_CONTEXT, usage_context
        config = engine_args.create_engine_config(usage_context)
        return cls(config, executor_class=Executor.get_class(config),
                   log_stats=not getattr(engine_args, "disable_log_stats", True), usage_context=usage_context,
                   stat_loggers=stat_loggers, multiprocess_mode=multiprocess_mode)

    def get_tokenizer(self):
        return self.tokenizer

    def get_supported_tasks(self) -> tuple[str, ...]:
        """("generate",) or the pooling tasks ("encode", "embed"), by the model's runner."""
        return self.model_config.supported_tasks

    def add_request(self, request_id: str, prompt: PromptType, params: Union[SamplingParams, PoolingParams],
                    arrival_time: Optional[float] = None, priority: int = 0,
                    beam_search_params: Optional[BeamSearchParams] = None, lora_request: Any = None, *,
                    tokenization_kwargs: Optional[dict[str, Any]] = None,
                    trace_headers: Optional[Mapping[str, str]] = None, prompt_text: Optional[str] = None) -> None:
        """Queue a request: SamplingParams generate (n > 1: its children), PoolingParams
        pool (its one output is a PoolingRequestOutput); with ``beam_search_params`` a
        beam search in the engine (its one output holds every beam). vLLM's keyword
        arguments (``trace_headers`` kept on the request; ``tokenization_kwargs`` and
        ``prompt_text`` raise NotImplementedError when given). Raises ValueError for bad
        input, a live id or a task the model lacks."""
        refuse_unhonoured("LLMEngine.add_request", tokenization_kwargs=tokenization_kwargs, prompt_text=prompt_text)
        lora = check_lora_request(lora_request, self.vllm_config.lora_config)  # the adapter (llmserve/lora)
        arrival_time = arrival_time or time.time()
        parent = None
        if isinstance(params, PoolingParams):
            reqs = [self.input_processor.process_pooling_inputs(request_id, prompt, params, arrival_time, priority)]
        elif params.n == 1 or beam_search_params is not None:
            reqs = [self.input_processor.process_inputs(request_id, prompt, params, arrival_time, priority,
                                                        beam_search_params=beam_search_params)]
        else:
            parent = ParentRequest(request_id, params)
            reqs = [self.input_processor.process_inputs(cid, prompt, parent.child_params(i), arrival_time,
                                                        priority) for i, cid in enumerate(parent.child_ids)]
        tenant, weight = tenant_fields()  # the current tenant (engine/tenant_context.py), if any
        for req in register_incarnations(self.output_processor, reqs, parent, lora_request=lora):
            req.lora_request = lora
            if tenant is not None:
                req.tenant, req.tenant_weight = tenant, weight
            if trace_headers:
                req.trace_headers = dict(trace_headers)
            self.engine_core.add_request(req)

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        """Abort requests (a parent's id aborts its n > 1 children): the next ``step()``
        returns each one's final output with finish_reason "abort" and the tokens so far;
        no later output of the aborted requests reaches a new request with the same id."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        processed = self.output_processor.finish_aborted(ids)
        self._aborted_outputs.extend(processed.request_outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the outputs ready (final ones only for FINAL_ONLY)."""
        if self._aborted_outputs:
            # Hand over abort outputs first; the engine may have nothing left to run.
            aborted, self._aborted_outputs = self._aborted_outputs, []
            return aborted
        outs = self.engine_core.get_output()
        if outs.rejected:
            self.output_processor.reject_requests(outs.rejected)
        processed = self.output_processor.process_outputs(outs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._aborted_outputs) or self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    # ---- sleep mode (vLLM's LLMEngine.sleep / wake_up / is_sleeping) ------------
    def _sleep_utility(self, method: str, *args: Any) -> Any:
        from llmserve.worker.sleep_mode import reraise_value_error

        try:
            return self.engine_core.call_utility(method, *args)
        except RuntimeError as e:
            reraise_value_error(e)
            raise

    def sleep(self, level: int = 1) -> None:
        self._sleep_utility("sleep", level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        self._sleep_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return bool(self._sleep_utility("is_sleeping"))

    # ---- LoRA adapters (vLLM's LLMEngine utilities; llmserve/lora) --------------
    def add_lora(self, lora_request: Any) -> bool:
        """Load an adapter; False when already loaded. Raises LoRAAdapterError."""
        return self.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.engine_core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.engine_core.list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        return self.engine_core.pin_lora(lora_id)

    def get_stats(self) -> dict:
        return self.engine_core.get_stats()

    def shutdown(self, timeout: Optional[float] = None) -> None:
        self.engine_core.shutdown(timeout)
