"""AsyncLLM: the asyncio bridge between request handlers and the EngineCore process
(vLLM's v1 AsyncLLM, an EngineClient).

``generate()`` adds a request and yields RequestOutputs from its RequestOutputCollector;
its prompt may be an async generator of input chunks (streaming input, see
``streaming_input.py``).
A background output_handler task (started lazily on the first request, holding no
reference to the AsyncLLM) pulls EngineCoreOutputs, runs the OutputProcessor in chunks
with ``await asyncio.sleep(0)`` between them, pushes to collectors, and feeds the stat
loggers.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncGenerator, Callable, Iterable, Mapping, Optional, Union

from llmserve.config import EngineConfig
from llmserve.core.outputs import FinishReason
from llmserve.engine.core_client import EngineCoreClient
from llmserve.engine.exceptions import EngineDeadError, EngineGenerateError
from llmserve.engine.input_processor import InputProcessor, PromptType
from llmserve.engine.llm_engine import start_engine_and_frontend
from llmserve.engine.messages import EngineCoreOutput, EngineCoreRequest
from llmserve.engine.output_processor import OutputProcessor, RequestOutputCollector, register_incarnations
from llmserve.engine.parallel_sampling import ParentRequest
from llmserve.lora.request import check_lora_request
from llmserve.engine.request_timeline import current_request_labels, make_request_timelines
from llmserve.engine.protocol import EngineClient
from llmserve.engine.request_kwargs import refuse_unhonoured
from llmserve.engine.self_heal import CoreHolder, EngineHealer
from llmserve.engine.sleep_process import ProcessRest, can_end_process
from llmserve.engine.streaming_input import feed_later_chunks, is_streaming_prompt, split_chunk
from llmserve.engine.tenant_context import tenant_fields
from llmserve.engine_args import EngineArgs, UsageContext
from llmserve.metrics.stats import IterationStats
from llmserve.outputs import PoolingRequestOutput, RequestOutput
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams, SamplingParamsError
from llmserve import envs

logger = logging.getLogger(__name__)

OUTPUT_PROC_CHUNK_SIZE = int(envs.get("LLMSERVE_OUTPUT_PROC_CHUNK_SIZE", "128"))


class LoggingStatLogger:
    """Logs throughput and queue state every ``interval`` seconds (vLLM's LoggingStatLogger)."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self.last = time.monotonic()
        self.prompt_tokens = 0
        self.gen_tokens = 0
        self.sched = None

    def record(self, scheduler_stats, iteration_stats, *args, **kwargs) -> None:
        if iteration_stats is not None:
            self.prompt_tokens += iteration_stats.num_prompt_tokens
            self.gen_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self.sched = scheduler_stats
        now = time.monotonic()
        if now - self.last >= self.interval:
            dt = now - self.last
            s = self.sched
            if self.prompt_tokens or self.gen_tokens or (s and (s.num_running_reqs or s.num_waiting_reqs)):
                logger.info(
                    "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%",
                    self.prompt_tokens / dt, self.gen_tokens / dt, s.num_running_reqs if s else 0,
                    s.num_waiting_reqs if s else 0, 100 * (s.kv_cache_usage if s else 0))
            self.prompt_tokens = self.gen_tokens = 0
            self.last = now



class _EngineDeath:
    """Set once the engine is found dead (by the output handler, which holds this object
    and no reference to the AsyncLLM): ``event`` is set and ``error`` holds the error."""

    def __init__(self) -> None:
        self.event = asyncio.Event()  # binds to the running loop on first wait (Python >= 3.10)
        self.error: Optional[BaseException] = None

    def set(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.event.set()


def _record_stats(stat_loggers, scheduler_stats, iteration_stats, engine_idx: int = 0) -> None:
    """Hand one batch of stats to every stat logger; a failing logger is logged, not raised.
    ``engine_idx``: the data-parallel rank that sent them (passed only when not 0)."""
    for sl in stat_loggers:
        try:
            if engine_idx:
                sl.record(scheduler_stats, iteration_stats, engine_idx=engine_idx)
            else:
                sl.record(scheduler_stats, iteration_stats)
        except Exception:
            logger.exception("stat logger failed")

def _stopped_flag(llm: "AsyncLLM"):
    """A callable that says whether ``llm`` was shut down (or collected), holding only a
    weak reference to it."""
    import weakref

    ref = weakref.ref(llm)

    def stopped() -> bool:
        obj = ref()
        return obj is None or obj._stopped

    return stopped


class AsyncLLM(EngineClient):
    """Async engine client (vLLM's ``AsyncLLM``), an ``EngineClient``.

    Args: vllm_config (EngineConfig / VllmConfig); executor_class (default
    ``Executor.get_class(vllm_config)``); log_stats: collect IterationStats and have the
    engine report request events (queue time); stat_loggers; log_requests: log each
    request (with its trace headers); client_addresses / client_count / client_index:
    this is API server ``client_index`` of ``client_count`` over engines started
    elsewhere (``--api-server-count``, entrypoints/openai/multi_api_server.py). The client
    is chosen once from the topology (``make_async_mp_client``): ``DPAsyncMPClient``
    (external load balancing), ``DPLBAsyncMPClient`` (``data_parallel_size > 1``,
    engine/dp_client.py) or ``AsyncMPClient``.

    Raises, from ``generate``: ValueError for bad input (before the first output),
    EngineDeadError once the engine process is dead.
    """

    def __init__(self, vllm_config: EngineConfig, executor_class: Optional[type] = None, log_stats: bool = True,
                 usage_context: UsageContext = UsageContext.ENGINE_CONTEXT, mm_registry: Any = None,
                 use_cached_outputs: bool = False, log_requests: bool = False, start_engine_loop: bool = True,
                 stat_loggers: Optional[list] = None, client_addresses: Optional[dict[str, str]] = None,
                 client_count: int = 1, client_index: int = 0,
                 on_tokenizer: Optional[Callable[[Any], Any]] = None) -> None:
        from llmserve.executor import Executor

        if executor_class is None:
            executor_class = Executor.get_class(vllm_config)
        self.vllm_config = self.config = self.engine_config = vllm_config
        self.model_config = vllm_config.model_config
        self.log_requests = log_requests
        self.log_stats = log_stats
        self._death = _EngineDeath()
        self._stopped = False
        self.output_handler: Optional[asyncio.Task] = None
        self._stall_watcher: Optional[asyncio.Task] = None
        # The engine process loads the model while we load the tokenizer.
        # on_tokenizer: the caller's own start-up work on the tokenizer, in the same thread
        # (the server's prompt-length limit), while the engine still loads.
        engine_core, self.tokenizer = start_engine_and_frontend(
            vllm_config, lambda: EngineCoreClient.make_async_mp_client(
                vllm_config, executor_class, log_stats, client_addresses, client_count, client_index),
            on_tokenizer)
        # The model's generation-config sampling defaults, computed once into the model
        # config (vLLM's get_diff_sampling_param); the server applies them to unset fields.
        self.generation_config_defaults = self.model_config.get_diff_sampling_param()
        self.input_processor = InputProcessor(self.model_config, self.tokenizer, strict_max_tokens=True,
                                              cache_config=vllm_config.cache_config,
                                              scheduler_config=vllm_config.scheduler_config)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=log_stats)
        self.stat_loggers = list(stat_loggers or [])
        if log_stats:
            self.stat_loggers.append(LoggingStatLogger())
        # Per-request timelines (GET /v1/requests) and their OpenTelemetry spans.
        self.request_timelines = make_request_timelines(vllm_config, log_stats)
        if self.request_timelines is not None:
            self.output_processor.timelines = self.request_timelines
            self.stat_loggers.append(self.request_timelines)
        # A restart swaps the client inside the holder (see self_heal.py).
        self._core = CoreHolder(engine_core)
        restart = vllm_config.restart_config
        self.healer: Optional[EngineHealer] = EngineHealer(
            self._core, self.output_processor, restart, self.model_config.max_model_len,
            self.stat_loggers) if restart.enabled else None
        # Sleep level 2 ends the engine process; a request or wake_up starts a new one.
        self._rest = ProcessRest(self._core, self._stop_output_handler, self._run_output_handler)

    @property
    def engine_core(self):
        """The client of the current engine process (a new one after each restart)."""
        return self._core.client

    @classmethod
    def from_vllm_config(cls, vllm_config: EngineConfig, start_engine_loop: bool = True,
                         usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
                         stat_loggers: Optional[list] = None, enable_log_requests: bool = False,
                         disable_log_stats: bool = False, client_addresses: Optional[dict[str, str]] = None,
                         client_count: int = 1, client_index: int = 0,
                         on_tokenizer: Optional[Callable[[Any], Any]] = None, **kwargs: Any) -> "AsyncLLM":
        """AsyncLLM over a built config; the executor is ``Executor.get_class(vllm_config)``.
        ``log_requests``/``log_stats`` are accepted as aliases of the enable/disable flags;
        ``on_tokenizer``: see ``llm_engine.start_engine_and_frontend``."""
        from llmserve.executor import Executor

        log_requests = kwargs.pop("log_requests", enable_log_requests)
        log_stats = kwargs.pop("log_stats", not disable_log_stats)
        if kwargs:
            raise TypeError(f"AsyncLLM.from_vllm_config() got unexpected keyword arguments: {sorted(kwargs)}")
        return cls(vllm_config, executor_class=Executor.get_class(vllm_config), log_stats=log_stats,
                   usage_context=usage_context, log_requests=log_requests, start_engine_loop=start_engine_loop,
                   stat_loggers=stat_loggers, client_addresses=client_addresses, client_count=client_count,
                   client_index=client_index, on_tokenizer=on_tokenizer)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True,
                         usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
                         stat_loggers: Optional[list] = None) -> "AsyncLLM":
        """create_engine_config() -> Executor.get_class(config) -> AsyncLLM."""
        config = engine_args.create_engine_config(usage_context)
        return cls.from_vllm_config(config, start_engine_loop, usage_context, stat_loggers,
                                    enable_log_requests=not getattr(engine_args, "disable_log_requests", True),
                                    disable_log_stats=engine_args.disable_log_stats)

    @classmethod
    def from_engine_config(cls, config: EngineConfig, **kwargs: Any) -> "AsyncLLM":
        """Older name of ``from_vllm_config`` (takes log_requests / log_stats / stat_loggers)."""
        return cls.from_vllm_config(config, **kwargs)

    # ---- state ---------------------------------------------------------------
    @property
    def errored(self) -> bool:
        """True once the engine process died (or the output handler failed for good); with
        ``--restart-engine-on-failure`` only once the restarts are given up."""
        if self.healer is not None:
            return self._death.error is not None
        return self.engine_core.engine_dead or self._death.error is not None

    @property
    def is_running(self) -> bool:
        return not self.errored and not self._stopped

    @property
    def is_stopped(self) -> bool:
        return self._stopped or self.errored

    @property
    def dead_error(self) -> BaseException:
        """The EngineDeadError handed to callers once ``errored``."""
        if (not self.engine_core.engine_dead or self.healer is not None) and self._death.error is not None:
            return EngineDeadError(str(self._death.error))
        return EngineDeadError(f"EngineCore died: {self.engine_core.dead_error}")

    async def wait_for_engine_death(self) -> BaseException:
        """Return the EngineDeadError once the engine is dead (the process died, or the
        output handler failed for good).

        Starts the output handler if no request has yet, so a death is noticed even while
        the server is idle; it returns after the output handler has handed the error to
        every in-flight request. Never returns after ``shutdown()`` (cancel the waiter).
        The API server uses it to shut itself down (vLLM's behaviour)."""
        self._run_output_handler()
        await self._death.event.wait()
        return self.dead_error

    async def get_tokenizer(self):
        return self.tokenizer

    @property
    def start_error(self) -> Optional[BaseException]:
        """The EngineStartError of the last failed start after a level-2 sleep, while the
        engine stays ended (the next request or wake_up tries again); else None."""
        return self._rest.start_error

    async def check_health(self) -> None:
        """Raises EngineDeadError when the engine is dead, EngineStartError while an engine
        ended by a level-2 sleep cannot be started again (vLLM's /health: is the engine
        alive; a sleeping engine that can still start is)."""
        if self.errored:
            raise self.dead_error
        if self._rest.start_error is not None:
            raise self._rest.start_error

    # ---- requests ------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Union[PromptType, EngineCoreRequest],
                          params: Optional[SamplingParams] = None, arrival_time: Optional[float] = None,
                          priority: int = 0, trace_headers: Optional[Mapping[str, str]] = None,
                          resumable: bool = False, reasoning_ended: Optional[bool] = None,
                          data_parallel_rank: Optional[int] = None, *, tenant: Any = None,
                          lora_request: Any = None, tokenization_kwargs: Optional[dict[str, Any]] = None,
                          prompt_text: Optional[str] = None) -> RequestOutputCollector:
        """Add a request; returns its collector at once. ``prompt`` may be a prepared
        ``EngineCoreRequest`` (its own request id wins over ``request_id``, with a
        warning). ``data_parallel_rank`` pins the request to that DP engine (vLLM).
        ``tenant`` (llmserve extension): the caller's tenant (a name, or an object with
        ``.name``/``.weight``) for the engine's fair share; None: the current one of
        engine/tenant_context.py (set by the server per HTTP request), else the default.
        vLLM's keyword arguments only (another is a TypeError); ``tokenization_kwargs`` and
        ``prompt_text`` raise NotImplementedError when given (``request_kwargs.py``).
        Raises ValueError / EngineDeadError."""
        refuse_unhonoured("AsyncLLM.add_request", tokenization_kwargs=tokenization_kwargs, prompt_text=prompt_text)
        if self.errored:
            raise self.dead_error
        await self._rest.start()  # after a level-2 sleep: a fresh engine (sleep_process.py)
        lora = check_lora_request(lora_request, self.vllm_config.lora_config)  # the adapter (llmserve/lora)
        if data_parallel_rank is not None:
            dp = self.vllm_config.parallel_config.data_parallel_size
            if not isinstance(data_parallel_rank, int) or not 0 <= data_parallel_rank < dp:
                raise ValueError(f"data_parallel_rank={data_parallel_rank!r} is out of range [0, {dp})")
        self._run_output_handler()
        labels = current_request_labels.get()  # set per HTTP request by the server (request_timeline.py)
        if arrival_time is None and labels is not None:
            arrival_time = labels.arrival_time
        if isinstance(prompt, EngineCoreRequest):
            reqs, parent, params = self._prepared_request(request_id, prompt, params)
            request_id = prompt.request_id
        elif isinstance(params, PoolingParams):
            reqs, parent = [self.input_processor.process_pooling_inputs(
                request_id, prompt, params, arrival_time or time.time(), priority)], None
        else:
            arrival_time = arrival_time or time.time()
            reqs, parent = self._process_inputs(request_id, prompt, params, arrival_time, priority)
        collector = RequestOutputCollector(params.output_kind)
        if not trace_headers and labels is not None:  # the HTTP request's traceparent
            trace_headers = labels.trace_headers
        headers = dict(trace_headers) if trace_headers else None
        reqs = register_incarnations(self.output_processor, reqs, parent, collector, lora)
        tenant_name, tenant_weight = tenant_fields(tenant)
        for req in reqs:
            if lora is not None:
                req.lora_request = lora
            req.resumable = resumable or req.resumable
            if tenant_name is not None:
                req.tenant, req.tenant_weight = tenant_name, tenant_weight
            if headers is not None:
                req.trace_headers = headers
            if reasoning_ended is not None:
                req.reasoning_ended = reasoning_ended
            if data_parallel_rank is not None:
                req.data_parallel_rank = data_parallel_rank
        await self._send_requests(reqs)
        if self.log_requests:
            logger.info("Added request %s: %d prompt tokens, params=%s, trace_headers=%s, tenant=%s", request_id,
                        len(reqs[0].prompt_token_ids), params, headers, tenant_name or "default")
        return collector

    async def _send_requests(self, reqs: list[EngineCoreRequest]) -> None:
        """Send registered requests to the engine. While a restart is under way they stay
        registered only, and the restart sends them to the new engine with the resumed
        ones; if the engine dies under the send, the restart resubmits them too."""
        healer = self.healer
        if healer is not None and healer.restarting:
            return
        try:
            for req in reqs:
                await self.engine_core.add_request_async(req)
        except EngineDeadError:
            if healer is None:
                raise

    async def restart_engine(self) -> None:
        """Kill the engine process now (e.g. a liveness check found it stalled). With
        ``--restart-engine-on-failure`` it is restarted and the requests in flight resume;
        without, this is the engine's death (``wait_for_engine_death`` returns)."""
        self._run_output_handler()
        self.engine_core.kill_engine()

    @property
    def num_engine_restarts(self) -> int:
        """Engine restarts so far (0 without ``--restart-engine-on-failure``)."""
        return self.healer.num_restarts if self.healer is not None else 0

    def _process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                        arrival_time: float, priority: int) -> tuple[list, Optional[ParentRequest]]:
        if params is None:
            raise ValueError("add_request: sampling params are required with a prompt")
        if params.n == 1:
            return [self.input_processor.process_inputs(request_id, prompt, params, arrival_time, priority)], None
        parent = ParentRequest(request_id, params)
        return [self.input_processor.process_inputs(cid, prompt, parent.child_params(i), arrival_time, priority)
                for i, cid in enumerate(parent.child_ids)], parent

    @staticmethod
    def _prepared_request(request_id: str, request: EngineCoreRequest,
                          params: Optional[SamplingParams]) -> tuple[list, None, SamplingParams]:
        """An EngineCoreRequest built by the caller (vLLM: its request id wins)."""
        if request_id != request.request_id:
            logger.warning("AsyncLLM.add_request() was passed a request_id (%r) that does not match the "
                           "EngineCoreRequest's (%r); the latter is used.", request_id, request.request_id)
        if request.pooling_params is not None:
            return [(request, None)], None, request.pooling_params
        if request.sampling_params.n != 1:
            raise SamplingParamsError("n > 1 needs a prompt, not a prepared EngineCoreRequest", "n")
        return [(request, None)], None, request.sampling_params

    async def beam_search(self, prompt: Any, request_id: str, params: Any, lora_request: Any = None,
                          sampling_params: Optional[SamplingParams] = None, priority: int = 0, *,
                          trace_headers: Optional[Mapping[str, str]] = None, tenant: Any = None,
                          ) -> AsyncGenerator[RequestOutput, None]:
        """Beam search in the engine (vLLM's ``EngineClient.beam_search``): yields one
        final RequestOutput holding ``params.beam_width`` CompletionOutputs, best first.
        params: a ``BeamSearchParams``; sampling_params: the request's (its detokenize,
        skip_special_tokens, logprobs, max_tokens; default: greedy with params.max_tokens).
        Raises SamplingParamsError for what the search cannot honour
        (``input_processor.check_beam_search``)."""
        sp = sampling_params or SamplingParams(max_tokens=params.max_tokens, temperature=0.0,
                                               ignore_eos=params.ignore_eos, logprobs=0)
        req, _ = self.input_processor.process_inputs(request_id, prompt, sp, priority=priority,
                                                     beam_search_params=params)
        async for out in self.generate(req, req.sampling_params, request_id, priority, lora_request=lora_request,
                                       trace_headers=trace_headers, tenant=tenant):
            yield out

    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str, priority: int = 0, *,
                       trace_headers: Optional[Mapping[str, str]] = None, reasoning_ended: Optional[bool] = None,
                       reasoning_parser_kwargs: Optional[dict[str, Any]] = None,
                       data_parallel_rank: Optional[int] = None, tenant: Any = None,
                       lora_request: Any = None, prompt_text: Optional[str] = None,
                       tokenization_kwargs: Optional[dict[str, Any]] = None,
                       session_id: Optional[str] = None) -> AsyncGenerator[RequestOutput, None]:
        """Yield RequestOutputs of one request (output kind per sampling_params).

        ``prompt``: text, token ids, a prompt dict, an ``EngineCoreRequest``, or an async
        generator of input chunks (streaming input: ``StreamingInput``, text or ids; the
        request starts on the first chunk and each later chunk extends its context).
        trace_headers: W3C ``traceparent``/``tracestate``, logged with the request and
        kept on it. reasoning_ended goes to the engine on the request (a structured-output
        request's grammar applies at once when True; see StructuredOutputManager);
        reasoning_parser_kwargs is accepted for vLLM compatibility; with streaming input they raise
        NotImplementedError, as in vLLM. ``data_parallel_rank`` pins the request to one DP
        engine. ``tenant`` (llmserve extension, see ``add_request``): whose share of the
        engine it uses. ``lora_request``: the adapter it runs with (llmserve/lora). vLLM's
        keyword arguments only: another is a TypeError; ``prompt_text``,
        ``tokenization_kwargs`` and ``session_id`` raise NotImplementedError when given, as
        does a ``lora_request`` with streaming input. Closing or cancelling the generator
        aborts the request in the engine.
        """
        refuse_unhonoured("AsyncLLM.generate", prompt_text=prompt_text, tokenization_kwargs=tokenization_kwargs,
                          session_id=session_id)
        streaming = is_streaming_prompt(prompt)
        if streaming and lora_request is not None:
            raise NotImplementedError("lora_request is not supported with streaming input")
        if streaming and (reasoning_ended is not None or reasoning_parser_kwargs is not None):
            raise NotImplementedError("reasoning_ended and reasoning_parser_kwargs are not supported "
                                      "with streaming input")
        collector = feeder = None
        try:
            if streaming:
                collector, feeder = await self._add_streaming_request(request_id, prompt, sampling_params,
                                                                      priority, trace_headers)
            else:
                collector = await self.add_request(request_id, prompt, sampling_params, priority=priority,
                                                   trace_headers=trace_headers, reasoning_ended=reasoning_ended,
                                                   data_parallel_rank=data_parallel_rank, tenant=tenant,
                                                   lora_request=lora_request)
                if isinstance(prompt, EngineCoreRequest):
                    request_id = prompt.request_id
            finished = False
            while not finished:
                out = collector.get_nowait() or await collector.get()
                finished = out.finished
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            # A caller that went away while add_request was still sending (its only await,
            # after the request was registered) has no collector yet, but its request may
            # already be queued in the engine: abort it too, so it is never prefilled.
            if collector is not None or not streaming:
                await self.abort(request_id, internal=True)
            raise
        except EngineDeadError:
            raise
        except ValueError:
            if collector is not None:
                await self.abort(request_id, internal=True)
            raise
        except Exception as e:
            await self.abort(request_id, internal=True)
            raise EngineGenerateError(str(e)) from e
        finally:
            if feeder is not None and not feeder.done():
                feeder.cancel()

    async def encode(self, prompt: Any, pooling_params: PoolingParams, request_id: str,
                     lora_request: Any = None, trace_headers: Optional[Mapping[str, str]] = None,
                     priority: int = 0, truncate_prompt_tokens: Optional[int] = None,
                     tokenization_kwargs: Optional[dict[str, Any]] = None, *,
                     tenant: Any = None) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Pool one prompt (vLLM's ``AsyncLLM.encode`` and its keyword arguments; another
        is a TypeError): yields its one PoolingRequestOutput. ``truncate_prompt_tokens``
        sets the params' own when given; ``tokenization_kwargs`` raises
        NotImplementedError. Raises ValueError (SamplingParamsError) for bad input or a
        model that does not pool; cancelling aborts the request in the engine."""
        refuse_unhonoured("AsyncLLM.encode", tokenization_kwargs=tokenization_kwargs)
        if is_streaming_prompt(prompt):
            raise ValueError("encode() does not take streaming input")
        if truncate_prompt_tokens is not None:
            pooling_params = pooling_params.clone()
            pooling_params.truncate_prompt_tokens = truncate_prompt_tokens
        async for out in self.generate(prompt, pooling_params, request_id, priority, trace_headers=trace_headers,
                                       tenant=tenant, lora_request=lora_request):
            yield out

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """("generate",) or the pooling tasks ("encode", "embed") (vLLM's)."""
        return self.model_config.supported_tasks

    async def _add_streaming_request(self, request_id: str, chunks: Any, sampling_params: SamplingParams,
                                     priority: int, trace_headers: Optional[Mapping[str, str]]):
        """Start a resumable request on the first chunk; a task feeds the later ones."""
        it = chunks.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise SamplingParamsError("streaming input: the prompt generator yielded no chunk", "prompt") from None
        first_prompt, first_params = split_chunk(first)
        params = first_params or sampling_params
        if params.n != 1:
            raise SamplingParamsError("streaming input supports n=1 only", "n")
        collector = await self.add_request(request_id, first_prompt, params, priority=priority,
                                           trace_headers=trace_headers, resumable=True)
        engine_id = self.output_processor.engine_ids([request_id])[0]
        feeder = asyncio.get_running_loop().create_task(feed_later_chunks(
            it, engine_id, params, self.engine_core, self.input_processor, collector.put))
        return collector, feeder

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Abort requests (a parent's id aborts all its n>1 children).

        Each aborted request's ``generate()`` gets a final output with finish_reason
        "abort" and the tokens so far, then ends (vLLM PR 22283; a beam search's comes from
        the engine, its best beams so far, within BEAM_ABORT_GRACE_S); ``internal``: the caller
        went away (its generator closed), so no output is made. Outputs of the aborted
        request still on their way are dropped, so a new request may reuse the id at once.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        engine_ids: list[str] = []
        beams: list[str] = []
        for rid in ids:  # one at a time: each one's stats go under its own DP rank
            stats = IterationStats() if self.output_processor.log_stats else None
            beam = None if internal or self.errored else self._beam_search_engine_id(rid)
            if beam is not None:  # its final output (the beams so far) comes from the engine
                beams.append(beam)
                engine_ids.append(beam)
                continue
            if internal:
                mine = self.output_processor.abort_requests([rid], stats)
            else:
                mine = self.output_processor.finish_aborted([rid], stats).reqs_to_abort
            engine_ids += mine
            if stats is not None and stats.finished_requests:
                _record_stats(self.stat_loggers, None, stats, self._engine_index_of(mine))
        if engine_ids and not self.errored:
            try:
                await self.engine_core.abort_requests_async(engine_ids)
            except EngineDeadError:
                pass
        if beams:
            asyncio.get_running_loop().call_later(self.BEAM_ABORT_GRACE_S, self._end_beam_aborts, beams)
        if self.log_requests and not internal:
            logger.info("Aborted request(s) %s", ids)

    # An aborted beam search whose final output has not come from the engine by then
    # (its abort crossed the add on the way, or the engine was lost) ends with no beams.
    BEAM_ABORT_GRACE_S = 5.0

    def _beam_search_engine_id(self, request_id: str) -> Optional[str]:
        """The engine id of the beam-search request ``request_id`` still in flight, or
        None (not a beam search, or unknown). Its abort is answered by the engine with
        the best beams so far (``BeamSearchManager.abort``), not ended here with none."""
        op = self.output_processor
        for iid in op.engine_ids([request_id]):
            st = op.states.get(iid)
            if st is not None and st.engine_request is not None and st.engine_request.beam_search_params:
                return iid
        return None

    def _end_beam_aborts(self, engine_ids: list[str]) -> None:
        left = [i for i in engine_ids if i in self.output_processor.states]
        if left:
            self.output_processor.finish_aborted([self.output_processor.states[i].external_req_id for i in left])

    def _engine_index_of(self, engine_request_ids: list[str]) -> int:
        """The DP rank holding the first of ``engine_request_ids`` (0: one engine, or not
        known), for metrics labelled by engine."""
        find = getattr(self.engine_core, "engine_index_of", None)
        if find is None or not engine_request_ids:
            return 0
        return find(engine_request_ids[0]) or 0

    async def abort_all(self) -> int:
        """Finish every in-flight request now with finish_reason "abort": each waiting
        ``generate`` receives a final output (so a stream ends with its last chunk rather
        than being cut) and the engine drops the requests. Used by the server when its
        graceful-shutdown period runs out. Returns the number of requests aborted."""
        ids = list(self.output_processor.states)
        if not ids:
            return 0
        for rid in ids:  # one at a time: each one's stats go under its own DP rank
            stats = IterationStats() if self.output_processor.log_stats else None
            out = EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=FinishReason.ABORT)
            self.output_processor.process_outputs([out], None, stats)
            if stats is not None:
                _record_stats(self.stat_loggers, None, stats, self._engine_index_of([rid]))
        if not self.errored:
            try:
                await self.engine_core.abort_requests_async(ids)
            except EngineDeadError:
                pass
        logger.info("Aborted %d in-flight request(s)", len(ids))
        return len(ids)

    # ---- utilities -----------------------------------------------------------
    async def reset_prefix_cache(self) -> bool:
        if self._rest.at_rest:  # an ended engine has no prefix cache
            return True
        return await self.engine_core.call_utility_async("reset_prefix_cache")

    # ---- sleep mode (vLLM's AsyncLLM.sleep / wake_up / is_sleeping) -------------
    async def _sleep_utility(self, method: str, *args: Any) -> Any:
        from llmserve.worker.sleep_mode import reraise_value_error

        try:
            return await self.engine_core.call_utility_async(method, *args)
        except RuntimeError as e:
            reraise_value_error(e)
            raise

    async def sleep(self, level: int = 1) -> None:
        """Free the engine's weights and KV cache (EngineCore.sleep). Level 2 then ends the
        engine process when this client owns it (llmserve/engine/sleep_process.py).
        ValueError: sleep mode off, level not 1 or 2, or requests in flight."""
        from llmserve.worker.sleep_mode import check_level

        if self._rest.at_rest:  # already ended: deeper than any level
            check_level(level)
            return
        await self._sleep_utility("sleep", level)
        if level == 2 and can_end_process(self.engine_core):
            stats = await self.engine_core.call_utility_async("get_stats")
            await self._rest.end(stats, busy=lambda: bool(self.output_processor.states))

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Reload them (``tags``: "weights", "kv_cache"; None: both). An engine ended by a
        level-2 sleep starts again whole, whatever ``tags`` says."""
        if await self._rest.start():
            return
        await self._sleep_utility("wake_up", tags)

    async def is_sleeping(self) -> bool:
        if self._rest.at_rest:
            return True
        return bool(await self._sleep_utility("is_sleeping"))

    # ---- LoRA adapters (vLLM's AsyncLLM utilities; llmserve/lora) --------------
    async def _lora_utility(self, method: str, *args: Any) -> Any:
        from llmserve.lora.errors import reraise_lora_error

        try:
            return await self.engine_core.call_utility_async(method, *args)
        except RuntimeError as e:
            reraise_lora_error(e)  # LoRAAdapterError / LoRANotFoundError naming the field
            raise

    async def add_lora(self, lora_request: Any) -> bool:
        """Load an adapter (read off the engine's step loop); False when it was loaded
        already. Raises LoRAAdapterError naming the field at fault."""
        check_lora_request(lora_request, self.vllm_config.lora_config)
        return await self._lora_utility("add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter once its requests finish; False when it is not loaded."""
        return await self._lora_utility("remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        from llmserve.lora.errors import lora_ids

        return lora_ids(await self._lora_utility("list_loras"))

    async def pin_lora(self, lora_id: int) -> bool:
        return await self._lora_utility("pin_lora", lora_id)

    async def get_engine_stats(self) -> dict:
        """Engine-side counters: num_running_reqs, num_waiting_reqs, num_used_blocks...
        (an engine ended by a level-2 sleep: its last figures, with nothing in use)."""
        if self._rest.at_rest:
            return dict(self.engine_core.stats)
        return await self.engine_core.call_utility_async("get_stats")

    # ---- output handler -------------------------------------------------------
    def _run_output_handler(self) -> None:
        if self.output_handler is not None:
            return
        core = self._core
        healer = self.healer
        output_processor = self.output_processor
        stat_loggers = self.stat_loggers
        log_stats = self.output_processor.log_stats
        death = self._death

        async def output_handler() -> None:
            try:
                while True:
                    try:
                        outs = await core.client.get_output_async()
                    except EngineDeadError as e:
                        if healer is not None and not self_stopped() and await healer.heal(e):
                            continue
                        raise
                    if healer is not None:
                        healer.last_output = time.monotonic()
                    if outs.rejected:
                        output_processor.reject_requests(outs.rejected)
                    items = outs.outputs
                    # Built only when stats are on and the step has outputs.
                    iteration_stats = IterationStats() if log_stats and items else None
                    for start in range(0, max(len(items), 1), OUTPUT_PROC_CHUNK_SIZE):
                        chunk = items[start:start + OUTPUT_PROC_CHUNK_SIZE]
                        processed = output_processor.process_outputs(chunk, outs.timestamp, iteration_stats)
                        if processed.reqs_to_abort:
                            await core.client.abort_requests_async(processed.reqs_to_abort)
                        if start + OUTPUT_PROC_CHUNK_SIZE < len(items):
                            await asyncio.sleep(0)
                    _record_stats(stat_loggers, outs.scheduler_stats, iteration_stats, outs.engine_index)
            except asyncio.CancelledError:
                raise
            except EngineDeadError as e:
                logger.error("Engine is dead: %s", e)
                output_processor.propagate_error(e)
                death.set(e)
            except Exception as e:
                logger.exception("AsyncLLM output_handler failed")
                err = EngineDeadError(f"output handler failed: {e}")
                output_processor.propagate_error(err)
                death.set(err)

        # Weakly bound, so the handler holds no reference to the AsyncLLM.
        self_stopped = _stopped_flag(self)
        loop = asyncio.get_running_loop()
        self.output_handler = loop.create_task(output_handler())
        if healer is not None and healer.config.stall_timeout > 0:
            self._stall_watcher = loop.create_task(healer.watch_stalls())

    async def _stop_output_handler(self) -> None:
        """Cancel the output handler (and the stall watcher) and wait for them to end (a
        level-2 sleep ends the engine they watch); ``_run_output_handler`` starts new ones."""
        tasks = [t for t in (self.output_handler, self._stall_watcher) if t is not None and not t.done()]
        self.output_handler = self._stall_watcher = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Cancel the output handler, stop the engine process (SHUTDOWN, then SIGTERM /
        SIGKILL) and remove the sockets, all within ``timeout`` seconds (None: the
        engine gets up to 5 s to exit cleanly)."""
        self._stopped = True
        for task in (self.output_handler, self._stall_watcher):
            if task is not None and not task.done():
                try:
                    task.cancel()
                except RuntimeError:
                    pass
        self.engine_core.shutdown(timeout)

    def __del__(self) -> None:
        core = getattr(self, "engine_core", None)
        if core is not None:
            try:
                core.shutdown()
            except Exception:
                pass
