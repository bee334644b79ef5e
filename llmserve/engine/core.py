"""EngineCore (schedule -> forward -> sample -> update) and EngineCoreProc, the same
core running in its own process behind ZMQ sockets (vLLM's v1 EngineCore/EngineCoreProc).
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any, Optional, Union

import zmq

from llmserve.config import EngineConfig
from llmserve.core.kv_events import KVEventBatch
from llmserve.core.timeline import record_execute_time
from llmserve.core.request import Request, RequestStatus
from llmserve.core.kv_cache_manager import max_blocks_held
from llmserve.core.scheduler import Scheduler
from llmserve.core.sched_output import SchedulerOutput
from llmserve.engine.client_router import ClientRouter
from llmserve.engine.core_sleep import SleepModeMixin, wait_input_or_sleep
from llmserve.engine.messages import (
    EngineCoreDead,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRejection,
    EngineCoreRequest,
    EngineCoreRequestType,
    StreamingInputChunk,
    UtilityOutput,
    UtilityRequest,
)
from llmserve.engine.serial import MsgpackDecoder, MsgpackEncoder
from llmserve.executor import Executor
from llmserve import envs
from llmserve.gc_utils import freeze_gc_heap, release_free_heap
from llmserve.proc_utils import exit_when_parent_dies

# Pooling engines gather the next step's requests (EngineCoreProc._gather_pooling_batch)
# until input was quiet for GAP, or for at most MAX, of the last step's duration (floor MIN_S).
POOLING_GATHER_GAP = 0.05
POOLING_GATHER_MAX = 0.25
POOLING_GATHER_MIN_S = 0.01
# Seconds without input after the last step before the idle engine trims its heap
# (EngineCoreProc._trim_idle_heap): long enough that a client's next request in a
# conversation usually comes first, so a busy engine never pays for it.
IDLE_TRIM_S = 1.0

logger = logging.getLogger(__name__)


def _kv_events_on(config: EngineConfig) -> bool:
    kec = getattr(config, "kv_events_config", None)
    return kec is not None and kec.publishes


def _kv_event_publisher(config: EngineConfig):
    """The KV event publisher (llmserve/distributed/kv_events.py), or None when off."""
    if not _kv_events_on(config):
        return None
    from llmserve.distributed.kv_events import make_kv_event_publisher

    return make_kv_event_publisher(config)


def _scheduler_connector(config: EngineConfig):
    """The scheduler side of the configured KV connector (llmserve/kv_transfer), or None."""
    ktc = config.kv_transfer_config
    if ktc is None or not ktc.is_kv_transfer_instance:
        return None
    from llmserve.kv_transfer import KVConnectorFactory, KVConnectorRole

    return KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER)


def _tier_restore(scheduler: Scheduler, config: EngineConfig):
    """The disk KV tier's warm-up at start (``kv_transfer/tier_restore.py``), or None: no
    connector that restores, no prefix cache, or a model without a generating KV cache."""
    if scheduler.connector is None or not scheduler.needs_kv or config.model_config.runner == "pooling":
        return None
    from llmserve.kv_transfer.tier_restore import make_tier_restore

    kv = scheduler.kv_cache_manager
    return make_tier_restore(scheduler.connector, kv.pool, kv.enable_caching)


def _kv_sliding_window(executor: Executor, config: EngineConfig) -> Optional[int]:
    """The window whose out-of-window KV blocks the scheduler frees (every layer windowed,
    ``Executor.kv_cache_sliding_window``), or None. None with a KV connector too: the
    connectors save and load a request's whole prefix block by block, and a freed block
    (the null block in the table) holds none of it, so with one the blocks are kept."""
    window = executor.kv_cache_sliding_window()
    ktc = config.kv_transfer_config
    if window is not None and ktc is not None and ktc.is_kv_transfer_instance:
        logger.info("KV connector on: the KV blocks outside the %d-token sliding window are kept "
                    "until each request ends (connectors save and load whole prefixes)", window)
        return None
    if window is not None:
        logger.info("Sliding window of %d tokens on every layer: KV blocks outside it are freed "
                    "while requests run", window)
    return window


def _kv_cache_groups(executor: Executor, config: EngineConfig) -> list[Optional[int]]:
    """The window (None: full attention) of each KV cache group the model runner laid out
    (``Executor.kv_cache_group_windows``): several for a hybrid model (Gemma 2/3, whose
    windowed groups free the blocks their window has left), else the one of
    ``_kv_sliding_window``. The runner lays out one group when a KV connector is on."""
    groups = executor.kv_cache_group_windows()
    if len(groups) > 1:
        logger.info("KV cache groups (window per group, None: full attention): %s; blocks outside "
                    "a group's window are freed while requests run", groups)
        return groups
    return [_kv_sliding_window(executor, config)]


class EngineCore(SleepModeMixin):
    """The inner loop of the engine, in whatever process it lives.

    Builds the executor (``executor_class``, default ``Executor.get_class(config)``),
    which loads the model; sizes the KV cache (raises ValueError if it cannot hold one
    max_model_len sequence) and builds the scheduler. log_stats: requests record
    QUEUED/SCHEDULED/PREEMPTED events for the front end's timing metrics.
    """

    def __init__(self, config: EngineConfig, executor_class: Optional[type[Executor]] = None,
                 log_stats: bool = False) -> None:
        self.config = config
        self.log_stats = log_stats
        # --collect-detailed-traces: time each step's execute_model for the requests' spans
        self._time_execute = log_stats and bool(config.observability_config.collect_detailed_traces)
        if executor_class is None:
            executor_class = Executor.get_class(config)
        self.model_executor = executor_class(config)
        num_blocks = self.model_executor.determine_num_blocks()
        bs = config.cache_config.block_size
        max_len = config.model_config.max_model_len
        groups = _kv_cache_groups(self.model_executor, config)
        window = groups[0] if len(groups) == 1 else None
        # A sequence's blocks in every group (a window's only) + block 0, reserved.
        needed = max_blocks_held(groups, max_len, bs, config.scheduler_config.max_num_batched_tokens) + 1
        if num_blocks < needed:
            per_block = self.model_executor.kv_cache_bytes_per_block()
            held = f"its {window}-token sliding window" if window is not None and needed < -(-max_len // bs) + 1 \
                else f"max_model_len={max_len} tokens" if len(groups) == 1 \
                else f"max_model_len={max_len} tokens in its full-attention layers and its window in the windowed ones"
            raise ValueError(
                f"The KV cache is too small: {num_blocks} blocks of {bs} tokens "
                f"({num_blocks * per_block / 2**20:.1f} MiB) cannot hold one sequence of "
                f"{held}, which needs {needed} blocks "
                f"({needed * per_block / 2**20:.1f} MiB). Increase kv_cache_memory or "
                f"decrease max_model_len.")
        self.num_blocks = num_blocks
        self.model_executor.initialize_kv_cache(num_blocks)
        from llmserve.structured_output.manager import StructuredOutputManager

        self.structured_output_manager = StructuredOutputManager(config)
        connector = _scheduler_connector(config)
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, num_blocks,
                                   needs_kv=not config.model_config.is_encoder_only,
                                   structured_output_manager=self.structured_output_manager,
                                   lora_config=config.lora_config,
                                   speculative_config=getattr(config, "speculative_config", None),
                                   kv_connector=connector,
                                   enable_kv_cache_events=_kv_events_on(config),
                                   kv_cache_groups=groups)
        # --kv-events-config: each step's block events go to this publisher (None: off).
        self.kv_event_publisher = _kv_event_publisher(config)
        # The disk KV tier's warm-up (restore_kv_tier) while under way; the finished one
        # (its counters: blocks, nbytes, failed, seconds) once done.
        self._tier_restore = _tier_restore(self.scheduler, config)
        self.tier_restore_done = None
        self.lora_registry = None  # the loaded adapters (llmserve/lora/registry.py) with enable_lora
        if config.lora_config is not None:
            from llmserve.lora.registry import LoRARegistry
            from llmserve.lora.scheduling import active_lora_ids

            self.lora_registry = LoRARegistry(config.lora_config, self.model_executor,
                                              lambda: active_lora_ids(self.scheduler.requests.values()))
        logger.info("KV cache: %d blocks of %d tokens (%d tokens) in %s; max concurrency for %d-token "
                    "requests: %.2fx", num_blocks - 1, bs, (num_blocks - 1) * bs,
                    config.cache_config.kv_dtype(config.model_config), max_len, (num_blocks - 1) * bs / max_len)

    @property
    def model_runner(self):
        """The in-process model runner (the uniprocess executor's)."""
        return self.model_executor.model_runner

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request. Raises ValueError when it can never run (too long for the
        model or the KV cache)."""
        request = Request(req.request_id, req.prompt_token_ids, req.sampling_params,
                          req.eos_token_id, req.arrival_time, req.priority, resumable=req.resumable,
                          trace_headers=req.trace_headers, log_stats=self.log_stats,
                          pooling_params=req.pooling_params, encoder_inputs=req.encoder_inputs)
        request.tenant, request.tenant_weight = req.tenant, req.tenant_weight
        if req.lora_request is not None:  # loaded now unless EngineCoreProc loaded it off the loop
            registry = self._lora()
            if not registry.is_ready(req.lora_request):
                registry.add(req.lora_request)
            request.lora_request = req.lora_request
        request.beam_search_params = req.beam_search_params
        for tok in req.output_token_ids:  # resumed after an engine restart: as if preempted
            request.append_output_token_ids(tok)
        if req.sampling_params is not None and req.sampling_params.structured_outputs is not None:
            self.structured_output_manager.grammar_init(request, req.reasoning_ended)
        if self.model_executor.is_sleeping():  # the first request after sleep wakes the engine
            self.wake_up()
        self.scheduler.add_request(request)

    def add_streaming_input(self, chunk: StreamingInputChunk) -> None:
        """Extend (or close) a streaming-input request. Raises ValueError as add_request."""
        self.scheduler.update_streaming_request(chunk.request_id, chunk.prompt_token_ids,
                                                chunk.sampling_params, chunk.final)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """One engine iteration. Returns outputs (possibly empty)."""
        sched = self.scheduler
        if not sched.has_requests_to_schedule():
            if sched.waiting_for_fsm:  # only grammars compiling: wait a little for one
                self.structured_output_manager.wait_for_compile(sched.waiting_for_fsm, 0.005)
            self.model_executor.remove_requests(sched.finished_req_ids)
            sched.finished_req_ids = set()
            self._publish_kv_events()
            return EngineCoreOutputs(outputs=sched.take_pending_outputs(), scheduler_stats=sched.make_stats(),
                                     timestamp=time.monotonic())
        so = sched.schedule()
        t0 = time.perf_counter() if self._time_execute else 0.0
        ro = self.model_executor.execute_model(so)
        dt = time.perf_counter() - t0 if t0 else 0.0
        outs = sched.update_from_output(so, ro)
        if t0:
            record_execute_time(so.scheduled, outs, dt)
        if self.lora_registry is not None:
            self.lora_registry.release_idle()  # adapters removed while in use, now idle
        self._publish_kv_events()
        return EngineCoreOutputs(outputs=outs, scheduler_stats=sched.make_stats(), timestamp=time.monotonic())

    def restore_kv_tier(self) -> bool:
        """Run one chunk of the disk KV tier's warm-up (``kv_transfer/tier_restore.py``):
        the workers read the chunk's blocks (no forward), then they enter the RAM prefix
        cache. True while chunks remain; False when done, off, or the engine sleeps (the
        KV cache is freed; the rest waits for the wake-up). Call it only between steps."""
        r = self._tier_restore
        if r is None or self.model_executor.is_sleeping():
            return False
        t0 = time.perf_counter()
        meta = r.next_chunk()
        if meta is None:
            r.add_seconds(time.perf_counter() - t0)
            self._tier_restore, self.tier_restore_done = None, r
            logger.info("KV tier: %s", r.summary())
            return False
        ro = self.model_executor.execute_model(SchedulerOutput(kv_connector_metadata=meta))
        r.finish_chunk(ro.invalid_block_ids)
        r.add_seconds(time.perf_counter() - t0)
        self._publish_kv_events()  # the restored blocks' BlockStored, before anything they serve
        return True

    # ---- utility calls ---------------------------------------------------
    def _publish_kv_events(self) -> None:
        """Hand the step's block events (AllBlocksCleared after a reset) to the publisher."""
        if self.kv_event_publisher is not None:
            events = self.scheduler.kv_cache_manager.take_events()
            if events:
                self.kv_event_publisher.publish(KVEventBatch(time.time(), events))

    def reset_prefix_cache(self) -> bool:
        done = self.scheduler.kv_cache_manager.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def get_stats(self) -> dict[str, Any]:
        s = self.scheduler
        kv = s.kv_cache_manager
        return {"num_running_reqs": len(s.running), "num_waiting_reqs": len(s.waiting),
                "num_used_blocks": kv.num_used_blocks, "num_total_blocks": kv.pool.num_blocks - 1,
                "kv_cache_usage": kv.usage, "num_preemptions": s.num_preemptions_total,
                "num_blocks": self.num_blocks, "pid": os.getpid()}

    # ---- LoRA (vLLM's EngineCore utilities) ----------------------------------
    def _lora(self):
        if self.lora_registry is None:
            from llmserve.lora.errors import LoRAAdapterError

            raise LoRAAdapterError("LoRA is not enabled: start the engine with enable_lora=True "
                                   "(--enable-lora)", "enable_lora")
        return self.lora_registry

    def add_lora(self, lora_request: Any, weights: Any = None) -> bool:
        """Load an adapter (``LoRARequest`` or its wire form). False: already loaded.
        Raises LoRAAdapterError naming the field at fault."""
        from llmserve.lora.request import as_lora_request

        return self._lora().add(as_lora_request(lora_request), weights)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter once its requests finish; False when it is not loaded."""
        return self._lora().remove(int(lora_id))

    def list_loras(self) -> set[int]:
        return self._lora().list()

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora().pin(int(lora_id))

    def call_utility(self, method: str, args: list[Any]) -> Any:
        if method not in _UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}")
        return getattr(self, method)(*args)

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.model_executor.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()


_UTILITY_METHODS = {"reset_prefix_cache", "get_stats", "ping", "sleep", "wake_up", "is_sleeping", "add_lora", "remove_lora", "list_loras", "pin_lora"}
EngineCore.ping = lambda self: "pong"  # type: ignore[attr-defined]


# Start-up failures that describe the user's input (no weights, an unsupported
# architecture or tensor type, a missing file, too little memory): one line, as a bad
# flag gets; the client repeats it. Any other type is likely our bug: full traceback.
_INPUT_FAILURES = (ValueError, OSError, NotImplementedError, MemoryError)


def _log_startup_failure() -> None:
    """Log the exception being handled (the engine failed to start): one line for an
    input failure (_INPUT_FAILURES; its traceback at DEBUG), else the traceback."""
    exc = sys.exc_info()[1]
    if isinstance(exc, _INPUT_FAILURES):
        logger.error("EngineCore failed to start: %s: %s", type(exc).__name__, exc)
        logger.debug("EngineCore start-up traceback:\n%s", traceback.format_exc())
    else:
        logger.error("EngineCore failed to start:\n%s", traceback.format_exc())


class EngineCoreProc:
    """EngineCore in a child process: an input thread decodes requests from the input
    socket onto a queue, the main thread steps while there is work, an output thread
    encodes and sends EngineCoreOutputs. On an unrecoverable error it sends
    ENGINE_CORE_DEAD (``EngineCoreDead``) before exiting."""

    def __init__(self, config: EngineConfig, input_addr: Union[str, list[str]], output_addr: Union[str, list[str]],
                 executor_class: Optional[type[Executor]] = None, log_stats: bool = False) -> None:
        # One address each, or one per API-server client (--api-server-count): the input
        # socket connects to every client's, and each client gets its own output socket.
        self.input_addrs = [input_addr] if isinstance(input_addr, str) else list(input_addr)
        self.output_addrs = [output_addr] if isinstance(output_addr, str) else list(output_addr)
        self._router = ClientRouter(len(self.output_addrs)) if len(self.output_addrs) > 1 else None
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.ctx = zmq.Context()
        self.encoder = MsgpackEncoder()
        # True when requests left the scheduler (aborts) since the last SchedulerStats sent.
        self._stats_stale = False
        self._started = time.monotonic()
        self._out_thread = threading.Thread(target=self._process_output_socket, daemon=True)
        self._out_thread.start()
        try:
            self.core = EngineCore(config, executor_class, log_stats)
            self._prefault_logged = self.core.model_runner.kv_prefault_done()
        except BaseException as e:
            self.output_queue.put(EngineCoreOutputs(dead=EngineCoreDead(
                f"Engine start-up failed: {type(e).__name__}: {e}", during_startup=True)))
            self.output_queue.put(None)
            self._out_thread.join(timeout=5)
            # Deliver it before the process exits: a closed socket's last message is sent by
            # ZMQ's I/O thread, which os._exit would kill (term() waits up to the linger).
            self.ctx.term()
            raise
        self._pooling = config.model_config.runner == "pooling"
        self.output_queue.put(EngineCoreOutputs(ready=EngineCoreReady(self.core.num_blocks, os.getpid())))
        self._in_thread = threading.Thread(target=self._process_input_socket, daemon=True)
        self._in_thread.start()

    @staticmethod
    def run_engine_core(config: EngineConfig, input_addr: Union[str, list[str]], output_addr: Union[str, list[str]],
                        executor_class: Optional[type[Executor]] = None, log_stats: bool = False) -> int:
        """Entry point of the child process. Returns its exit code: 0 after SHUTDOWN or
        SIGTERM, 1 after a fatal error (ENGINE_CORE_DEAD sent first)."""
        logging.basicConfig(level=envs.get("LLMSERVE_LOGGING_LEVEL", "INFO"),
                            format="%(levelname)s %(asctime)s [engine] %(message)s")
        shutdown_requested = False
        exit_code = 0

        def _signal(signum, frame):
            nonlocal shutdown_requested
            if not shutdown_requested:
                shutdown_requested = True
                raise SystemExit(0)

        signal.signal(signal.SIGTERM, _signal)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
        proc = None
        try:
            proc = EngineCoreProc(config, input_addr, output_addr, executor_class, log_stats)
            freeze_gc_heap("EngineCore")  # no full-GC pauses between steps (gc_utils)
            proc.run_busy_loop()
        except SystemExit:
            logger.info("EngineCore shutting down")
        except BaseException:
            exit_code = 1
            if proc is not None:
                logger.error("EngineCore hit a fatal error:\n%s", traceback.format_exc())
                proc.output_queue.put(EngineCoreOutputs(dead=EngineCoreDead(traceback.format_exc(limit=3))))
            else:
                _log_startup_failure()
            if proc is None:
                os._exit(1)
        finally:
            if proc is not None:
                proc.output_queue.put(None)
                proc._out_thread.join(timeout=5)
                if proc.core.kv_event_publisher is not None:  # send the last steps' events
                    proc.core.kv_event_publisher.shutdown()
        return exit_code

    def run_busy_loop(self) -> None:
        """Step while there is work; block on the input queue when idle. Every output
        carries SchedulerStats; when aborts leave the engine idle, with no step to follow,
        an idle ``step()`` sends the final stats (0 running, KV blocks freed) before
        blocking (vLLM: EngineCoreProc.run_busy_loop)."""
        core = self.core
        gather = False  # a pooling step just sent its vectors: gather the clients' next requests
        while True:
            if not core.has_work():
                gather = False  # idle: the next request runs at once
                if self._stats_stale:
                    self._stats_stale = False
                    self.output_queue.put(core.step())
                # Idle: restore the disk KV tier into the prefix cache, then fault in KV
                # cache pages, a chunk at a time until input arrives.
                restored = False
                while self.input_queue.empty() and core.restore_kv_tier():
                    restored = True
                if restored:  # the restore's counters (vllm:kv_connector_blocks_restored) out now
                    self.output_queue.put(core.step())
                while self.input_queue.empty() and core.model_runner.prefault_kv():
                    pass
                self._log_prefault_progress()
                item = self._wait_input()
                if self._handle(item):
                    return
            while not self.input_queue.empty():
                if self._handle(self.input_queue.get_nowait()):
                    return
            if core.has_work():
                if gather and self._gather_pooling_batch(len(outs.outputs), step_s):
                    return
                t0 = time.monotonic()
                outs = core.step()
                step_s = time.monotonic() - t0
                self._last_work = t0 + step_s  # --sleep-idle-seconds counts from the last step
                self._heap_dirty = True  # the step's temporaries stay in the heap (_keep_freed_memory)
                gather = self._pooling and bool(outs.outputs)
                if outs.outputs:
                    self.output_queue.put(outs)
                elif not core.has_work():
                    self.output_queue.put(outs)  # final stats after the last request left
                self._stats_stale = False

    def _wait_input(self):
        """The next input (blocking), sleeping the engine after ``sleep_idle_seconds``. When
        steps ran since the last time, and no input comes for ``IDLE_TRIM_S``, first hand the
        heap's free pages back to the OS (:meth:`_trim_idle_heap`)."""
        if getattr(self, "_heap_dirty", False):
            try:
                return self.input_queue.get(timeout=IDLE_TRIM_S)
            except queue.Empty:
                self._trim_idle_heap()
        return wait_input_or_sleep(self)

    def _trim_idle_heap(self) -> None:
        """``malloc_trim`` once the engine went idle after steps: ``_keep_freed_memory`` keeps
        the steps' freed temporaries (logits, sampler and attention buffers) in the heap,
        so a busy engine does not fault them in again at each step, but an idle one held
        them for good: after 32 requests of 256 + 64 tokens (SmolLM2) it held ~330 MiB
        more than before them; the trim (2-10 ms) gives ~76 MiB back (the rest is the KV
        blocks, kept for the prefix cache). The next step after idling faults its temporaries in again,
        once."""
        self._heap_dirty = False
        t0 = time.perf_counter()
        release_free_heap()
        logger.debug("idle: heap trimmed in %.1f ms", (time.perf_counter() - t0) * 1000)

    def _gather_pooling_batch(self, expected: int, step_s: float) -> bool:
        """A pooling engine with work left, right after sending the vectors of a step
        that took ``step_s`` to ``expected`` requests: those clients usually send their
        next requests soon, and one step of 32 prompts costs much less per prompt than
        two of 16 (all-MiniLM-L6-v2 on 2 busy cores: 61 vs 93 ms of CPU per sentence).
        Take input until ``expected`` requests came in, input was quiet for
        POOLING_GATHER_GAP of a step, POOLING_GATHER_MAX of a step passed, or
        max_num_seqs are in. A lone request never waits (an idle engine blocks on input
        as before); generating engines never come here. Returns True to shut down."""
        sched = self.core.scheduler
        gap = max(POOLING_GATHER_MIN_S, POOLING_GATHER_GAP * step_s)
        deadline = time.monotonic() + max(POOLING_GATHER_MIN_S, POOLING_GATHER_MAX * step_s)
        while expected > 0 and len(sched.waiting) + len(sched.running) < sched.config.max_num_seqs:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                item = self.input_queue.get(timeout=min(gap, left))
            except queue.Empty:
                break
            if self._handle(item):
                return True
            expected -= 1
        return False

    def _log_prefault_progress(self) -> None:
        """Log once when the idle prefault has made the whole KV cache resident."""
        if self._prefault_logged:
            return
        runner = self.core.model_runner
        done = runner.kv_prefault_done()
        if done:
            self._prefault_logged = True
            logger.info("KV cache resident (%.1f GiB) %.1f s after start-up",
                        runner.kv_cache_nbytes() / 2**30, time.monotonic() - self._started)

    def _load_lora_first(self, rtype, payload) -> bool:
        """An ``add_lora`` call, or a request whose adapter is not loaded: read the files
        in a thread (llmserve/lora/async_loader.py); True when it went there."""
        registry = self.core.lora_registry
        if registry is None:
            return False
        from llmserve.lora.async_loader import read_in_thread
        from llmserve.lora.request import as_lora_request

        if rtype == EngineCoreRequestType.ADD and payload.lora_request is not None \
                and not registry.is_ready(payload.lora_request):
            read_in_thread(registry, payload.lora_request, "request", payload, self.input_queue)
            return True
        if rtype == EngineCoreRequestType.UTILITY and payload.method == "add_lora" and payload.args:
            try:
                lora = as_lora_request(payload.args[0])
            except ValueError:
                return False  # the utility call reports it
            read_in_thread(registry, lora, "utility", payload, self.input_queue)
            return True
        return False

    def _lora_ready(self, item) -> None:
        """Swap in an adapter read off the loop, then answer its utility call or add
        its request (a failed read: the call fails, the request is refused)."""
        from llmserve.lora.errors import LoRAAdapterError, failure_text

        error = item.error
        result = None
        if error is None:
            try:
                result = self.core.add_lora(item.lora_request, item.weights)
            except Exception as e:  # noqa: BLE001 - reported to the caller, the engine goes on
                error = e
        if item.kind == "utility":
            call = item.payload
            msg = None if error is None else (failure_text(error) if isinstance(error, LoRAAdapterError)
                                              else f"{type(error).__name__}: {error}")
            outs = EngineCoreOutputs(utility_output=UtilityOutput(call.call_id, result=result, failure_message=msg))
            self.output_queue.put(outs if self._router is None else (call.client_index, outs))
        elif error is not None:  # a typed error crosses in failure_text's form (its param kept)
            logger.warning("Rejected request %s: %s", item.payload.request_id, error)
            msg = failure_text(error) if isinstance(error, LoRAAdapterError) else str(error)
            self.output_queue.put(EngineCoreOutputs(rejected=[EngineCoreRejection(item.payload.request_id, msg)]))
        else:
            self._handle((EngineCoreRequestType.ADD, item.payload))

    def _handle(self, item) -> bool:
        """Apply one input message; True means shut down."""
        rtype, payload = item
        if rtype == "lora_ready":  # llmserve.lora.async_loader.LORA_READY
            self._lora_ready(payload)
            return False
        if self._load_lora_first(rtype, payload):
            return False
        if rtype == EngineCoreRequestType.ADD or rtype == EngineCoreRequestType.STREAMING_INPUT:
            try:
                if rtype == EngineCoreRequestType.ADD:
                    if self._router is not None:
                        self._router.add(payload)
                    self.core.add_request(payload)
                else:
                    self.core.add_streaming_input(payload)
            except ValueError as e:
                # Refused: tell the caller (a ValueError there), so it is not left waiting.
                from llmserve.lora.errors import LoRAAdapterError, failure_text

                logger.warning("Rejected request %s: %s", payload.request_id, e)
                msg = failure_text(e) if isinstance(e, LoRAAdapterError) else str(e)
                self.output_queue.put(EngineCoreOutputs(rejected=[EngineCoreRejection(payload.request_id, msg)]))
        elif rtype == EngineCoreRequestType.ABORT:
            if self.core.has_work():  # else every request has finished: stats unchanged
                self._stats_stale = True
            self.core.abort_requests(payload)
            if self._router is not None:
                self._router.forget(payload)
        elif rtype == EngineCoreRequestType.UTILITY:
            try:
                res = UtilityOutput(payload.call_id, result=self.core.call_utility(payload.method, payload.args))
            except Exception as e:  # a bad utility call must not kill the engine
                from llmserve.lora.errors import LoRAAdapterError, failure_text

                res = UtilityOutput(payload.call_id, failure_message=failure_text(e) if isinstance(
                    e, LoRAAdapterError) else f"{type(e).__name__}: {e}")
            outs = EngineCoreOutputs(utility_output=res)
            self.output_queue.put(outs if self._router is None else (payload.client_index, outs))
        elif rtype == EngineCoreRequestType.SHUTDOWN:
            return True
        return False

    def _process_input_socket(self) -> None:
        sock = self.ctx.socket(zmq.PULL)
        for addr in self.input_addrs:  # PULL fair-queues the clients
            sock.connect(addr)
        decoders = {
            EngineCoreRequestType.ADD: MsgpackDecoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY: MsgpackDecoder(UtilityRequest),
            EngineCoreRequestType.SHUTDOWN: MsgpackDecoder(),
            EngineCoreRequestType.STREAMING_INPUT: MsgpackDecoder(StreamingInputChunk),
        }
        while True:
            try:
                type_frame, data = sock.recv_multipart(copy=False)
                rtype = EngineCoreRequestType(bytes(type_frame.buffer))
                self.input_queue.put((rtype, decoders[rtype].decode(data.buffer)))
            except zmq.ContextTerminated:
                return
            except Exception:
                logger.error("Bad message on the input socket:\n%s", traceback.format_exc())

    def _process_output_socket(self) -> None:
        socks = []
        for addr in self.output_addrs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(addr)
            socks.append(sock)
        router = self._router
        while True:
            outs = self.output_queue.get()
            if outs is None:
                break
            if router is None:
                socks[0].send(self.encoder.encode(outs), copy=False)
                continue
            for idx, part in router.route(outs):
                socks[idx].send(self.encoder.encode(part), copy=False)
        for sock in socks:
            sock.close()


def _keep_freed_memory() -> None:
    """Have glibc serve large blocks from the heap and keep freed memory (mallopt
    M_MMAP_THRESHOLD / M_TRIM_THRESHOLD = 1 GiB). By default every tensor over 32 MiB (the
    ``[num_seqs, vocab]`` logits and the sampler's temporaries) is a fresh mmap whose pages
    fault in on each step: ~8 ms per decode step of 256 sequences here. The engine process's
    memory then stays at its peak, as with the tcmalloc/jemalloc that vLLM recommends on CPU.
    No-op where glibc is absent."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


# Modules that reading the config and building the engine import, preloaded by _preload
# (1.5 s of imports followed the config's arrival before; measured on 2 cores).
_PRELOAD_MODULES = (
    "transformers.configuration_utils",
    "transformers.models.llama.configuration_llama",  # the default model's (SmolLM2) config class
    "llmserve.model_loader.gguf_loader",
    "llmserve.model_loader.startup_cache",
    "llmserve.models.packed",
    "llmserve.ops.kquant",
    "llmserve.pooler_config",
    "llmserve.structured_output.manager",
)


def _import_best_effort(names: tuple[str, ...]) -> None:
    """Import each module of ``names``; one that fails to import (missing, or another
    transformers version's layout) is skipped: whoever needs it reports the error later."""
    import importlib
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - e.g. another transformers version's layout
            pass


def _preload() -> None:
    """Import what loading a model needs, and load the CPU kernels, before the config is
    read: a prestarted engine (core_process.prestart_engine_process) does it while the API
    server starts. Then import what unpickling the config and building the engine imports
    (``_PRELOAD_MODULES``). Each step is best effort; the engine repeats it (cached) when
    needed."""
    try:
        import llmserve.model_loader  # noqa: F401  (model resolution; no torch of its own)
        import llmserve.models.llama  # noqa: F401
        import llmserve.worker.model_runner  # noqa: F401
        from llmserve.ops.cpu_ops import get_decode_kernel
        from llmserve.ops.quant_ops import get_quant_ops
        get_decode_kernel()
        get_quant_ops()
    except Exception:  # noqa: BLE001 - the engine reports real failures when it loads
        pass
    _import_best_effort(_PRELOAD_MODULES)


def _transformers_without_torch() -> None:
    """Import transformers with torch hidden (``llmserve.torch_hiding``), before torch: the
    engine uses transformers for config objects (the unpickled ``hf_config``) and
    tokenizers (structured output), none of which needs torch, but a transformers that
    sees torch imports ~800 more modules for them (a LlamaConfig: utils/type_validators ->
    activations -> hub_kernels -> torch.distributed.tensor, sympy). Measured (2 cores,
    SmolLM2): the imports before the config 2.7 s -> 2.0 s, the idle engine's anonymous
    memory -55 MiB (RSS 453 -> 396 MiB), the same greedy tokens. The engine's own torch code is unaffected:
    only transformers' ``is_torch_available()`` answers False in this process."""
    from llmserve.torch_hiding import import_transformers_without_torch
    import_transformers_without_torch()


def _freeze_preloaded() -> None:
    """Collect, then freeze the preloaded modules' objects (~300k: torch, transformers) out
    of the garbage collector while the engine still waits for its config. ``freeze_gc_heap``
    after start-up then walks only what building the engine made: it took 201 ms, now
    56 ms, and the first request waited for it (its 8 tokens took 0.26 s after READY, now
    0.14 s; 2 cores, SmolLM2). The same collect-and-freeze as after start-up (gc_utils)."""
    freeze_gc_heap("engine (preloaded modules)")


def main() -> None:
    """``python -m llmserve.engine.core``: read (config, input_addr, output_addr,
    parent_pid, executor_class, log_stats) from stdin (each address a str, or a list with
    one per API-server client), then run EngineCoreProc."""
    import pickle
    import sys

    _transformers_without_torch()
    _preload()
    _freeze_preloaded()
    data = sys.stdin.buffer.read()
    if not data:  # a prestarted interpreter whose server never needed it
        os._exit(0)
    config, input_addr, output_addr, parent_pid, executor_class, log_stats = pickle.loads(data)
    _keep_freed_memory()
    exit_when_parent_dies(parent_pid)
    exit_code = EngineCoreProc.run_engine_core(config, input_addr, output_addr, executor_class, log_stats)
    # Nothing is left to clean up (outputs flushed, sockets closed; the client removes
    # the socket dir): skip the interpreter teardown, ~1 s of module finalization
    # (torch) that the client's shutdown would wait for.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    main()
