"""compressed-tensors int4/int8 weight-only checkpoints (issue 16): the scheme check, the
loader's exact dequantization and GGUF blocks, and models that run on the packed kernels."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from llmserve.model_loader.compressed_tensors_loader import (iterate_compressed_tensors_weights, quantize_rtn,
                                                             save_rtn_checkpoint, weight_scheme)


def _cfg(weights: dict, **extra) -> SimpleNamespace:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": extra.pop("act", None)}
    return SimpleNamespace(quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                "config_groups": {"group_0": group}, **extra})


W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}


def test_scheme_supported_and_refused_with_the_reason():
    assert weight_scheme(SimpleNamespace()) is None
    assert weight_scheme(SimpleNamespace(quantization_config={"quant_method": "awq"})) is None
    assert weight_scheme(_cfg(W4))["num_bits"] == 4 and weight_scheme(_cfg(W4))["group_size"] == 128
    assert weight_scheme(_cfg({**W4, "strategy": "channel", "group_size": None}))["group_size"] is None
    for bad in ({**W4, "symmetric": False}, {**W4, "num_bits": 3}, {**W4, "group_size": 48}):
        with pytest.raises(ValueError, match="not supported"):
            weight_scheme(_cfg(bad))
    with pytest.raises(ValueError, match="input_activations"):
        weight_scheme(_cfg(W4, act={"num_bits": 8}))


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 64)])
def test_layer_dequantizes_exactly_and_gives_equal_gguf_blocks(bits, group):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from llmserve.ops.quant_ops import get_quant_ops
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(bits)) * 0.05
    q, scale = quantize_rtn(w, bits, group)
    want = (q.float() * scale.float().repeat_interleave(group, dim=1))
    assert (want - w).abs().max() <= scale.float().max() / 2 + 1e-6  # round to nearest
    parts = [("m.layers.0.mlp.down_proj.weight_packed", pack_to_int32(q, bits)),
             ("m.layers.0.mlp.down_proj.weight_scale", scale),
             ("m.layers.0.mlp.down_proj.weight_shape", torch.tensor([48, 256])), ("m.norm.weight", torch.ones(4))]
    packed = {}
    scheme = {"num_bits": bits, "group_size": group, "ignore": []}
    got = dict(iterate_compressed_tensors_weights(iter(parts), scheme, torch.float32, packed))
    assert torch.equal(got["m.layers.0.mlp.down_proj.weight"], want) and "m.norm.weight" in got
    qtype, blocks = packed["m.layers.0.mlp.down_proj.weight"]
    assert qtype == (8 if bits == 8 else 2)
    ops = get_quant_ops()
    if ops is not None:
        assert torch.equal(ops.quant_dequantize(blocks, qtype), want)


@pytest.mark.parametrize("bits", [4, 8])
def test_layers_load_in_a_process_whose_transformers_has_no_torch(bits, tmp_path):
    # The engine process imports transformers with torch hidden (torch_hiding.py); the
    # loader's import of compressed-tensors' unpack_from_int32 then raised NameError ('nn'
    # in transformers' modeling_utils), so `llmserve serve` of a checkpoint written by
    # `python -m llmserve.model_loader.compressed_tensors_loader` failed at start.
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    q, scale = quantize_rtn(torch.randn(8, 96, generator=torch.Generator().manual_seed(bits)), bits, 32)
    torch.save({"packed": pack_to_int32(q, bits), "scale": scale, "want": q.float() * scale.float().repeat_interleave(
        32, dim=1)}, tmp_path / "layer.pt")
    code = f"""
from llmserve.torch_hiding import import_transformers_without_torch
import_transformers_without_torch()
import torch
from llmserve.model_loader.compressed_tensors_loader import iterate_compressed_tensors_weights
d = torch.load({str(tmp_path / "layer.pt")!r})
parts = [("l.weight_packed", d["packed"]), ("l.weight_scale", d["scale"]), ("l.weight_shape", torch.tensor([8, 96]))]
got = dict(iterate_compressed_tensors_weights(iter(parts), {{"num_bits": {bits}, "group_size": 32, "ignore": []}},
                                              torch.float32))
print("equal", torch.equal(got["l.weight"], d["want"]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["equal", "True"]


def test_writer_refuses_what_the_engine_does_not_run():
    from llmserve.model_loader.compressed_tensors_loader import main
    for bits, group in ((3, 32), (8, 48), (4, 0), (4, 128)):  # 128 does not divide 96
        with pytest.raises(ValueError, match="group_size a multiple of 32"):
            quantize_rtn(torch.randn(4, 96), bits, group)
    assert main([]) == 2 and main(["a", "b", "x"]) == 2


def test_missing_part_is_an_error():
    scheme = {"num_bits": 4, "group_size": 32, "ignore": []}
    with pytest.raises(ValueError, match="missing parts"):
        list(iterate_compressed_tensors_weights(iter([("a.weight_packed", torch.zeros(2, 4, dtype=torch.int32))]),
                                                scheme, torch.float32))


@pytest.fixture(scope="module")
def tiny_w4(tmp_path_factory, save_tiny_model_fn):
    """A tiny llama as an int4 (group 32) compressed-tensors checkpoint, and the same model
    with its dequantized weights as a plain checkpoint."""
    src = str(tmp_path_factory.mktemp("tiny_src"))
    save_tiny_model_fn("llama", src, seed=5)
    dst = str(tmp_path_factory.mktemp("tiny_w4"))
    save_rtn_checkpoint(src, dst, 4, 32, save_tokenizer=False)
    from transformers import AutoModelForCausalLM
    plain = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if ".layers." in name and name.endswith(".weight") and p.dim() == 2:
                q, scale = quantize_rtn(p, 4, 32)
                p.copy_(q.float() * scale.float().repeat_interleave(32, dim=1))
    deq = str(tmp_path_factory.mktemp("tiny_deq"))
    plain.save_pretrained(deq)
    return dst, deq


def _greedy(path: str, dtype: str, **kw) -> list[list[int]]:
    from llmserve import LLM, SamplingParams
    llm = LLM(path, tokenizer="SmolLM2-135M-Instruct", dtype=dtype, kv_cache_memory="16MiB", max_model_len=256,
              multiprocess_mode=False, **kw)
    try:
        outs = llm.generate(["The capital of France is", "1, 2, 3,"], SamplingParams(temperature=0, max_tokens=12),
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm
    finally:
        llm.shutdown()


def test_float32_run_equals_the_dequantized_model(tiny_w4):
    dst, deq = tiny_w4
    assert json.load(open(os.path.join(dst, "config.json")))["quantization_config"]["format"] == "pack-quantized"
    assert _greedy(dst, "float32", quantization="compressed-tensors")[0] == _greedy(deq, "float32")[0]


def test_wrong_quantization_flag_is_a_clear_error(tiny_w4):
    from llmserve import LLM
    with pytest.raises(ValueError, match="not a GGUF checkpoint"):
        LLM(tiny_w4[0], tokenizer="SmolLM2-135M-Instruct", quantization="gguf", multiprocess_mode=False)
    with pytest.raises(ValueError, match="is not quantized"):
        LLM(tiny_w4[1], tokenizer="SmolLM2-135M-Instruct", quantization="compressed-tensors", multiprocess_mode=False)
    with pytest.raises(ValueError, match="not supported by this engine"):
        LLM(tiny_w4[0], tokenizer="SmolLM2-135M-Instruct", quantization="awq", multiprocess_mode=False)


def test_bfloat16_runs_every_linear_on_the_packed_blocks(tiny_w4, monkeypatch):
    from llmserve.models.llama import Linear
    from llmserve.ops import quant_ops
    if quant_ops.get_quant_ops() is None:
        pytest.skip("packed kernels need AVX512-VNNI")
    monkeypatch.setattr(quant_ops, "packed_switch_point", lambda *a, **k: quant_ops.ALL_STEPS)
    from llmserve import LLM, SamplingParams
    llm = LLM(tiny_w4[0], tokenizer="SmolLM2-135M-Instruct", dtype="bfloat16", kv_cache_memory="16MiB",
              max_model_len=256, multiprocess_mode=False)
    try:
        model = llm.llm_engine.engine_core.engine_core.model_runner.model
        layers = [m for m in model.modules() if isinstance(m, Linear)]
        packed = [m for m in layers if m.packed_only]
        assert len(packed) == len(layers) - (model.lm_head is not None)  # the untied head stays dense
        assert all(m.weight.numel() == 0 for m in packed)
        out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        llm.shutdown()
