"""K-quant GGUF weights run packed (issue 30): the test writer's blocks against
``gguf.quants.dequantize``, the K-quant kernel against its pure-torch references on every
type, and a tiny Llama written as a Q4_K_M-style mixed GGUF (Q4_K, Q5_K, Q6_K, Q5_0 /
Q5_1 / Q8_0 fallbacks) against the same file's dequantized weights."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from llmserve.benchmarks.kquant_writer import q4_k_m_type, quantize, write_gguf
from llmserve.ops.kquant import (KQUANT_TYPES, ConcatQuantWeight, KQuantWeight, dequantize_reference,
                                 linear_reference, quant_weight_from_gguf, unpack_blocks)
from llmserve.ops.quant_ops import get_quant_ops

ops = get_quant_ops()
needs_kernels = pytest.mark.skipif(ops is None, reason="packed-weight kernels need AVX512-VNNI or AVX2 and a compiler")
K_TYPES = sorted(KQUANT_TYPES)
# Where each type keeps its float16 fields (d, then dmin for types with mins) in a block.
F16_AT = {10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def _gguf(raw: np.ndarray, qtype: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType(qtype)))


def _random_blocks(qtype: int, n: int, super_blocks: int, seed: int) -> np.ndarray:
    """Random bytes (every code, scale and min bit pattern) with finite float16 d / dmin."""
    rng = np.random.default_rng(seed)
    bb = KQUANT_TYPES[qtype][1]
    raw = rng.integers(0, 256, size=(n, super_blocks, bb), dtype=np.uint8)
    for at in F16_AT[qtype]:
        raw[:, :, at:at + 2] = rng.uniform(-0.01, 0.01, (n, super_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, super_blocks * bb)


@pytest.mark.parametrize("qtype", K_TYPES)
def test_writer_blocks_round_trip_through_gguf(qtype):
    """The writer's blocks are valid: gguf decodes them close to the floats (per-type
    bound from the code width), and our decoding equals gguf's bit for bit."""
    w = np.random.default_rng(qtype).normal(0, 0.02, size=(24, 512)).astype(np.float32)
    raw = quantize(w, qtype)
    assert raw.shape == (24, 2 * KQUANT_TYPES[qtype][1]) and raw.dtype == np.uint8
    ref = _gguf(raw, qtype)
    bound = {10: 0.03, 11: 0.02, 12: 0.006, 13: 0.003, 14: 0.003}[qtype]  # 0.02-std weights
    assert float((ref - torch.from_numpy(w)).abs().max()) < bound
    assert torch.equal(dequantize_reference(unpack_blocks(raw, qtype)), ref)
    with pytest.raises(ValueError, match="256-value blocks"):
        quantize(w[:, :288], qtype)


@pytest.mark.parametrize("qtype", K_TYPES)
def test_random_blocks_decode_bit_exact(qtype):
    raw = _random_blocks(qtype, 33, 2, seed=qtype)
    assert torch.equal(dequantize_reference(unpack_blocks(raw, qtype)), _gguf(raw, qtype))


@needs_kernels
@pytest.mark.parametrize("qtype", K_TYPES)
def test_rows_are_gguf_values(qtype):
    raw = _random_blocks(qtype, 40, 2, seed=20 + qtype)
    qw = KQuantWeight.from_gguf(torch.from_numpy(raw), qtype)
    assert qw.shape == (40, 512) and qw.bits == KQUANT_TYPES[qtype][2]
    ids = torch.tensor([0, 39, 17, 17, 16, 15])
    assert torch.equal(qw.rows(ids), _gguf(raw, qtype)[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        qw.rows(torch.tensor([40]))


@needs_kernels
@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("m", [1, 3, 9, 34])  # 34: AVX2's unpacked tiles (32 tokens and more)
@pytest.mark.parametrize("n", [40, 16, 7])  # part group, one group, less than a group
def test_kquant_linear_matches_references(qtype, m, n):
    raw = _random_blocks(qtype, n, 3, seed=30 + qtype)
    parts = unpack_blocks(raw, qtype)
    qw = KQuantWeight.from_gguf(torch.from_numpy(raw), qtype)
    x = torch.randn(m, 768, generator=torch.Generator().manual_seed(m))
    x[0, :32] = 0  # an all-zero block
    got = qw.linear(x, out_float=True)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    ref = linear_reference(x, parts)
    scale = float(ref.abs().max())
    torch.testing.assert_close(got.double(), ref, atol=2e-6 * scale, rtol=1e-5)
    exact = x.double() @ _gguf(raw, qtype).double().T  # int8 activations stay close to exact
    assert float((got.double() - exact).abs().max()) < 0.03 * float(exact.abs().max())
    xb = x.bfloat16()
    got_bf = qw.linear(xb, out_float=True)
    torch.testing.assert_close(got_bf.double(), linear_reference(xb.float(), parts), atol=2e-6 * scale, rtol=1e-5)
    assert torch.equal(qw.linear(xb), got_bf.bfloat16())  # float32 sums rounded once


@needs_kernels
@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("super_blocks", [1, 6])  # 8 blocks: one unpacked chunk; 48: three, summed between
def test_many_tokens_equal_few_tokens_bit_for_bit(qtype, super_blocks):
    """From 32 tokens on, AVX2 runs the K-quant tiles unpacked once per row group with the
    tokens' codes as the unsigned operand; the integer sums and float steps are those of the
    few-token kernel, so 300 tokens at once (chunks of 256 + 44) equal 8 at a time bit for bit."""
    raw = _random_blocks(qtype, 40, super_blocks, seed=40 + qtype)
    qw = KQuantWeight.from_gguf(torch.from_numpy(raw), qtype)
    x = torch.randn(300, 256 * super_blocks, generator=torch.Generator().manual_seed(qtype))
    x[5, 32:64] = 0  # an all-zero block
    for xs in (x, x.bfloat16()):
        whole = qw.linear(xs, out_float=True)
        assert torch.equal(whole, torch.cat([qw.linear(xs[i:i + 8], out_float=True) for i in range(0, 300, 8)]))


@needs_kernels
def test_torch_tiles_equal_the_cpp_repack():
    """KQuantWeight's torch tiling is quant_repack's layout (4-, 5- and 8-bit tiles)."""
    from llmserve.ops.kquant import _tiles
    for qtype, bits in ((3, 4), (6, 5), (8, 8)):
        raw = quantize(np.random.default_rng(0).normal(size=(20, 64)).astype(np.float32), qtype)
        codes, dm = ops.quant_repack(torch.from_numpy(np.ascontiguousarray(raw)), qtype)
        d = dm[..., :16].contiguous().view(torch.float16).float()
        # Q4_1/Q5_1 keep m; the symmetric types keep d alone (m = -2^(bits-1) d)
        assert dm.shape[-1] == (32 if qtype in (3, 7) else 16)
        m = dm[..., 16:].contiguous().view(torch.float16).float() if qtype in (3, 7) else -(2 ** (bits - 1)) * d
        w = _gguf(raw, qtype)
        # codes (w - m) / d in weight order, rows padded to whole groups of 16
        dd = d.permute(0, 2, 1).reshape(32, -1).repeat_interleave(32, 1)[:20]
        mm = m.permute(0, 2, 1).reshape(32, -1).repeat_interleave(32, 1)[:20]
        q = torch.zeros(32, 64, dtype=torch.uint8)
        q[:20] = torch.round((w - mm) / dd).to(torch.uint8)
        assert torch.equal(_tiles(q, bits), codes)


@needs_kernels
def test_mixed_type_parts_run_side_by_side():
    rng = np.random.default_rng(1)
    raws = [(12, quantize(rng.normal(0, 0.02, (32, 256)).astype(np.float32), 12)),
            (14, quantize(rng.normal(0, 0.02, (16, 256)).astype(np.float32), 14)),
            (6, quantize(rng.normal(0, 0.02, (8, 256)).astype(np.float32), 6))]
    parts = tuple(quant_weight_from_gguf(torch.from_numpy(np.ascontiguousarray(r)), t) for t, r in raws)
    cat = ConcatQuantWeight(parts)
    assert cat.shape == (56, 256)
    # one parallel region over all parts (quant_linear_parts): each part's columns as its own call
    for m in (1, 3, 8, 37):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(m, 256).to(dtype)
            assert torch.equal(cat.linear(x), torch.cat([p.linear(x) for p in parts], -1))
            assert torch.equal(cat.linear(x, True), torch.cat([p.linear(x, True) for p in parts], -1))
    ids = torch.tensor([55, 0, 40, 31, 32, 48])
    want = torch.cat([_gguf(r, t) for t, r in raws])[ids]
    assert torch.equal(cat.rows(ids), want)
    with pytest.raises(RuntimeError, match="out of range"):
        cat.rows(torch.tensor([56]))


# ---- a tiny Llama as a Q4_K_M-style mixed GGUF ----

_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    part, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{_HF_TO_GGUF[part]}.{suffix}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k row permutation (the loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_llama_config():
    import transformers as tf
    # hidden 256 (whole super-blocks: K-quants), intermediate 320 (ffn_down rows of 320:
    # the Q5_0 / Q5_1 / Q8_0 fallbacks); layer 0 has Q6_K attn_v and ffn_down, layer 1 Q5_K ffn_up.
    return tf.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=320, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          rms_norm_eps=1e-6, tie_word_embeddings=False,
                          architectures=["LlamaForCausalLM"])


def _write_tiny_q4_k_m(path: str, cfg) -> dict[str, str]:
    g = torch.Generator().manual_seed(0)
    tensors = []
    for name, p in _tiny_state_shapes(cfg).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied file has no output.weight: the head runs on token_embd
        w = (torch.randn(p, generator=g) * (0.05 if len(p) == 2 else 0.1) + (1.0 if len(p) == 1 else 0)).numpy()
        if ".q_proj." in name:
            w = _permute(w, cfg.num_attention_heads)
        elif ".k_proj." in name:
            w = _permute(w, cfg.num_key_value_heads)
        tensors.append((_gguf_name(name), w))
    return write_gguf(path, tensors, lambda n, row: q4_k_m_type(n, row, cfg.num_hidden_layers))


def _tiny_state_shapes(cfg) -> dict[str, tuple]:
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg.vocab_size, h)}
    for L in range(cfg.num_hidden_layers):
        p = f"model.layers.{L}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    return shapes


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory):
    cfg = _tiny_llama_config()
    path = tmp_path_factory.mktemp("kq") / "tiny-Q4_K_M.gguf"
    kinds = _write_tiny_q4_k_m(str(path), cfg)
    return cfg, path, kinds


def _load(cfg, path, dtype: str, packed_float32: bool = False):
    from llmserve.config import ModelConfig
    from llmserve.model_loader import get_model, startup_cache
    from llmserve.ops import quant_ops
    mc = ModelConfig(model=str(path), tokenizer=str(path), served_model_name=("tiny",), dtype=dtype,
                     packed_float32=packed_float32, max_model_len=256, seed=0, hf_config=cfg,
                     model_path=str(path.parent), gguf_file=path.name)
    mp = pytest.MonkeyPatch()  # every step on the blocks, whatever a busy machine's probe says
    mp.setattr(quant_ops, "packed_switch_point", lambda *a, **k: quant_ops.ALL_STEPS)
    mp.setattr(startup_cache, "cache_root", lambda: str(path.parent / "cache"))  # read the file itself
    try:
        return get_model(mc)
    finally:
        mp.undo()


def test_tiny_q4_k_m_file_mixes_the_types(tiny_q4_k_m):
    _, _, kinds = tiny_q4_k_m
    assert kinds["blk.0.attn_q.weight"] == "Q4_K" and kinds["blk.0.attn_v.weight"] == "Q6_K"
    assert kinds["blk.1.ffn_up.weight"] == "Q5_K" and kinds["output.weight"] == "Q6_K"
    assert kinds["blk.0.ffn_down.weight"] == "Q8_0" and kinds["blk.1.ffn_down.weight"] == "Q8_0"
    assert kinds["token_embd.weight"] == "Q8_0" and kinds["blk.0.attn_norm.weight"] == "F32"


@needs_kernels
def test_tiny_q4_k_m_runs_packed_and_matches_dequantized(tiny_q4_k_m, step_runner_cls):
    """Every linear runs on its blocks with no dense copy kept; prefill and 8 greedy
    decode steps give logits close to the same file's dequantized float32 weights and the
    same tokens."""
    from llmserve.models.llama import Linear
    cfg, path, _ = tiny_q4_k_m
    packed, ref = _load(cfg, path, "bfloat16"), _load(cfg, path, "float32")
    layers = [m for m in packed.modules() if isinstance(m, Linear)]
    assert len(layers) == 2 * 4 + 1
    assert all(m.packed_only and m.weight.numel() == 0 for m in layers)
    qkv = packed.model.layers[0].self_attn.qkv_proj.qweight
    assert isinstance(qkv, ConcatQuantWeight)  # Q4_K q/k beside Q6_K v
    # Random tiny models have flat logits: this prompt's greedy path has top-2 gaps >= 0.072
    # in float32, against a packed-vs-float32 error of <= 0.083 (dense bfloat16: 0.045).
    prompt = [57, 93, 86, 369, 173, 315, 257, 217, 36, 162, 441, 402]
    seqs = {}
    for name, model in (("packed", packed), ("ref", ref)):
        runner = step_runner_cls(model, num_blocks=16, block_size=16)
        logits = [runner.step([("p", prompt)])["p"][-1]]
        for _ in range(8):
            logits.append(runner.step([("p", [int(logits[-1].argmax())])])["p"][-1])
        seqs[name] = torch.stack(logits)
    err = (seqs["packed"] - seqs["ref"]).abs()
    assert float(err.mean()) < 0.05 * float(seqs["ref"].std())
    assert torch.equal(seqs["packed"].argmax(-1), seqs["ref"].argmax(-1))


@needs_kernels
@pytest.mark.parametrize("tied", [False, True])
def test_blocks_cache_entry_warm_start_equals_cold(tmp_path, tied, step_runner_cls):
    """Issue 31: where the blocks run every step, the start-up cache's ``-blocks`` entry
    holds the packed layers in the kernels' layout (``k.*``) and no dense copy of them (nor
    of a tied embedding), nor raw blocks; a warm start from it gives the same packed
    weights, byte for byte, and the same logits as the cold start that wrote it; a
    damaged entry is read from the GGUF file instead and written again."""
    import glob

    from safetensors import safe_open

    from llmserve.models.llama import Linear
    from llmserve.models.packed import weight_tensors
    cfg = _tiny_llama_config()
    cfg.tie_word_embeddings = tied
    path = tmp_path / "tiny-Q4_K_M.gguf"
    _write_tiny_q4_k_m(str(path), cfg)
    cold = _load(cfg, path, "bfloat16")
    (entry,) = glob.glob(str(tmp_path / "cache" / "*" / "weights-bfloat16-blocks.safetensors"))
    warm = _load(cfg, path, "bfloat16")
    with safe_open(entry, framework="pt") as f:
        keys = set(f.keys())
    linears = {n for n, m in cold.named_modules() if isinstance(m, Linear)}
    assert len(linears) == 2 * 4 + (0 if tied else 1)  # + an untied lm_head
    norms = {"model.norm.weight"} | {f"model.layers.{L}.{n}.weight" for L in range(2)
                                     for n in ("input_layernorm", "post_attention_layernorm")}
    assert {k[2:] for k in keys if k.startswith("w.")} == norms | (set() if tied else {"model.embed_tokens.weight"})
    assert {k[2:].split("#")[0] for k in keys if k.startswith("k.")} == linears | ({"@head"} if tied else set())
    assert not any(k.startswith("p.") for k in keys)
    assert warm.embed_from_packed == tied and warm.model.embed_tokens.weight.numel() == (0 if tied else 512 * 256)
    for name in sorted(linears):
        a, b = cold.get_submodule(name), warm.get_submodule(name)
        assert b.packed_only and b.weight.numel() == 0
        (da, ta), (db, tb) = weight_tensors(a.qweight), weight_tensors(b.qweight)
        assert da == db and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), name
    with open(entry, "wb") as f:  # a damaged entry: read from the GGUF file, and written again
        f.write(b"not a safetensors file")
    again = _load(cfg, path, "bfloat16")
    with safe_open(entry, framework="pt") as f:
        assert set(f.keys()) == keys
    prompt = [57, 93, 86, 369, 173, 315, 257, 217, 36, 162, 441, 402]
    seqs = {}
    for label, model in (("cold", cold), ("warm", warm), ("again", again)):
        runner = step_runner_cls(model, num_blocks=16, block_size=16)
        logits = [runner.step([("p", prompt)])["p"][-1]]
        for _ in range(4):
            logits.append(runner.step([("p", [int(logits[-1].argmax())])])["p"][-1])
        seqs[label] = torch.stack(logits)
    assert torch.equal(seqs["cold"], seqs["warm"]) and torch.equal(seqs["cold"], seqs["again"])
    # An entry whose weights do not fit the model is refused before any layer changes.
    from llmserve.models.llama import LlamaForCausalLM
    from llmserve.models.packed import attach_repacked
    fresh = LlamaForCausalLM(cfg, torch.bfloat16)  # as a warm start finds it: dense weights not loaded yet
    o1 = fresh.get_submodule("model.layers.1.self_attn.o_proj")
    misfit = {"model.layers.1.self_attn.o_proj": cold.get_submodule("model.layers.1.self_attn.o_proj").qweight,
              "model.layers.0.self_attn.o_proj": cold.get_submodule("model.layers.0.mlp.gate_up_proj").qweight}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj"):
        attach_repacked(fresh, misfit, 1 << 30)
    assert o1.qweight is None and o1.weight.shape == (256, 256)


def test_unsupported_tensor_type_is_refused_at_load(tmp_path):
    """A tensor type llmserve cannot run (Q8_K: ggml's activation type) is refused before
    any weight is read, naming the type and listing the supported ones."""
    import gguf
    cfg = _tiny_llama_config()
    path = tmp_path / "bad.gguf"
    raw = np.zeros((8, 292), np.uint8)  # one Q8_K super-block per row: f32 d, 256 int8, 16 int16 sums
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from llmserve.model_loader.gguf_loader import iterate_gguf_weights
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight has type Q8_K.*supported: .*Q4_K.*Q6_K"):
        next(iterate_gguf_weights(str(path), cfg, torch.bfloat16, {}))
