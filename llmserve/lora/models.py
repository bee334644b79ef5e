"""Reading LoRA adapters: PEFT directories and llama.cpp GGUF LoRA files -> ``LoRAAdapter``.

A PEFT directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``...) and ``adapter_model.safetensors`` (or ``adapter_model.bin``) with
``...layers.{i}.self_attn.q_proj.lora_A.weight [r, in]`` / ``lora_B.weight [out, r]``.
A GGUF LoRA (llama.cpp's ``convert_lora_to_gguf.py``) has ``general.type = "adapter"``,
``adapter.type = "lora"``, ``adapter.lora.alpha`` and tensors
``blk.{i}.attn_q.weight.lora_a [r, in]`` / ``.lora_b [out, r]``, the q/k B rows permuted as
llama.cpp permutes Llama's q/k weights (undone here). The scale is PEFT's:
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).

Everything the engine cannot honour is refused with a ``LoRAAdapterError`` naming the
field: a rank above ``max_lora_rank`` (``r``), ``modules_to_save``, an unknown target
(``target_modules``), DoRA (``use_dora``) and the other forward-changing PEFT options
(``lora_bias``, ``alora_invocation_tokens``, ``layer_replication``...: ``_UNSUPPORTED_VARIANTS``),
trained biases (``bias``), per-module rank or alpha patterns, a missing or unreadable file
(``lora_path``)."""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from llmserve.lora.errors import LoRAAdapterError

# HF projection -> (fused module of llmserve's Llama layer, slice index in it).
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_GGUF_TARGETS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                 "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# PEFT LoraConfig fields that change what an adapter computes at inference beyond A, B and
# the scale (peft 0.21's "is_lora_variant" fields, less VeLoRA, which changes only the
# backward pass; plus the other forward-changing fields). Refused by name: run as plain
# LoRA, such an adapter gives other tokens than peft does, and its extra tensors would
# otherwise be refused under a misleading name (lora_B.bias as an unsupported target).
_UNSUPPORTED_VARIANTS = {
    "use_dora": "DoRA",
    "lora_bias": "a trained bias on lora_B",
    "alora_invocation_tokens": "activated LoRA: applied only after the invocation tokens",
    "layer_replication": "layers repeated into a deeper model",
    "trainable_token_indices": "trained embedding rows",
    "target_parameters": "LoRA on parameters rather than linear modules",
    "use_qalora": "QALoRA: lora_A on pooled inputs",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing over adapters",
    "kasa_config": "KaSA: singular values between A and B",
    "monteclora_config": "MonteCLoRA: sampled factors",
}
_PEFT_RE = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_(A|B)(?:\.default)?\.weight$")
_GGUF_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight\.lora_(a|b)$")


@dataclass
class LoRAAdapter:
    """One adapter's weights: ``weights[(layer, hf_target)] = (A [r, in], B [out, r] * scale)``
    in float32 (the scale folded into B), ``rank`` the largest r. ``source``: "peft" or "gguf".
    ``packed``: the same weights in the wrapped layers' slot layout, ``(layer, module) -> (a, b)``
    (``LoRAModelManager.read`` fills it off the step loop; a slot write is then two copies)."""

    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    source: str = "peft"
    packed: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def targets(self) -> set[str]:
        return {t for _, t in self.weights}


def load_adapter(path: str, max_lora_rank: int) -> LoRAAdapter:
    """Read the adapter at ``path`` (a PEFT directory or a ``.gguf`` file). Raises
    LoRAAdapterError naming the field at fault."""
    if not path or not os.path.exists(path):
        raise LoRAAdapterError(f"lora_path {path!r} does not exist", "lora_path")
    if os.path.isdir(path):
        return _load_peft(path, max_lora_rank)
    if path.endswith(".gguf"):
        return _load_gguf(path, max_lora_rank)
    raise LoRAAdapterError(f"lora_path {path!r} is neither a PEFT adapter directory nor a .gguf file", "lora_path")


def _read_peft_config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoRAAdapterError(f"lora_path {path!r} has no adapter_config.json", "lora_path") from None
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"adapter_config.json of {path!r} is not valid JSON: {e}", "lora_path") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"adapter_config.json of {path!r} is not a JSON object", "lora_path")
    return cfg


def _check_peft_config(cfg: dict, max_lora_rank: int) -> tuple[int, float]:
    """(r, scale) of a PEFT config, or LoRAAdapterError naming the field refused."""
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAAdapterError(f"peft_type {peft_type!r} is not supported (only LORA)", "peft_type")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(f"modules_to_save {cfg['modules_to_save']} is not supported: the adapter "
                               "replaces whole modules, which a batch shared with other adapters cannot do",
                               "modules_to_save")
    for name, what in _UNSUPPORTED_VARIANTS.items():
        if cfg.get(name):
            raise LoRAAdapterError(f"{name}={cfg[name]!r} ({what}) is not supported: the engine runs plain "
                                   "LoRA (x A^T B^T scale)", name)
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAAdapterError(f"bias={cfg['bias']!r} is not supported (only 'none')", "bias")
    for name in ("rank_pattern", "alpha_pattern"):
        if cfg.get(name):
            raise LoRAAdapterError(f"{name} (per-module ranks or alphas) is not supported", name)
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoRAAdapterError(f"r must be a positive integer, got {r!r}", "r")
    check_rank(r, max_lora_rank)
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"lora_alpha must be a number, got {alpha!r}", "lora_alpha")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scale)


def check_rank(r: int, max_lora_rank: int) -> None:
    """LoRAAdapterError (field ``r``) when ``r`` exceeds ``max_lora_rank``."""
    if r > max_lora_rank:
        raise LoRAAdapterError(f"LoRA rank {r} is greater than max_lora_rank {max_lora_rank}", "r")


def _check_targets(cfg: dict) -> None:
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):  # a regex in PEFT: checked per tensor instead
        return
    bad = sorted(t for t in targets if t.rpartition(".")[2] not in TARGETS)
    if bad:
        raise LoRAAdapterError(f"target_modules {bad} are not supported; supported: {sorted(TARGETS)}",
                               "target_modules")


def _read_peft_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    binf = os.path.join(path, "adapter_model.bin")
    try:
        if os.path.exists(st):
            from safetensors.torch import load_file

            return load_file(st)
        if os.path.exists(binf):
            return torch.load(binf, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a corrupt file, whatever the reader raises
        raise LoRAAdapterError(f"cannot read the adapter weights in {path!r}: {type(e).__name__}: {e}",
                               "lora_path") from None
    raise LoRAAdapterError(f"lora_path {path!r} has no adapter_model.safetensors or adapter_model.bin",
                           "lora_path")


def _load_peft(path: str, max_lora_rank: int) -> LoRAAdapter:
    cfg = _read_peft_config(path)
    r, scale = _check_peft_config(cfg, max_lora_rank)
    _check_targets(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in _read_peft_tensors(path).items():
        m = _PEFT_RE.search(name)
        if m is None or m.group(2) not in TARGETS:
            raise LoRAAdapterError(f"adapter tensor {name!r} targets a module that is not supported; "
                                   f"supported: {sorted(TARGETS)}", "target_modules")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    return _assemble(pairs, scale, max_lora_rank, "peft", path)


def _assemble(pairs: dict, scale: float, max_lora_rank: int, source: str, path: str) -> LoRAAdapter:
    out = LoRAAdapter(rank=0, source=source)
    for key, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"adapter {path!r}: layer {key[0]} {key[1]} lacks its lora_A or lora_B",
                                   "lora_path")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoRAAdapterError(f"adapter {path!r}: layer {key[0]} {key[1]} has lora_A {tuple(a.shape)} "
                                   f"and lora_B {tuple(b.shape)}, whose ranks do not match", "lora_path")
        check_rank(a.shape[0], max_lora_rank)
        out.weights[key] = (a.contiguous(), (b * scale).contiguous())
        out.rank = max(out.rank, a.shape[0])
    if not out.weights:
        raise LoRAAdapterError(f"adapter {path!r} has no LoRA weights", "lora_path")
    return out


def _gguf_field(reader, name: str):
    f = reader.fields.get(name)
    return None if f is None else f.contents()


def _load_gguf(path: str, max_lora_rank: int) -> LoRAAdapter:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from llmserve.model_loader.gguf_loader import reverse_permute

    try:
        reader = GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - a corrupt file, whatever the reader raises
        raise LoRAAdapterError(f"cannot read the GGUF file {path!r}: {type(e).__name__}: {e}", "lora_path") from None
    if _gguf_field(reader, "general.type") != "adapter" or _gguf_field(reader, "adapter.type") != "lora":
        raise LoRAAdapterError(f"{path!r} is not a GGUF LoRA adapter (general.type 'adapter', adapter.type "
                               "'lora')", "lora_path")
    alpha = _gguf_field(reader, "adapter.lora.alpha")
    arch = _gguf_field(reader, "general.architecture") or ""
    n_head = _gguf_field(reader, f"{arch}.attention.head_count")
    n_kv = _gguf_field(reader, f"{arch}.attention.head_count_kv") or n_head
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        m = _GGUF_RE.match(t.name)
        target = _GGUF_TARGETS.get(m.group(2)) if m else None
        if target is None:
            raise LoRAAdapterError(f"GGUF LoRA tensor {t.name!r} targets a module that is not supported",
                                   "target_modules")
        w = dequantize(t.data, t.tensor_type)
        if m.group(3) == "b" and arch == "llama" and target in ("q_proj", "k_proj") and n_head:
            w = reverse_permute(w, int(n_head if target == "q_proj" else n_kv))
        pairs.setdefault((int(m.group(1)), target), {})[m.group(3).upper()] = torch.from_numpy(w.copy())
    rank = max((ab["A"].shape[0] for ab in pairs.values() if "A" in ab), default=0)
    scale = float(alpha) / rank if alpha and rank else 1.0  # llama.cpp: alpha / rank (1 without alpha)
    return _assemble(pairs, scale, max_lora_rank, "gguf", path)


def permute_for_gguf(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row permutation (``convert_hf_to_gguf.LlamaModel.permute``)."""
    shape = w.shape
    return w.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def write_gguf_lora(peft_dir: str, out_path: str, hf_config, outtype: str = "f32") -> str:
    """Write the PEFT adapter at ``peft_dir`` as a GGUF LoRA in ``convert_lora_to_gguf.py``'s
    layout (arch from ``hf_config.model_type``; Llama/Mistral q/k B rows permuted as
    llama.cpp does). ``outtype``: "f32" or "f16". Returns ``out_path``."""
    import gguf
    import numpy as np

    cfg = _read_peft_config(peft_dir)
    arch = "llama" if hf_config.model_type in ("llama", "mistral") else hf_config.model_type
    n_head = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_head
    names = {v: k for k, v in _GGUF_TARGETS.items()}
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(cfg.get("lora_alpha", cfg["r"])))
    writer.add_uint32(f"{arch}.attention.head_count", n_head)
    writer.add_uint32(f"{arch}.attention.head_count_kv", n_kv)
    np_type = np.float16 if outtype == "f16" else np.float32
    for name, tensor in sorted(_read_peft_tensors(peft_dir).items()):
        m = _PEFT_RE.search(name)
        layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
        w = tensor.float()
        if ab == "B" and arch == "llama" and target in ("q_proj", "k_proj"):
            w = permute_for_gguf(w, n_head if target == "q_proj" else n_kv)
        writer.add_tensor(f"blk.{layer}.{names[target]}.weight.lora_{ab.lower()}",
                          np.ascontiguousarray(w.numpy().astype(np_type)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
