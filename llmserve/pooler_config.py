"""What a model may do and how it pools (vLLM's ``--runner``/``--convert`` and
``PoolerConfig``), read once when the engine config is built.

``runner="auto"`` picks from the architecture, as vLLM: an encoder (``BertModel``...) or a
``*ForSequenceClassification`` is a pooling model, a ``*ForCausalLM`` generates.
``convert="embed"`` (implied for a causal LM run with ``runner="pooling"``) pools the last
token and normalises, as vLLM's ``as_embedding_model``. An encoder pools as its
sentence-transformers files say (``modules.json``, ``1_Pooling/config.json``, a
``Normalize`` module). ``convert="classify"`` (implied for a ``*ForSequenceClassification``
checkpoint) runs the checkpoint's classification head (``PoolerConfig.task="classify"``,
see ``classifier_pooler_config``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("LAST", "CLS", "MEAN")
#: What the pooler's head does: "embed" (a vector) or "classify" (the checkpoint's head).
HEAD_TASKS = ("embed", "classify")
#: Activations of a classification head (vLLM's PoolerActivation kinds): "classify" is
#: vLLM's PoolerClassify (sigmoid for fewer than 2 labels, else softmax).
ACTIVATIONS = ("classify", "sigmoid", "identity", "tanh")

#: Encoder-only architectures (non-causal attention over the whole prompt).
ENCODER_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification")
#: A sentence-transformers CrossEncoder's ``activation_fn`` -> our activation (vLLM's
#: ``PoolerActivation.wraps``: Sigmoid and Softmax both become PoolerClassify).
_ST_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Sigmoid": "classify",
                   "torch.nn.modules.activation.Softmax": "classify", "torch.nn.modules.activation.Tanh": "tanh"}


@dataclass(frozen=True)
class PoolerConfig:
    """pooling_type: "LAST", "CLS" or "MEAN" over the prompt's final hidden states;
    normalize: L2-normalise by default (a request's ``normalize`` overrides);
    is_matryoshka / matryoshka_dimensions: whether ``dimensions`` may shorten the vector.
    task: "embed" (the pooled vector) or "classify" (the model's classification head on
    the pooled row: ``num_labels`` logits); classify_activation / score_activation: one of
    ACTIVATIONS, applied to the head's logits for ``classify`` and for ``score`` (vLLM's
    ``act_fn="classify"`` / ``act_fn="score"``)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    is_matryoshka: bool = False
    matryoshka_dimensions: Optional[tuple[int, ...]] = None
    task: str = "embed"
    num_labels: int = 0
    classify_activation: str = "classify"
    score_activation: str = "classify"

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.task not in HEAD_TASKS:
            raise ValueError(f"task must be one of {list(HEAD_TASKS)}, got {self.task!r}")
        if self.task == "classify" and self.num_labels < 1:
            raise ValueError(f"num_labels must be >= 1 for a classification model, got {self.num_labels!r}")
        for name in ("classify_activation", "score_activation"):
            if getattr(self, name) not in ACTIVATIONS:
                raise ValueError(f"{name} must be one of {list(ACTIVATIONS)}, got {getattr(self, name)!r}")


def is_encoder_only(hf_config: Any) -> bool:
    """True for the encoder architectures (bidirectional attention, no KV cache kept)."""
    return any(a in ENCODER_ARCHITECTURES for a in getattr(hf_config, "architectures", None) or ())


def is_classification(hf_config: Any) -> bool:
    """True for a sequence-classification checkpoint (``*ForSequenceClassification``: a
    classification head, no LM head), which vLLM runs as a pooling model."""
    return any(a.endswith("ForSequenceClassification") for a in getattr(hf_config, "architectures", None) or ())


def resolve_runner(runner: str, convert: str, hf_config: Any) -> str:
    """"generate" or "pooling". Raises ValueError (naming ``runner``/``convert``) for an
    unknown value, an encoder or classifier asked to generate, ``convert`` with the
    generate runner, or ``convert='classify'`` on a checkpoint without a classification head."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {list(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {list(CONVERTS)}, got {convert!r}")
    encoder, classifier = is_encoder_only(hf_config), is_classification(hf_config)
    if convert == "classify" and not classifier:
        raise ValueError(f"convert='classify' needs a *ForSequenceClassification checkpoint (a classification "
                         f"head); {list(hf_config.architectures or [])} has none.")
    if runner == "auto":
        runner = "pooling" if encoder or classifier or convert in ("embed", "classify") else "generate"
    if runner == "generate" and (encoder or classifier):
        kind = "an encoder model" if encoder else "a sequence-classification model"
        raise ValueError(f"runner='generate': {list(hf_config.architectures)} is {kind}, which cannot "
                         "generate text; use --runner pooling.")
    if runner == "generate" and convert in ("embed", "classify"):
        raise ValueError(f"convert={convert!r} needs runner='pooling' (or 'auto').")
    return runner


def pooling_head_task(convert: str, hf_config: Any) -> str:
    """"classify" or "embed": what a pooling model's head does (vLLM: a
    ``*ForSequenceClassification`` classifies unless ``--convert embed``)."""
    if convert == "classify" or (convert in ("auto", "none") and is_classification(hf_config)):
        return "classify"
    return "embed"


def _read_json(path: str) -> Optional[Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_pooler_config(model_dir: Optional[str], hf_config: Any, convert: str = "auto") -> PoolerConfig:
    """The pooler of a pooling model. Classifiers (see ``pooling_head_task``):
    ``classifier_pooler_config``. Encoders: the sentence-transformers files of
    ``model_dir`` when present (mean/CLS/last; normalised only with a Normalize module),
    else CLS normalised (vLLM's embed default, ``normalize`` True unless the model's
    pooler says otherwise); causal LMs: last token, normalised (vLLM's embed conversion).
    A ``config_sentence_transformers.json`` may list Matryoshka dimensions."""
    if pooling_head_task(convert, hf_config) == "classify":
        return classifier_pooler_config(hf_config)
    if not is_encoder_only(hf_config):
        return PoolerConfig("LAST", True)
    modules = _read_json(os.path.join(model_dir, "modules.json")) if model_dir and os.path.isdir(model_dir) else None
    if not modules:
        return PoolerConfig("CLS", True)
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


def classifier_pooler_config(hf_config: Any) -> PoolerConfig:
    """A ``*ForSequenceClassification``'s pooler, as HF's forward and vLLM's
    ``ClassifierPooler``: BERT pools [CLS] (its ``pooler`` dense + tanh run in the model),
    a decoder its last (non-pad) token; no normalisation. ``classify`` activation from
    ``problem_type`` (vLLM's ``get_classification_activation_function``: regression ->
    identity, multi-label -> sigmoid, else sigmoid for one label / softmax); ``score``
    from the sentence-transformers CrossEncoder's ``activation_fn`` in config.json (vLLM's
    ``get_cross_encoder_activation_function``), else the same PoolerClassify."""
    problem = getattr(hf_config, "problem_type", None) or ""
    classify = {"regression": "identity", "multi_label_classification": "sigmoid"}.get(problem, "classify")
    return PoolerConfig("CLS" if is_encoder_only(hf_config) else "LAST", False, task="classify",
                        num_labels=int(getattr(hf_config, "num_labels", 0) or 0), classify_activation=classify,
                        score_activation=_cross_encoder_activation(hf_config))


def _cross_encoder_activation(hf_config: Any) -> str:
    """The activation of ``sentence_transformers.activation_fn`` (or
    ``sbert_ce_default_activation_function``); "classify" when neither is set. Raises
    ValueError naming the field for a function outside ``_ST_ACTIVATIONS``."""
    st = getattr(hf_config, "sentence_transformers", None) or {}
    name, field = st.get("activation_fn"), "sentence_transformers.activation_fn"
    if name is None:
        name, field = getattr(hf_config, "sbert_ce_default_activation_function", None), \
            "sbert_ce_default_activation_function"
    if name is None:
        return "classify"
    if name not in _ST_ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported; supported: {sorted(_ST_ACTIVATIONS)}")
    return _ST_ACTIVATIONS[name]
