"""What a model may do and how it pools (vLLM's ``--runner``/``--convert`` and
``PoolerConfig``), read once when the engine config is built.

``runner="auto"`` picks from the architecture, as vLLM: an encoder (``BertModel``...) is a
pooling model, a ``*ForCausalLM`` generates. ``convert="embed"`` (implied for a causal LM
run with ``runner="pooling"``) pools the last token and normalises, as vLLM's
``as_embedding_model``. An encoder pools as its sentence-transformers files say
(``modules.json``, ``1_Pooling/config.json``, a ``Normalize`` module).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("LAST", "CLS", "MEAN")

#: Encoder-only architectures (non-causal attention over the whole prompt).
ENCODER_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")


@dataclass(frozen=True)
class PoolerConfig:
    """pooling_type: "LAST", "CLS" or "MEAN" over the prompt's final hidden states;
    normalize: L2-normalise by default (a request's ``normalize`` overrides);
    is_matryoshka / matryoshka_dimensions: whether ``dimensions`` may shorten the vector."""

    pooling_type: str = "LAST"
    normalize: bool = True
    is_matryoshka: bool = False
    matryoshka_dimensions: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)}, got {self.pooling_type!r}")


def is_encoder_only(hf_config: Any) -> bool:
    """True for the encoder architectures (bidirectional attention, no KV cache kept)."""
    return any(a in ENCODER_ARCHITECTURES for a in getattr(hf_config, "architectures", None) or ())


def resolve_runner(runner: str, convert: str, hf_config: Any) -> str:
    """"generate" or "pooling". Raises ValueError (naming ``runner``/``convert``) for an
    unknown value, an encoder asked to generate, or ``convert`` with the generate runner."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {list(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {list(CONVERTS)}, got {convert!r}")
    if convert == "classify":
        raise ValueError("convert='classify' is not supported by this engine yet (use 'embed').")
    encoder = is_encoder_only(hf_config)
    if runner == "auto":
        runner = "pooling" if encoder or convert == "embed" else "generate"
    if runner == "generate" and encoder:
        raise ValueError(f"runner='generate': {list(hf_config.architectures)} is an encoder model, which cannot "
                         "generate text; use --runner pooling.")
    if runner == "generate" and convert == "embed":
        raise ValueError("convert='embed' needs runner='pooling' (or 'auto').")
    return runner


def _read_json(path: str) -> Optional[Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_pooler_config(model_dir: Optional[str], hf_config: Any) -> PoolerConfig:
    """The pooler of a pooling model. Encoders: the sentence-transformers files of
    ``model_dir`` when present (mean/CLS/last, Normalize module), else CLS unnormalised
    as vLLM's default for a bare BERT; causal LMs: last token, normalised (vLLM's embed
    conversion). A ``config_sentence_transformers.json`` may list Matryoshka dimensions."""
    if not is_encoder_only(hf_config):
        return PoolerConfig("LAST", True)
    if not model_dir or not os.path.isdir(model_dir):
        return PoolerConfig("CLS", False)
    modules = _read_json(os.path.join(model_dir, "modules.json")) or []
    pooling_type, normalize = "CLS", False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind.endswith("Pooling"):
            cfg = _read_json(os.path.join(model_dir, m.get("path", ""), "config.json")) or {}
            if cfg.get("pooling_mode_mean_tokens"):
                pooling_type = "MEAN"
            elif cfg.get("pooling_mode_lasttoken"):
                pooling_type = "LAST"
            else:
                pooling_type = "CLS"
        elif kind.endswith("Normalize"):
            normalize = True
    st = _read_json(os.path.join(model_dir, "config_sentence_transformers.json")) or {}
    dims = st.get("matryoshka_dimensions")
    return PoolerConfig(pooling_type, normalize, bool(dims) or bool(getattr(hf_config, "is_matryoshka", False)),
                        tuple(dims) if dims else None)
