"""Prometheus metrics of the engine (vLLM's ``PrometheusStatLogger``), served at /metrics.

Names and labels are vLLM's (``vllm:`` prefix, so Grafana dashboards built for vLLM work unchanged),
each labelled with ``model_name`` and ``engine``:

==========================================  =========  ===================================
Every logger owns its own ``CollectorRegistry`` (no process-global state), so several
apps or engines in one process never collide.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llmserve.metrics.stats import IterationStats, SchedulerStats

PREFIX = "vllm:"
FINISH_REASONS = ("stop", "length", "abort")
# Why admission control refused a request (the ``reason`` label of request_rejected_total):
# the waiting queue is full (429), the KV cache cannot take the waiting work (429), the
# server is shutting down (503).
REJECTION_REASONS = ("queue_full", "queue_delay", "kv_cache_full", "draining", "engine_restarting")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                          2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    exp = 1
    while True:
        for m in (1, 2, 5):
            v = m * exp
            if v > max_model_len:
                return out
            out.append(float(v))
        exp *= 10


class PrometheusStatLogger:
    """Stat logger that exports engine stats as Prometheus metrics.

    Args:
      engine_config: the EngineConfig (model name label, max_model_len for buckets), or
        anything with ``model_config``.
      registry: a CollectorRegistry to register into (default: a new one, private).
    ``record(scheduler_stats, iteration_stats)`` is called by AsyncLLM after each batch
    of engine outputs; either argument may be None. ``render()`` returns the text
    exposition format (bytes) for GET /metrics.
    """

    def __init__(self, engine_config: Any, registry: Optional[CollectorRegistry] = None, engine_index: int = 0):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        model_config = engine_config.model_config
        names = getattr(model_config, "served_model_name", None) or (model_config.model,)
        self.model_name = names[0] if isinstance(names, (tuple, list)) else str(names)
        max_len = int(getattr(model_config, "max_model_len", 2048) or 2048)
        labels = ["model_name", "engine"]
        lv = {"model_name": self.model_name, "engine": str(engine_index)}
        r = self.registry
        # id(child) -> its family, so a data-parallel rank's view can relabel every metric.
        self._families: dict[int, Any] = {}
        self._engine_views: dict[int, "PrometheusStatLogger"] = {engine_index: self}

        def child(family: Any) -> Any:
            c = family.labels(**lv)
            self._families[id(c)] = family
            return c

        def gauge(name: str, doc: str) -> Any:
            # Several API servers (multiprocess mode) all see the same engine: its latest value.
            return child(Gauge(PREFIX + name, doc, labels, registry=r, multiprocess_mode="mostrecent"))

        def counter(name: str, doc: str) -> Any:
            return child(Counter(PREFIX + name, doc, labels, registry=r))

        def hist(name: str, doc: str, buckets: Any) -> Any:
            return child(Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r))

        self.gauge_running = gauge("num_requests_running", "Number of requests in the running batch.")
        self.gauge_waiting = gauge("num_requests_waiting", "Number of requests waiting to be scheduled.")
        self.gauge_kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent used.")
        self.counter_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.counter_prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.counter_prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # KV connector tier (llmserve/kv_transfer): vLLM's external_prefix_cache_* names (tokens).
        self.counter_external_queries = counter("external_prefix_cache_queries",
                                                "Prompt tokens looked up in the KV connector's tier (disk).")
        self.counter_external_hits = counter("external_prefix_cache_hits",
                                             "Prompt tokens loaded from the KV connector's tier (disk).")
        self.counter_external_bytes = counter("kv_connector_bytes_loaded",
                                              "Bytes of KV blocks loaded from the KV connector's tier.")
        self.counter_external_restored = counter("kv_connector_blocks_restored",
                                                 "KV blocks restored from the KV connector's tier into the "
                                                 "prefix cache at start-up.")
        # Speculative decoding (vLLM's vllm:spec_decode_* counters).
        self.counter_spec_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.counter_spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.counter_spec_accepted = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._spec_pos_family = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft position.", labels + ["position"], registry=r)
        self.counter_engine_restarts = counter("engine_restarts", "Engine processes restarted after a crash or a "
                                               "stall (--restart-engine-on-failure).")
        self.counter_prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.counter_generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=r)
        self.counter_success = {reason: success.labels(finished_reason=reason, **lv) for reason in FINISH_REASONS}
        self._success_family = success
        self._lv = lv
        self.hist_ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _LATENCY_BUCKETS)
        self.hist_itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _TOKEN_LATENCY_BUCKETS)
        self.hist_tpot = hist("time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (same samples as inter_token_latency).",
                              _TOKEN_LATENCY_BUCKETS)
        self.hist_req_tpot = hist("request_time_per_output_token_seconds",
                                  "Histogram of the mean time per output token of each request in seconds.",
                                  _TOKEN_LATENCY_BUCKETS)
        self.hist_e2e = hist("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             _E2E_BUCKETS)
        self.hist_queue = hist("request_queue_time_seconds", "Histogram of time spent waiting in seconds.",
                               _E2E_BUCKETS)
        self.hist_prefill = hist("request_prefill_time_seconds",
                                 "Histogram of time spent in the PREFILL phase in seconds.", _E2E_BUCKETS)
        self.hist_decode = hist("request_decode_time_seconds",
                                "Histogram of time spent in the DECODE phase in seconds.", _E2E_BUCKETS)
        self.hist_inference = hist("request_inference_time_seconds",
                                   "Histogram of time spent in the RUNNING phase in seconds.", _E2E_BUCKETS)
        token_buckets = _token_buckets(max_len)
        self.hist_prompt_len = hist("request_prompt_tokens", "Number of prefill tokens per finished request.",
                                    token_buckets)
        self.hist_gen_len = hist("request_generation_tokens", "Number of generation tokens per finished request.",
                                 token_buckets)
        # vLLM's buckets: iteration tokens up to the step budget; n as 1, 2, 5, 10, 20.
        self.hist_iteration_tokens = hist("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])
        self.hist_params_n = hist("request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])
        self.hist_params_max_tokens = hist("request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", token_buckets)
        cache = getattr(engine_config, "cache_config", None)
        if cache is not None:
            info = Gauge(PREFIX + "cache_config_info", "Information of the KV cache config.",
                         ["block_size", "enable_prefix_caching"], registry=r, multiprocess_mode="mostrecent")
            info.labels(block_size=str(cache.block_size),
                        enable_prefix_caching=str(cache.enable_prefix_caching)).set(1)
        self.gauge_lora_info = self._lora_info_gauge(engine_config)
        # Beyond vLLM (admission control, deadlines), under the same prefix and labels.
        rejected = Counter(PREFIX + "request_rejected", "Requests refused by admission control, by reason.",
                           labels + ["reason"], registry=r)
        self.counter_rejected = {reason: rejected.labels(reason=reason, **lv) for reason in REJECTION_REASONS}
        self.counter_deadline = counter("request_deadline_exceeded",
                                        "Requests aborted at the deadline their X-Request-Timeout set.")

        def server_gauge(name: str, doc: str) -> Any:
            # One API server's own count: several (multiprocess mode) add up.
            return child(Gauge(PREFIX + name, doc, labels, registry=r, multiprocess_mode="livesum"))

        self.gauge_admission_receiving = server_gauge(
            "admission_receiving_requests", "Requests whose body is still arriving (not yet seen by admission control).")
        self.gauge_admission_waiting = server_gauge(
            "admission_waiting_requests",
            "Requests admitted and queued behind a full batch (beyond max_num_seqs, or the engine queue when longer); "
            "engine requests: a call with several prompts or n > 1 counts prompts × n.")
        self.gauge_admission_in_flight = server_gauge(
            "admission_in_flight_requests",
            "Requests admitted whose response has not ended (engine requests: a call counts prompts × n).")

    def _lora_info_gauge(self, engine_config: Any) -> Optional[Gauge]:
        """vLLM's ``vllm:lora_requests_info`` (with ``--enable-lora`` only): one sample
        whose labels name the adapters running and waiting (comma-separated) and
        ``max_lora``; its value is the time of the last update (Unix seconds)."""
        lora = getattr(engine_config, "lora_config", None)
        if lora is None:
            return None
        self.max_lora = str(lora.max_loras)
        return Gauge(PREFIX + "lora_requests_info", "Running stats on lora requests.",
                     ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=self.registry,
                     multiprocess_mode="mostrecent")

    def _record_lora(self, scheduler_stats: SchedulerStats) -> None:
        """Update ``vllm:lora_requests_info`` from the scheduler's adapter sets (names ->
        request counts). Only the latest label set is kept (vLLM keeps every set it has
        seen, one series per combination): a scrape shows what runs now, and the series
        count stays 1."""
        names = [",".join(sorted(str(n) for n in (getattr(scheduler_stats, key, None) or ())))
                 for key in ("waiting_lora_adapters", "running_lora_adapters")]
        labels = (self.max_lora, *names)
        if labels != getattr(self, "_lora_labels", None):
            self.gauge_lora_info.clear()
            self._lora_labels = labels
        self.gauge_lora_info.labels(*labels).set_to_current_time()

    def _engine_view(self, engine_idx: int) -> "PrometheusStatLogger":
        """The same metrics under ``engine="<engine_idx>"`` (a data-parallel rank), made once."""
        view = self._engine_views.get(engine_idx)
        if view is None:
            import copy

            view = copy.copy(self)
            lv = dict(self._lv, engine=str(engine_idx))
            for attr, value in vars(self).items():
                family = self._families.get(id(value))
                if family is not None:
                    setattr(view, attr, family.labels(**lv))
            view._lv = lv
            view.counter_success = {reason: self._success_family.labels(finished_reason=reason, **lv)
                                    for reason in FINISH_REASONS}
            self._engine_views[engine_idx] = view
        return view

    def _record_connector(self, st: dict) -> None:
        for counter, key in ((self.counter_external_queries, "queries"), (self.counter_external_hits, "hits"),
                             (self.counter_external_bytes, "bytes_loaded"),
                             (self.counter_external_restored, "blocks_restored")):
            if st.get(key):
                counter.inc(st[key])

    def record(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats],
               *args: Any, engine_idx: int = 0, **kwargs: Any) -> None:
        """Update the metrics from one batch of stats (either may be None); ``engine_idx``:
        the data-parallel rank that sent them (its own ``engine`` label, as vLLM)."""
        if engine_idx:
            self._engine_view(engine_idx).record(scheduler_stats, iteration_stats)
            return
        if scheduler_stats is not None:
            self.gauge_running.set(scheduler_stats.num_running_reqs)
            self.gauge_waiting.set(scheduler_stats.num_waiting_reqs)
            self.gauge_kv_usage.set(scheduler_stats.kv_cache_usage)
            if scheduler_stats.num_preemptions:
                self.counter_preemptions.inc(scheduler_stats.num_preemptions)
            if scheduler_stats.prefix_cache_queries:
                self.counter_prefix_queries.inc(scheduler_stats.prefix_cache_queries)
            if scheduler_stats.prefix_cache_hits:
                self.counter_prefix_hits.inc(scheduler_stats.prefix_cache_hits)
            if self.gauge_lora_info is not None:
                self._record_lora(scheduler_stats)
            if scheduler_stats.kv_connector_stats:
                self._record_connector(scheduler_stats.kv_connector_stats)
            if getattr(scheduler_stats, "spec_decoding_stats", None) is not None:
                self._record_spec(scheduler_stats.spec_decoding_stats)
        if iteration_stats is None:
            return
        if iteration_stats.num_prompt_tokens:
            self.counter_prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        if iteration_stats.num_generation_tokens:
            self.counter_generation_tokens.inc(iteration_stats.num_generation_tokens)
        step_tokens = iteration_stats.num_prompt_tokens + iteration_stats.num_generation_tokens
        if step_tokens:
            self.hist_iteration_tokens.observe(step_tokens)
        for ttft in iteration_stats.time_to_first_tokens_iter:
            self.hist_ttft.observe(ttft)
        for itl in iteration_stats.inter_token_latencies_iter:
            self.hist_itl.observe(itl)
            self.hist_tpot.observe(itl)
        for fin in iteration_stats.finished_requests:
            reason = str(fin.finish_reason)
            counter = self.counter_success.get(reason)
            if counter is None:
                counter = self._success_family.labels(finished_reason=reason, **self._lv)
                self.counter_success[reason] = counter
            counter.inc()
            self.hist_e2e.observe(fin.e2e_latency)
            self.hist_queue.observe(fin.queued_time)
            self.hist_prefill.observe(fin.prefill_time)
            self.hist_decode.observe(fin.decode_time)
            self.hist_inference.observe(fin.inference_time)
            self.hist_prompt_len.observe(fin.num_prompt_tokens)
            self.hist_gen_len.observe(fin.num_generation_tokens)
            self.hist_params_n.observe(fin.n_param)
            if fin.max_tokens_param is not None:
                self.hist_params_max_tokens.observe(fin.max_tokens_param)
            if fin.num_generation_tokens > 1:
                self.hist_req_tpot.observe(fin.mean_tpot)

    def _record_spec(self, st: Any) -> None:
        """Add one SpecDecodingStats to the vllm:spec_decode_* counters."""
        self.counter_spec_drafts.inc(st.num_drafts)
        self.counter_spec_draft_tokens.inc(st.num_draft_tokens)
        self.counter_spec_accepted.inc(st.num_accepted_tokens)
        for pos, n in enumerate(st.num_accepted_tokens_per_pos):
            self._spec_pos_family.labels(position=str(pos), **self._lv).inc(n)

    def record_rejection(self, reason: str) -> None:
        """Count one request refused by admission control; ``reason`` is one of
        :data:`REJECTION_REASONS`."""
        self.counter_rejected[reason].inc()

    def set_admission_queue(self, receiving: int, waiting: int, in_flight: int) -> None:
        """The admission queue now (from the AdmissionController, on each change): bodies
        arriving, admitted requests waiting, admitted requests in flight."""
        self.gauge_admission_receiving.set(receiving)
        self.gauge_admission_waiting.set(waiting)
        self.gauge_admission_in_flight.set(in_flight)

    def record_deadline_exceeded(self) -> None:
        """Count one request aborted at its deadline."""
        self.counter_deadline.inc()

    def record_engine_restart(self) -> None:
        """One engine restart (called by the self-healing AsyncLLM)."""
        self.counter_engine_restarts.inc()

    def set_engine_stats(self, stats: dict[str, Any]) -> None:
        """Refresh the gauges from a live engine snapshot (``AsyncLLM.get_engine_stats()``:
        num_running_reqs, num_waiting_reqs, kv_cache_usage), e.g. at scrape time, so they
        are right even when no engine step has run since the last change (an abort)."""
        if "num_running_reqs" in stats:
            self.gauge_running.set(stats["num_running_reqs"])
        if "num_waiting_reqs" in stats:
            self.gauge_waiting.set(stats["num_waiting_reqs"])
        if "kv_cache_usage" in stats:
            self.gauge_kv_usage.set(stats["kv_cache_usage"])

    def log(self) -> None:
        """Periodic logging hook of stat loggers (Prometheus is scraped, nothing to do)."""

    def log_engine_initialized(self) -> None:
        """Called once the engine is up (nothing to do)."""

    def render(self) -> bytes:
        """The Prometheus text exposition of this logger's registry; in prometheus_client's
        multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set: several API servers, see
        ``multi_api_server.py``) that of every process's metrics, merged (counters and
        histograms summed, gauges the most recent value), as vLLM."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST
