"""Model runner: turns a SchedulerOutput into one forward pass over the paged KV cache,
then hands the hidden states to a head (vLLM's GPUModelRunner, for CPU and CUDA).

``execute_model`` runs named stages:
1. ``_prepare_inputs``: flatten the mixed batch (decodes first, then prompt chunks) into
   input ids [T], positions [T], a slot mapping [T] and block tables [B, max_blocks];
   pick the rows that need logits (the last token of each request that samples, plus
   prompt positions when prompt logprobs are asked for).
2. ``_forward``: the model -> hidden states [T, hidden].
3. ``_compute_logits``: the LM head on the picked rows only.
4. the head: ``_prompt_logprobs``, then ``_apply_grammar`` (structured outputs: the
   step's grammar bitmask sets forbidden tokens of constrained sample rows to -inf, as
   vLLM does before its sampler, so those rows' logprobs are of the masked distribution)
   and ``_sample`` (a pooler head takes the hidden states instead for pooling requests);
5. packing into ``ModelRunnerOutput``.
The runner knows no process or client: it imports only the ground-floor types.
"""
from __future__ import annotations

import logging
import mmap
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from llmserve.attention.backend import AttentionMetadata
from llmserve.config import EngineConfig
from llmserve.core.outputs import LogprobsLists, ModelRunnerOutput
from llmserve.core.sched_output import SchedulerOutput
from llmserve.sample import Sampler, SamplingMetadata, compute_prompt_logprobs
from llmserve.ops.batch_invariant import MIN_INVARIANT_ROWS, min_gemm_rows
from llmserve.ops.huge_pages import libc_madvise  # cached: prefault_kv calls it 2 * num_layers times a chunk
from llmserve.sample.metadata import SamplingRequestState, make_generator
from llmserve.worker.kv_cache_groups import (KVCacheLayout, add_group_metadata, assign_kv_cache_groups,
                                             layout_for_model)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _ReqState:
    __slots__ = ("sampling", "prompt_lp_next", "num_prompt_tokens")

    def __init__(self, sampling: SamplingRequestState, num_prompt_tokens: int) -> None:
        self.sampling = sampling
        self.prompt_lp_next = 0  # next prompt position whose prompt logprob is not yet sent
        self.num_prompt_tokens = num_prompt_tokens


@dataclass(slots=True)
class _Planned:
    """One scheduled request's part of the step: prompt-logprob positions ``plp``
    ((lo, hi) or None) at logit rows [plp_start, + plp_count), and its sample row (-1: the
    step ends inside its prompt)."""

    req: object
    st: _ReqState
    plp: Optional[tuple[int, int]]
    plp_start: int
    plp_count: int
    sample_row: int
    # Speculative decoding: the draft tokens verified this step; their logit rows follow
    # sample_row (sample/rejection_sampler.py).
    draft: Optional[list] = None
    # An embedding of a generating model (``PoolingParams.hidden_state_embed``): the
    # hidden-state row of its last prompt token (-1: none); it samples nothing.
    pool_row: int = -1


@dataclass
class StepInputs:
    """What ``_prepare_inputs`` builds for one step: model inputs (token ids and positions
    [T] int64, attention metadata), the hidden-state rows that need logits, and the plan
    of each request."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logit_rows: list[int]
    plan: list[_Planned]


def _lora_id(req) -> int:
    """The request's adapter id (0: the base model)."""
    lora = getattr(req, "lora_request", None)
    return lora.lora_int_id if lora is not None else 0


def _madvise(addr: int, length: int, advice: int) -> bool:
    """libc madvise; False when it fails or there is no libc."""
    fn = libc_madvise()
    return fn is not None and fn(addr, length, advice) == 0


def _advise_huge_pages(addr: int, nbytes: int, huge_pages: bool = True) -> None:
    """madvise(MADV_HUGEPAGE, or MADV_NOHUGEPAGE with ``huge_pages`` False) on the 2
    MiB-aligned part of ``[addr, addr + nbytes)``, where huge pages can be, so first writes
    to the KV cache fault in 2 MiB pages instead of 4 KiB ones (measured: the 4 KiB faults
    cost ~5% of a 256-prompt throughput run). Linux only; no-op elsewhere."""
    huge = 2 << 20
    start = (addr + huge - 1) // huge * huge
    length = (addr + nbytes - start) // huge * huge
    if length > 0:
        _madvise(start, length, 14 if huge_pages else 15)  # MADV_HUGEPAGE / MADV_NOHUGEPAGE


def _pool_hidden_rows(hidden: torch.Tensor, plan: list, out: ModelRunnerOutput) -> None:
    """The embeddings of this step's pooling requests on a generating model: each one's
    last prompt token's final hidden state (vLLM's embed conversion of a causal LM: LAST
    pooling), its first ``dimensions`` values, L2-normalised unless ``normalize`` is
    False; float32 on the CPU in ``out.pooler_output``."""
    for p in plan:
        if p.pool_row < 0:
            continue
        params = p.req.pooling_params
        v = hidden[p.pool_row].float()
        if params.dimensions is not None:
            v = v[:params.dimensions]
        if params.normalize is not False:
            v = torch.nn.functional.normalize(v, p=2, dim=-1)
        out.pooler_output[p.req.request_id] = v.cpu()


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler.

    KV cache: one tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim],
    in the model dtype or the narrower ``--kv-cache-dtype`` (``kv_dtype``).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        self.model_config = mc
        self.device = torch.device(mc.device)
        self.dtype = _DTYPES[mc.dtype]
        # The KV cache's dtype (--kv-cache-dtype, CacheConfig.kv_dtype): the model's, or 16-bit
        # under float32 activations.
        self.kv_dtype = _DTYPES[config.cache_config.kv_dtype(mc)]
        self.block_size = config.cache_config.block_size
        self.model: Optional[torch.nn.Module] = None
        self.lora_manager = None  # llmserve.lora.worker_manager.LoRAModelManager with enable_lora
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        self.pooler = None
        if mc.runner == "pooling":  # the head is a pooler instead of the sampler
            from llmserve.worker.pooler import make_pooler
            self.pooler = make_pooler(mc.pooler_config)
        self.states: dict[str, _ReqState] = {}
        self.encoder_cache = None  # encoder-decoder models: cross-attention K/V per request
        if mc.is_encoder_decoder:
            from llmserve.worker.encoder_cache import EncoderCache
            self.encoder_cache = EncoderCache(self.device)
        self.eos_token_id: Optional[int] = None
        # KV heads held here: all of them, or this rank's share under tensor parallel.
        self.num_kv_heads = mc.num_kv_heads
        # The worker side of a KV connector (llmserve/kv_transfer), built with the KV cache.
        self.kv_connector = None
        if config.num_threads:
            torch.set_num_threads(config.num_threads)

    def load_model(self, pack_weights: bool = True) -> None:
        """Load the model; ``pack_weights=False`` leaves the linears dense (tensor-parallel
        workers shard them first, then pack: ``onednn_linear.pack_model``)."""
        from llmserve.model_loader import get_model

        t0 = time.perf_counter()
        torch.manual_seed(self.model_config.seed)
        self.model = get_model(self.model_config, pack_weights=pack_weights)
        if getattr(self, "_kv_layout", None) is not None:  # woken from sleep: the same groups
            assign_kv_cache_groups(self.model, self._kv_layout)
        if pack_weights:  # one worker; tensor-parallel workers wrap their shards (Worker.load_model)
            self.init_lora()
        logger.info("Loaded %s (%s) in %.1f s", self.model_config.model, self.model_config.dtype,
                    time.perf_counter() - t0)

    def init_lora(self) -> None:
        """With ``enable_lora``, wrap the model's linears for adapters (llmserve/lora)."""
        if self.config.lora_config is not None:
            from llmserve.lora.worker_manager import LoRAModelManager

            self.lora_manager = LoRAModelManager(self.model, self.config.lora_config, self.dtype, self.device)

    def lora_model_manager(self):
        """The LoRA manager; LoRAAdapterError (``enable_lora``) when LoRA is off."""
        if self.lora_manager is None:
            from llmserve.lora.errors import LoRAAdapterError

            raise LoRAAdapterError("LoRA is not enabled (enable_lora)", "enable_lora")
        return self.lora_manager

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one KV block: K and V of ``block_size`` tokens in each KV tensor (every
        layer, or a hybrid model's layers per group: ``worker/kv_cache_groups.py``)."""
        per_token = self.num_kv_heads * self.model_config.head_dim * self.kv_dtype.itemsize
        return 2 * self.kv_cache_layout().num_slots * self.block_size * per_token

    def kv_cache_layout(self) -> KVCacheLayout:
        """The KV cache groups of the model (``worker/kv_cache_groups.layout_for_model``),
        planned once the model is loaded and kept across sleep mode (a reloaded model's
        layers are told their groups again by ``load_model``)."""
        layout = getattr(self, "_kv_layout", None)
        if layout is None:
            layout = layout_for_model(self.model, self.config)
            if self.model is not None:
                self._kv_layout = layout
        return layout

    def kv_cache_group_windows(self) -> list[Optional[int]]:
        """The window (None: full attention) of each KV cache group (``kv_cache_layout``):
        one group of ``kv_cache_sliding_window``, or a hybrid model's groups."""
        return list(self.kv_cache_layout().group_windows)

    def kv_cache_sliding_window(self) -> Optional[int]:
        """Tokens back from each query past which no layer of the model reads the paged KV
        cache: the largest window when every ``PagedAttention`` layer has one (Mistral
        v0.1, Phi-3), else None (a full-attention layer, e.g. Gemma 2/3's global ones,
        reads every block; they have several groups, ``kv_cache_group_windows``). The
        scheduler frees the blocks this window has left."""
        windows = self.kv_cache_layout().group_windows
        return windows[0] if len(windows) == 1 else None

    def determine_num_blocks(self) -> int:
        """Number of KV blocks that fit in ``kv_cache_memory_bytes`` (or the override).
        An encoder keeps no KV: its block count is nominal (one max_model_len sequence)."""
        cc = self.config.cache_config
        if self.model_config.is_encoder_only:
            return -(-self.model_config.max_model_len // self.block_size) + 1
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        return int(cc.kv_cache_memory_bytes // self.kv_cache_bytes_per_block())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One zeroed ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
        buffer; ``self.kv_caches`` holds its per-layer views. On the CPU it is an
        anonymous mapping of its own (``mmap``) that the OS zero-fills on first touch, so
        start-up does not spend seconds clearing it; pages become resident when blocks are
        first written or when the idle engine prefaults them (``prefault_kv``), and freeing
        the cache (sleep) unmaps it. Not calloc: the engine process raises glibc's
        M_MMAP_THRESHOLD to 1 GiB (core._keep_freed_memory), so a smaller cache came from
        the heap, where calloc clears reused memory with memset: measured, a 128 MiB cache
        after 300 MB of freed temporaries was all resident (131,076 KiB) before any
        request, and a CI run saw the same in the test process."""
        mc = self.model_config
        if mc.is_encoder_only:
            self.kv_caches = []
            return
        layout = self.kv_cache_layout()
        shape = (layout.num_slots, 2, num_blocks, self.block_size, self.num_kv_heads, mc.head_dim)
        if self.device.type == "cpu":
            nbytes = int(np.prod(shape)) * self.kv_dtype.itemsize
            raw = np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)
            # numpy advises huge pages for large arrays; not yet (_maybe_advise_huge_pages).
            _advise_huge_pages(raw.ctypes.data, nbytes, huge_pages=False)
            buf = torch.from_numpy(raw).view(self.kv_dtype).view(shape)
            self._kv_nbytes, self._kv_huge = nbytes, False
            # Prefault cursor (see prefault_kv): 2 * num_slots regions of num_blocks blocks.
            self._kv_addr = raw.ctypes.data
            self._kv_regions = 2 * layout.num_slots
            self._kv_block_bytes = nbytes // (self._kv_regions * num_blocks)
            self._kv_num_blocks = num_blocks
            self._kv_prefault_next = 0
            # The idle prefault stays this many blocks ahead of the highest block used so
            # far, so resident memory follows use instead of the configured size (issue 16).
            self._kv_headroom = max(1, self.KV_PREFAULT_HEADROOM_BYTES // (self._kv_block_bytes * self._kv_regions))
            self._kv_prefault_limit = min(num_blocks, self._kv_headroom)
        else:
            buf = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        slots = buf.unbind(0)  # a hybrid model's layers share them (kv_cache_groups.py)
        self.kv_caches = [slots[j] for j in layout.layer_slot]
        self._init_kv_connector()
        if self.device.type == "cpu":
            self._prefault_for_kv_tier()

    def _prefault_for_kv_tier(self) -> None:
        """With a connector that loads KV (the disk tier), make the first max_model_len
        tokens' blocks past the usual headroom resident now, on a background thread: a
        restarted engine's first disk hit lands in never-written blocks, and faulting them
        in while copying took most of that hit (first writes to 92 MB, 4,000 SmolLM2
        tokens, took 35-270 ms here against ~10 ms of reading). With it the first hit's
        load took 20-36 ms against 44-99 ms before (load ~4; the prefault took 0.41 s on
        its thread). The engine's start does not wait for it (``madvise`` releases the
        GIL); it costs resident memory up front, one sequence's KV (189 MiB for SmolLM2
        at max_model_len 8192)."""
        kvc = self.kv_connector
        if kvc is None or not getattr(kvc, "can_load", False) or getattr(self, "_kv_prefault_next", None) is None:
            return
        blocks = -(-self.model_config.max_model_len // self.block_size) + self._kv_headroom
        self._kv_prefault_limit = max(self._kv_prefault_limit, min(self._kv_num_blocks, blocks))
        addr = self._kv_addr

        def run() -> None:  # until done, or the cache is freed or replaced (sleep mode)
            while self._kv_addr == addr and self.prefault_kv():
                pass

        self._kv_tier_prefault = threading.Thread(target=run, name="kv-tier-prefault", daemon=True)
        self._kv_tier_prefault.start()

    def _init_kv_connector(self) -> None:
        """Build the worker side of ``kv_transfer_config``'s connector over the KV cache."""
        ktc = getattr(self.config, "kv_transfer_config", None)
        if ktc is not None and ktc.is_kv_transfer_instance:
            from llmserve.kv_transfer import KVConnectorFactory, KVConnectorRole

            self.kv_connector = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER)
            self.kv_connector.register_kv_caches(self.kv_caches)

    def shutdown(self) -> None:
        """Flush and stop the KV connector (its pending block writes)."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None

    @staticmethod
    def _load_external_kv(kvc, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """The connector's loads of this step into their blocks; the failed ones in ``out``."""
        kvc.bind_connector_metadata(so.kv_connector_metadata)
        kvc.start_load_kv()
        out.invalid_block_ids = kvc.get_block_ids_with_load_errors()

    # How far (bytes of all layers' K and V) the idle prefault runs ahead of use.
    KV_PREFAULT_HEADROOM_BYTES = 32 << 20

    def _note_kv_use(self, block_tables: np.ndarray) -> None:
        """Let the idle prefault run ``KV_PREFAULT_HEADROOM_BYTES`` past the highest block
        of this step (the free list hands blocks out in id order until it wraps)."""
        if getattr(self, "_kv_prefault_next", None) is None or not block_tables.size:
            return
        limit = min(self._kv_num_blocks, int(block_tables.max()) + 1 + self._kv_headroom)
        if limit > self._kv_prefault_limit:
            self._kv_prefault_limit = limit
            self._maybe_advise_huge_pages()

    # KV in use past which its pages become 2 MiB ones (see _maybe_advise_huge_pages).
    KV_HUGE_PAGES_FROM_BYTES = 256 << 20

    def _maybe_advise_huge_pages(self) -> None:
        """Once the KV in use passes ``KV_HUGE_PAGES_FROM_BYTES``, advise huge pages for the
        whole cache (later first writes fault 2 MiB at a time: 4 KiB faults cost ~5% of a
        256-prompt throughput run). Not from the start: each of the 2 x num_layers
        regions would then hold >= 2 MiB after the first request (120 MiB for SmolLM2)."""
        in_use = self._kv_prefault_limit * self._kv_block_bytes * self._kv_regions
        if not self._kv_huge and in_use >= self.KV_HUGE_PAGES_FROM_BYTES:
            self._kv_huge = True
            _advise_huge_pages(self._kv_addr, self._kv_nbytes)

    def prefault_kv(self, budget_bytes: int = 8 << 20) -> bool:
        """Make the next ``budget_bytes`` of the KV cache resident, in block order (block b
        of every layer's K and V), with ``madvise(MADV_POPULATE_WRITE)``, which faults the
        pages in without changing their contents (blocks already in use are safe). It stops
        ``KV_PREFAULT_HEADROOM_BYTES`` past the highest block used so far, so an idle server
        holds little and memory grows with the blocks the workload uses. The
        engine calls this while it is idle, so a busy engine does not pay page faults the
        first time it writes a block (measured: ~3 s of a 65 s, 256-prompt throughput run;
        vLLM touches its whole KV cache at start-up instead). Returns True while blocks
        remain; False when done or unsupported (non-Linux, kernel < 5.14, not on the CPU).
        Resident memory grows with use, up to the configured KV cache size. A request that arrives
        during a call waits for it to end: 8 MiB takes ~16 ms here on memory the host has
        never backed (~2 s/GiB), so the budget is kept small."""
        nxt = getattr(self, "_kv_prefault_next", None)
        if nxt is None or nxt >= self._kv_prefault_limit:
            return False
        per_call = max(1, budget_bytes // (self._kv_block_bytes * self._kv_regions))
        end = min(self._kv_prefault_limit, nxt + per_call)
        region = self._kv_num_blocks * self._kv_block_bytes
        page = 4096
        for r in range(self._kv_regions):
            lo = (self._kv_addr + r * region + nxt * self._kv_block_bytes) // page * page
            hi = -(-(self._kv_addr + r * region + end * self._kv_block_bytes) // page) * page
            if not _madvise(lo, hi - lo, 23):  # MADV_POPULATE_WRITE
                self._kv_prefault_next = None
                return False
        self._kv_prefault_next = end
        return end < self._kv_prefault_limit

    def kv_prefault_done(self) -> bool:
        """True once ``prefault_kv`` has covered the whole KV cache (False while pages
        remain, or when prefaulting is unsupported here)."""
        return getattr(self, "_kv_prefault_next", None) == getattr(self, "_kv_num_blocks", -1)

    def kv_cache_nbytes(self) -> int:
        """Bytes of the whole KV cache (all layers, K and V)."""
        return sum(t.numel() * t.element_size() for t in self._kv_tensors())

    def _kv_tensors(self) -> list[torch.Tensor]:
        """The distinct KV tensors (a hybrid model's layers share them)."""
        return list({id(t): t for t in self.kv_caches}.values())

    # ---- sleep mode (llmserve/worker/sleep_mode.py) ---------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the weights and the KV cache (vLLM's ``Worker.sleep``); ValueError for a
        level other than 1 or 2. Level 2 also drops the model files from the page cache."""
        from llmserve.worker.sleep_mode import RunnerSleep

        if getattr(self, "_sleep", None) is None:
            self._sleep = RunnerSleep()
        self._sleep.sleep(self, level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Reload what ``sleep`` freed (``tags``: "weights", "kv_cache"; None: both)."""
        if getattr(self, "_sleep", None) is not None:
            self._sleep.wake_up(self, tags)

    def is_sleeping(self) -> bool:
        return bool(getattr(self, "_sleep", None) is not None and self._sleep.asleep)

    # ---- per-request state -------------------------------------------------
    def _state(self, req) -> _ReqState:
        st = self.states.get(req.request_id)
        if st is None:
            sp = req.sampling_params
            gen = make_generator(sp.seed, self.device) if sp.seed is not None and sp.temperature > 0 else None
            st = _ReqState(SamplingRequestState(
                sampling_params=sp, prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids, generator=gen,
                eos_token_id=req.eos_token_id,
                logprobs_temperature=getattr(req, "beam_temperature", 0.0)), req.num_prompt_tokens)
            self.states[req.request_id] = st
        return st

    def remove_requests(self, req_ids) -> None:
        for rid in req_ids:
            self.states.pop(rid, None)
        if self.encoder_cache is not None:
            self.encoder_cache.free(req_ids)

    # ---- step ----------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step: prepare inputs, forward, logits, head (sample / prompt logprobs)."""
        self.remove_requests(so.finished_req_ids)
        if so.blocks_to_copy:
            self._copy_blocks(so.blocks_to_copy)
        if self.pooler is not None:
            from llmserve.worker.pooler import execute_pooling
            return execute_pooling(self, so)
        out = ModelRunnerOutput()
        kvc = self.kv_connector
        if not so.scheduled:
            if kvc is not None and so.kv_connector_metadata is not None:  # a KV tier restore: loads only
                self._load_external_kv(kvc, so, out)
                kvc.clear_connector_metadata()
            return out
        inputs = self._prepare_inputs(so)
        if kvc is not None:  # external KV into this step's blocks before the forward
            self._load_external_kv(kvc, so, out)
        # Logits must not depend on the batch (greedy: issue 10.6, seeded: issue 18): pad GEMMs.
        invariant = self.model_config.batch_invariant or any(
            getattr(s.request.sampling_params, "seed", None) is not None for s in so.scheduled)
        with min_gemm_rows(MIN_INVARIANT_ROWS if invariant else 1):
            hidden = self._forward(inputs)
            if kvc is not None:  # this step's full prompt blocks out to the connector
                kvc.wait_for_save()
                kvc.clear_connector_metadata()
            if self.lora_manager is not None:
                self.lora_manager.end_step()
            _pool_hidden_rows(hidden, inputs.plan, out)
            if not inputs.logit_rows:
                return out
            logits = self._compute_logits(hidden, inputs.logit_rows)
        self._prompt_logprobs(logits, inputs.plan, out)
        if so.grammar_bitmask is not None:
            self._apply_grammar(logits, inputs.plan, so)
        self._sample(logits, inputs.plan, out)
        return out

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked beams' partial blocks: K and V of block src -> dst in
        every layer (core/beam_search.py)."""
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for kv in self._kv_tensors():
            kv[:, dst] = kv[:, src]

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        # Decodes (1 query token) first, then prompt chunks.
        sched = sorted(so.scheduled, key=lambda s: s.num_scheduled_tokens != 1)
        if self.lora_manager is not None:  # one adapter's rows side by side (lora_ops segments)
            sched = sorted(sched, key=lambda s: (s.num_scheduled_tokens != 1, _lora_id(s.request)))
        bs = self.block_size
        B = len(sched)
        T = so.total_num_scheduled_tokens
        num_decodes = 0
        for s in sched:
            if s.num_scheduled_tokens == 1:
                num_decodes += 1
            else:
                break
        max_blocks = max(len(s.block_ids) for s in sched)
        input_ids = np.empty(T, dtype=np.int64)
        positions = np.empty(T, dtype=np.int64)
        block_tables = np.zeros((B, max_blocks), dtype=np.int32)
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        plan: list[_Planned] = []
        t = 0
        for i, s in enumerate(sched):
            req = s.request
            c, n = s.num_computed_tokens, s.num_scheduled_tokens
            toks = req.all_token_ids
            if s.spec_token_ids:  # the real token, then the drafts
                input_ids[t] = toks[c]
                input_ids[t + 1:t + n] = s.spec_token_ids
            else:
                input_ids[t:t + n] = toks[c:c + n] if n > 1 else toks[c]
            positions[t:t + n] = np.arange(c, c + n)
            block_tables[i, :len(s.block_ids)] = s.block_ids
            query_lens.append(n)
            seq_lens.append(c + n)
            st = self._state(req)
            plan_plp, plp_start, plp_count = None, 0, 0
            if req.sampling_params.prompt_logprobs is not None:
                lo = max(c, st.prompt_lp_next)
                hi = min(c + n, st.num_prompt_tokens - 1)
                if hi > lo:
                    plp_start, plp_count = len(logit_rows), hi - lo
                    logit_rows.extend(range(t + lo - c, t + hi - c))
                    st.prompt_lp_next = hi
                    plan_plp = (lo, hi)
            sample_row = -1
            if req.pooling_params is not None:  # its last prompt token pools (in the last chunk)
                plan.append(_Planned(req, st, None, 0, 0, -1, pool_row=t + n - 1 if c + n >= req.num_tokens else -1))
                t += n
                continue
            if s.spec_token_ids:  # logits at the real token and at every draft
                sample_row = len(logit_rows)
                logit_rows.extend(range(t, t + n))
            elif c + n >= req.num_tokens:
                sample_row = len(logit_rows)
                logit_rows.append(t + n - 1)
            plan.append(_Planned(req, st, plan_plp, plp_start, plp_count, sample_row, s.spec_token_ids or None))
            t += n

        self._note_kv_use(block_tables)
        if self.lora_manager is not None:
            self.lora_manager.begin_step([_lora_id(s.request) for s in sched], query_lens)
        slot_mapping = self._slot_mapping(positions, block_tables, query_lens, bs)
        dev = self.device
        md = AttentionMetadata(
            num_actual_tokens=T,
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.from_numpy(block_tables).to(dev),
            num_decodes=num_decodes,
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            max_seq_len=max(seq_lens),
            block_size=bs,
        )
        if sched[0].group_block_ids:  # a hybrid model: each KV cache group's tables
            add_group_metadata(md, [s.group_block_ids for s in sched], positions, query_lens, dev)
        return StepInputs(torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), md,
                          logit_rows, plan)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over the flattened batch: hidden states [T, hidden_size]. An
        encoder-decoder also gets each request's cross-attention K/V (the encoder runs at
        a request's first step)."""
        if self.encoder_cache is not None:
            cross = self.encoder_cache.cross_kv([p.req for p in inputs.plan], self.model)
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata,
                              cross_kv=cross)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)

    def _compute_logits(self, hidden: torch.Tensor, logit_rows: list[int]) -> torch.Tensor:
        """Logits [len(logit_rows), vocab] of the picked hidden-state rows."""
        return self.model.compute_logits(hidden[torch.tensor(logit_rows, device=self.device)])

    def _prompt_logprobs(self, logits: torch.Tensor, plan: list[_Planned], out: ModelRunnerOutput) -> None:
        dev = self.device
        for p in plan:
            if p.plp is None:
                continue
            req = p.req
            lo, hi = p.plp
            targets = torch.tensor(req.prompt_token_ids[lo + 1:hi + 1], dtype=torch.long, device=dev)
            k = req.sampling_params.prompt_logprobs
            k = self.model_config.vocab_size if k == -1 else k
            lt = compute_prompt_logprobs(logits[p.plp_start:p.plp_start + p.plp_count].float(), targets, k)
            out.prompt_logprobs[req.request_id] = LogprobsLists(
                lt.logprob_token_ids.tolist(), lt.logprobs.tolist(), lt.selected_token_ranks.tolist())

    @staticmethod
    def _apply_grammar(logits: torch.Tensor, plan: list[_Planned], so: SchedulerOutput) -> None:
        """Mask the sample rows of constrained requests with their grammar bitmask rows."""
        from llmserve.structured_output.bitmask import apply_grammar_bitmask

        ids = so.structured_output_request_ids
        pairs = [(p.sample_row, ids[p.req.request_id]) for p in plan
                 if p.sample_row >= 0 and p.req.request_id in ids]
        if pairs:
            rows, bm_rows = zip(*pairs)
            apply_grammar_bitmask(logits, so.grammar_bitmask, list(rows), list(bm_rows))

    def _sample(self, logits: torch.Tensor, plan: list[_Planned], out: ModelRunnerOutput) -> None:
        """The sampler head: one token (and its logprobs) per request that samples."""
        sample = [p for p in plan if p.sample_row >= 0]
        if not sample:
            return
        if any(p.draft for p in sample):
            return self._sample_with_drafts(logits, sample, out)
        rows = [p.sample_row for p in sample]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            sample_logits = logits[rows[0]:rows[0] + len(rows)]
        else:
            sample_logits = logits[torch.tensor(rows, device=self.device)]
        meta = SamplingMetadata.build([p.st.sampling for p in sample], self.model_config.vocab_size, self.device)
        so_ = self.sampler(sample_logits.float(), meta)
        tokens = so_.sampled_token_ids.tolist()
        lpt = so_.logprobs_tensors
        if lpt is not None:
            ids_l, lps_l, ranks_l = (lpt.logprob_token_ids.tolist(), lpt.logprobs.tolist(),
                                     lpt.selected_token_ranks.tolist())
        for j, p in enumerate(sample):
            rid = p.req.request_id
            out.sampled_token_ids[rid] = tokens[j]
            k = p.req.sampling_params.logprobs
            if k is not None and lpt is not None:
                k = len(ids_l[j]) - 1 if k == -1 else k
                out.logprobs[rid] = LogprobsLists([ids_l[j][:k + 1]], [lps_l[j][:k + 1]], [ranks_l[j]])

    def _sample_with_drafts(self, logits: torch.Tensor, sample: list[_Planned], out: ModelRunnerOutput) -> None:
        """A step where some request verifies drafts: every request's emitted tokens and
        their logprobs (sample/rejection_sampler.py)."""
        from llmserve.sample.rejection_sampler import sample_and_verify

        entries = [(p.st.sampling, p.draft or [], p.sample_row) for p in sample]
        emitted, lps = sample_and_verify(self.sampler, logits, entries, self.model_config.vocab_size)
        for j, p in enumerate(sample):
            rid = p.req.request_id
            out.sampled_token_ids[rid] = emitted[j][0]
            if p.draft:
                out.spec_token_ids[rid] = emitted[j]
            k = p.req.sampling_params.logprobs
            if k is not None and lps is not None:
                ids, vals, ranks = lps[j]
                k = len(ids[0]) - 1 if k == -1 else k
                out.logprobs[rid] = LogprobsLists([r[:k + 1] for r in ids], [r[:k + 1] for r in vals], ranks)

    @staticmethod
    def _slot_mapping(positions: np.ndarray, block_tables: np.ndarray, query_lens: list[int],
                      bs: int) -> np.ndarray:
        row = np.repeat(np.arange(len(query_lens)), query_lens)
        return block_tables[row, positions // bs].astype(np.int64) * bs + positions % bs
