"""GGUF metadata that transformers' GGUF config reader leaves out, for the architectures
llmserve runs (issue 30): without it a Gemma or Phi-3 GGUF would load with the wrong
soft caps, window pattern, RoPE bases or LongRoPE factors and answer wrongly, silently.

The keys are llama.cpp's (``gguf.constants.Keys``) as ``convert_hf_to_gguf.py`` writes them;
where llama.cpp hard-codes a value instead of writing it, so does this (with the source):
- gemma2 / gemma3: ``attn_logit_softcapping``, ``final_logit_softcapping``;
  ``attention.scale`` if present, else llama.cpp's ``f_attention_scale`` rule
  (``hidden / heads`` for the 27B models: 46 layers for Gemma 2, 62 for Gemma 3; else
  ``head_dim``) as ``query_pre_attn_scalar``; gemma3: ``attention.sliding_window_pattern``
  (llama.cpp's default 6; no sliding layer when the file has no ``attention.sliding_window``),
  ``rope.freq_base_swa`` (default 10000) for sliding layers,
  ``rope.scaling.type`` / ``factor`` for the global ones;
- phi3: ``rope.dimension_count`` (partial rotary), ``rope.scaling.original_context_length``,
  ``rope.scaling.attn_factor`` and the ``rope_factors_long`` / ``rope_factors_short``
  tensors (LongRoPE), ``attention.sliding_window``;
- every architecture: ``attention.key_length`` as ``head_dim`` where the file has it;
- llama / qwen2 / qwen3 / qwen2moe / qwen3moe: ``rope.scaling.*`` (linear, yarn) and the
  ``rope_freqs`` tensor (Llama 3.1's scaling as per-frequency divisors), see _complete_rope;
- qwen2moe / qwen3moe: ``expert_feed_forward_length`` (the experts' width) and, qwen2moe,
  ``expert_shared_feed_forward_length`` (the shared expert's); the top-k normalisation
  llama.cpp hard-codes per architecture.
"""
from __future__ import annotations

from typing import Any, Optional

_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# GGUF ``general.architecture`` values llmserve runs (Mistral files say "llama").
GGUF_ARCHITECTURES = ("gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen2moe", "qwen3", "qwen3moe")
# Whether llama.cpp renormalises the top-k routing weights to sum 1 (the ``norm_w`` argument
# of ``build_moe_ffn`` in src/models/qwen2moe.cpp: false, qwen3moe.cpp: true; the files carry
# no key for it). The same as the released models' config.json: Qwen1.5-MoE-A2.7B and
# Qwen2-57B-A14B have ``norm_topk_prob: false``, Qwen3-30B-A3B / 235B-A22B ``true``.
_QWEN_MOE_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True}


def check_gguf_architecture(gguf_path: str) -> str:
    """The file's ``general.architecture``; ValueError naming it and the supported ones when
    llmserve cannot run it (before transformers reads the rest of the metadata);
    GGUFDamagedError (a ValueError) for a file cut short."""
    from llmserve.model_loader.gguf_loader import GGUFDamagedError, read_gguf_tensors
    try:
        arch = read_gguf_tensors(gguf_path)[0]
    except GGUFDamagedError:  # cut short: said as such, not as transformers' struct.error
        raise
    except Exception:  # an odd file: let transformers' reader say what is wrong with it
        return ""
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} ({gguf_path}) is not supported; supported GGUF "
                         f"architectures: {list(GGUF_ARCHITECTURES)}")
    return arch


# Hyper-parameters llama.cpp's loader requires of every architecture (``llama_model::
# load_hparams``: ``get_key(LLM_KV_CONTEXT_LENGTH)``, ``EMBEDDING_LENGTH`` and ``BLOCK_COUNT``
# with required=true); without them transformers' GGUF reader falls back on its config
# class's defaults (Llama's 4096 wide, 32 layers) and loading failed later on a tensor shape.
REQUIRED_GGUF_KEYS = ("context_length", "embedding_length", "block_count")


def check_gguf_hyperparameters(gguf_path: str) -> None:
    """ValueError naming the ``{arch}.*`` keys of REQUIRED_GGUF_KEYS the file lacks (as
    llama.cpp's "key not found in model"), before a config is built from defaults or taken
    from the start-up cache (an entry an older llmserve wrote for such a file holds those
    defaults). Files of architectures llmserve does not run, and files the fast parser
    cannot read, are left to check_gguf_architecture / transformers to name. Costs one
    header parse a start: 18 ms for the packaged 98 MB SmolLM2 file (median of 7; 120 ms cold)."""
    from llmserve.model_loader.gguf_loader import read_gguf_tensors
    keys = {f"{a}.{k}": None for a in GGUF_ARCHITECTURES for k in REQUIRED_GGUF_KEYS}  # one parse
    try:
        arch = read_gguf_tensors(gguf_path, keys)[0]
    except ValueError:
        return
    if arch not in GGUF_ARCHITECTURES:
        return
    missing = [f"{arch}.{k}" for k in REQUIRED_GGUF_KEYS if keys[f"{arch}.{k}"] is None]
    if missing:
        raise ValueError(f"GGUF file {gguf_path} lacks the metadata key(s) {missing} (llama.cpp refuses it too: "
                         f"'key not found in model'): its writer left out the model's hyper-parameters; "
                         f"convert the checkpoint again with llama.cpp's convert_hf_to_gguf.py")


class _Meta:
    """Typed access to one GGUF file's metadata and small tensors (``gguf.GGUFReader``'s
    fields, read by ``FastGGUFReader``)."""

    def __init__(self, path: str):
        from llmserve.model_loader.gguf_fast_reader import FastGGUFReader
        self.reader = FastGGUFReader(path)
        self.arch = self.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{suffix}", default)

    def tensor(self, name: str) -> Optional[list[float]]:
        for t in self.reader.tensors:
            if t.name == name:
                return [float(x) for x in t.data.reshape(-1)]
        return None


def complete_gguf_config(config: Any, gguf_path: str) -> Any:
    """Fill in ``config`` (from ``AutoConfig.from_pretrained(..., gguf_file=...)``) with the
    metadata above for gemma2 / gemma3 / phi3 / qwen2moe / qwen3moe files; other architectures
    are returned as they are. Returns ``config`` (changed in place), or for a ``llama`` file
    with experts (Mixtral) a new ``MixtralConfig``."""
    meta = _Meta(gguf_path)
    _complete_head_dim(config, meta)
    if meta.arch in _ROPE_SCALED_ARCHS:
        _complete_rope(config, meta)
    if meta.arch in ("gemma2", "gemma3"):
        _complete_gemma(config, meta)
    elif meta.arch == "phi3":
        _complete_phi3(config, meta)
    elif meta.arch in _QWEN_MOE_NORM_TOPK:
        _complete_qwen_moe(config, meta)
    elif meta.arch == "llama" and int(meta.arch_key("expert_count", 0) or 0) > 0:
        return _as_mixtral(config, meta)
    return config


def _complete_head_dim(config: Any, meta: _Meta) -> None:
    """``{arch}.attention.key_length`` (llama.cpp's ``n_embd_head_k``), where the file has
    it, as ``head_dim``: transformers' GGUF reader (5.x ``integrations/ggml.py``) maps it for
    qwen3_moe and gemma2/3 but not for qwen3 or llama (Mistral Nemo's files: 128, not
    hidden / heads), so the config class's default stood in (Qwen3Config's 128) and a file
    of another head size failed to load on a tensor shape."""
    key_length = meta.arch_key("attention.key_length")
    if key_length:
        config.head_dim = int(key_length)


# Architectures whose RoPE scaling transformers' GGUF reader drops (it keeps only
# ``rope.freq_base``); Gemma 3 and Phi-3 read theirs in their own functions below.
_ROPE_SCALED_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")


def _complete_rope(config: Any, meta: _Meta) -> None:
    """RoPE scaling as ``convert_hf_to_gguf.py`` writes it, which transformers' GGUF reader
    left out, so such files ran unscaled RoPE and answered wrongly from the 2nd token:
    - ``rope_freqs.weight`` (Llama 3.1 / 3.2 / 3.3's ``llama3`` scaling: the converter stores
      one divisor per frequency and llama.cpp divides by it at every position) as
      ``config.rope_freq_factors``, which the models' RoPE divides by the same way;
    - ``rope.scaling.type`` ``linear`` / ``yarn`` with ``rope.scaling.factor`` (and
      ``original_context_length``, YaRN's ``yarn_beta_fast`` / ``yarn_beta_slow`` /
      ``yarn_attn_factor``) as ``rope_parameters``, as in the checkpoint's config.json
      (:func:`_scaled_rope`).
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", float(meta.arch_key("rope.freq_base", 10000.0)))
    if _scaled_rope(params, meta):
        config.rope_parameters = params
    factors = meta.tensor("rope_freqs.weight")
    if factors is not None and any(f != 1.0 for f in factors):
        config.rope_freq_factors = factors


# YaRN keys convert_hf_to_gguf.py writes from a config.json's rope parameters, and the
# parameter each came from (its attention_factor is transformers' cos/sin factor).
_YARN_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_attn_factor": "attention_factor"}


def _scaled_rope(params: dict, meta: _Meta) -> bool:
    """``rope.scaling.*`` of a ``linear`` or ``yarn`` file into ``params`` (rope_type,
    factor, original_max_position_embeddings, YaRN's betas and attention factor); False,
    leaving ``params`` alone, for a file without such scaling."""
    kind, factor = meta.arch_key("rope.scaling.type"), meta.arch_key("rope.scaling.factor")
    if kind not in ("linear", "yarn") or not factor or float(factor) == 1.0:
        return False
    params.update(rope_type=kind, factor=float(factor))
    orig = meta.arch_key("rope.scaling.original_context_length")
    if orig:
        params["original_max_position_embeddings"] = int(orig)
    for key, name in _YARN_KEYS.items():
        value = meta.arch_key(f"rope.scaling.{key}") if kind == "yarn" else None
        if value is not None:
            params[name] = float(value)
    return True


def _as_mixtral(config: Any, meta: _Meta) -> Any:
    """A ``llama`` GGUF file with ``llama.expert_count`` experts is Mixtral (llama.cpp writes
    Mixtral under the llama architecture): a ``MixtralConfig`` with the llama config's
    fields, ``num_local_experts`` and ``num_experts_per_tok`` (``llama.expert_used_count``)."""
    from transformers import MixtralConfig

    fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
    return MixtralConfig(**fields, num_local_experts=int(meta.arch_key("expert_count")),
                         num_experts_per_tok=int(meta.arch_key("expert_used_count", 2)),
                         architectures=["MixtralForCausalLM"])


def _complete_qwen_moe(config: Any, meta: _Meta) -> None:
    """The expert widths transformers' GGUF reader leaves at its config class defaults
    (Qwen2MoeConfig's 1408 / 5632, whatever the file says), llama.cpp's routing
    normalisation, and every layer sparse: llama.cpp's qwen2moe / qwen3moe load a router
    and experts in every block (no ``mlp_only_layers`` / ``decoder_sparse_step`` key).
    Without ``expert_feed_forward_length`` (files converted before llama.cpp's PR #7835)
    the widths are llama.cpp's fallbacks: ``feed_forward_length / expert_used_count`` for
    the experts, ``feed_forward_length`` for the shared expert."""
    n_ff = int(meta.arch_key("feed_forward_length", 0) or config.intermediate_size)
    used = int(meta.arch_key("expert_used_count", 0) or config.num_experts_per_tok)
    config.moe_intermediate_size = int(meta.arch_key("expert_feed_forward_length", 0) or n_ff // used)
    if meta.arch == "qwen2moe":
        config.shared_expert_intermediate_size = int(meta.arch_key("expert_shared_feed_forward_length", 0) or n_ff)
    config.norm_topk_prob = _QWEN_MOE_NORM_TOPK[meta.arch]
    config.mlp_only_layers = []
    config.decoder_sparse_step = 1


def _complete_gemma(config: Any, meta: _Meta) -> None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = meta.arch_key(key)
        if value is not None or meta.arch == "gemma3":
            setattr(config, key, float(value) if value else None)
    scale = meta.arch_key("attention.scale")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if scale:
        config.query_pre_attn_scalar = int(round(float(scale) ** -2))  # an int in HF configs
    elif config.num_hidden_layers == _GEMMA_27B_LAYERS[meta.arch]:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = head_dim
    n = config.num_hidden_layers
    if meta.arch == "gemma2":
        config.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        return
    pattern = meta.arch_key("attention.sliding_window_pattern", 6)
    if not meta.arch_key("attention.sliding_window"):
        # No window in the file: llama.cpp's gemma3 runs every layer global (swa_type NONE; its
        # pattern default of 6 applies only with a window), global RoPE base included.
        # convert_hf_to_gguf.py leaves the key out for checkpoints whose
        # ``sliding_window_pattern`` is 1; the pattern of 6 made 5 of 6 layers slide over
        # Gemma3TextConfig's default 4096 with the local RoPE base, wrong from the 2nd token.
        config.layer_types = ["full_attention"] * n
    elif isinstance(pattern, list):  # one flag per layer (llama.cpp's swa_layers), True = sliding
        config.layer_types = ["sliding_attention" if f else "full_attention" for f in pattern]
    else:
        config.layer_types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                              for i in range(n)]
    full = {"rope_type": "default", "rope_theta": float(meta.arch_key("rope.freq_base", 1e6))}
    _scaled_rope(full, meta)  # the global layers' linear or YaRN scaling
    config.rope_parameters = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default",
                              "rope_theta": float(meta.arch_key("rope.freq_base_swa", 10000.0))}}


def _complete_phi3(config: Any, meta: _Meta) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", float(meta.arch_key("rope.freq_base", 10000.0)))
    rot = meta.arch_key("rope.dimension_count")
    if rot:
        params["partial_rotary_factor"] = int(rot) / head_dim
    window = meta.arch_key("attention.sliding_window")
    if window:
        config.sliding_window = int(window)
    long, short = meta.tensor("rope_factors_long.weight"), meta.tensor("rope_factors_short.weight")
    orig = meta.arch_key("rope.scaling.original_context_length")
    if long is not None and short is not None:
        params.update(rope_type="longrope", long_factor=long, short_factor=short)
        if orig:
            params["original_max_position_embeddings"] = int(orig)
            config.original_max_position_embeddings = int(orig)
        attn_factor = meta.arch_key("rope.scaling.attn_factor")
        if attn_factor:
            params["attention_factor"] = float(attn_factor)
    config.rope_parameters = params


# Token texts llama.cpp's vocabulary loader (llama-vocab.cpp) adds to its end-of-generation
# set whatever the metadata says, for every architecture: Phi-3's <|end|> and
# <|endoftext|>, Gemma's <end_of_turn>, ChatML's <|im_end|> (Qwen, SmolLM2), Llama 3's
# <|eot_id|> / <|eom_id|> / <|end_of_text|>, CodeLlama's <EOT>. A Qwen file whose EOS is
# <|endoftext|> (some conversions) stops at <|im_end|> in llama-server; it ran on here.
_EOG_TEXTS = ("<|end|>", "<|endoftext|>", "<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>")


def gguf_eos_token_ids(gguf_path: str) -> tuple[int, ...]:
    """Stop ids of a GGUF file besides its EOS (the ids llama-server stops at):
    ``tokenizer.ggml.eot_token_id`` / ``eom_token_id`` when set, and the vocabulary's
    end-of-turn tokens by text (``_EOG_TEXTS``; converted files often leave
    ``eot_token_id`` out). A GGUF carries no generation_config.json, whose
    ``eos_token_id`` list plays this part for HF directories. Sorted tuple."""
    from llmserve.model_loader.gguf_loader import read_gguf_tensors
    meta: dict = {"tokenizer.ggml.eot_token_id": None, "tokenizer.ggml.eom_token_id": None,
                  "tokenizer.ggml.tokens": None}
    read_gguf_tensors(gguf_path, meta)
    ids = {v for k, v in meta.items() if k != "tokenizer.ggml.tokens" and isinstance(v, int)}
    ids |= {i for i, text in enumerate(meta["tokenizer.ggml.tokens"] or []) if text in _EOG_TEXTS}
    return tuple(sorted(ids))
