"""Sleep mode in the EngineCore (vLLM's ``EngineCore.sleep`` / ``wake_up`` /
``is_sleeping``) and llama.cpp's ``--sleep-idle-seconds`` in EngineCoreProc's idle wait.
The worker side (freeing and reloading weights and KV) is llmserve/worker/sleep_mode.py.
"""
from __future__ import annotations

import logging
import queue
import time
from typing import Any, Optional

logger = logging.getLogger("llmserve.engine.core")


class SleepModeMixin:
    """EngineCore's sleep-mode utilities (``config``, ``scheduler``, ``model_executor``,
    ``lora_registry`` and ``reset_prefix_cache`` come from EngineCore)."""

    def sleep(self, level: int = 1) -> bool:
        """Free the weights and the KV cache (llmserve/worker/sleep_mode.py). Raises
        ValueError without ``enable_sleep_mode`` (or ``sleep_idle_seconds``), for a level
        other than 1 or 2, with LoRA on, or while requests are in flight: this engine
        refuses to sleep when busy (HTTP 400) rather than abort or pause them. The prefix
        cache is reset: the KV it indexes is freed. Returns True."""
        from llmserve.worker.sleep_mode import check_level

        mc = self.config.model_config
        if not (mc.enable_sleep_mode or mc.sleep_idle_seconds):
            raise ValueError("sleep mode is off: start the engine with enable_sleep_mode=True "
                             "(--enable-sleep-mode)")
        level = check_level(level)
        if self.lora_registry is not None:
            raise ValueError("sleep mode with enable_lora is not supported (adapters would be lost)")
        if self.scheduler.has_unfinished_requests():
            raise ValueError("the engine is busy: sleep is refused while requests are in flight; "
                             "retry when they have finished")
        self.model_executor.remove_requests(self.scheduler.finished_req_ids)
        self.scheduler.finished_req_ids = set()
        self.reset_prefix_cache()
        self.model_executor.sleep(level)
        logger.info("Sleeping (level %d): weights and KV cache freed", level)
        return True

    def wake_up(self, tags: Optional[list[str]] = None) -> bool:
        """Reload what ``sleep`` freed: ``tags`` "weights" and/or "kv_cache" (vLLM's; None:
        both). A no-op when awake. ValueError for an unknown tag. Returns True."""
        from llmserve.worker.sleep_mode import check_tags

        self.model_executor.wake_up(list(check_tags(tags)))
        return True

    def is_sleeping(self) -> bool:
        return self.model_executor.is_sleeping()


def wait_input_or_sleep(proc: Any) -> Any:
    """The next input, blocking. With ``sleep_idle_seconds`` (llama.cpp's
    --sleep-idle-seconds) an awake engine that has run no step for that long puts itself
    to sleep (level 1) and waits on; the next request wakes it (EngineCore.add_request).
    Inputs that are not requests (a /metrics scrape's get_stats) do not reset the clock."""
    config = getattr(proc.core, "config", None)  # None: a stand-in core (tests) that never sleeps
    idle_s = config.model_config.sleep_idle_seconds if config is not None else None
    while idle_s and not proc.core.is_sleeping():
        last = getattr(proc, "_last_work", None) or proc._started
        try:
            return proc.input_queue.get(timeout=max(0.0, last + idle_s - time.monotonic()))
        except queue.Empty:
            try:
                proc.core.sleep(1)
            except ValueError as e:  # e.g. LoRA on: stay awake
                logger.warning("Idle sleep skipped: %s", e)
                break
    return proc.input_queue.get()
