"""Our Llama-family models over the paged KV cache vs transformers' forward, float32."""
from __future__ import annotations

import pytest
import torch

from llmserve.model_loader import get_model, load_hf_config, resolve_model
from llmserve.models import get_model_class
from llmserve.models.llama import LlamaForCausalLM
from llmserve.ops.onednn_linear import dense

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
ATOL = 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory, save_tiny_model_fn, model_config_fn):
    """(ours, hf) for one architecture, ours loaded from the saved safetensors dir."""
    path = str(tmp_path_factory.mktemp(f"tiny_{request.param}"))
    hf = save_tiny_model_fn(request.param, path)
    resolved = resolve_model(path)
    ours = get_model(model_config_fn(resolved, load_hf_config(resolved), "float32"))
    return request.param, ours, hf, path


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_full_prefill_matches_hf(tiny, tokens_fn, step_runner_cls):
    arch, ours, hf, path = tiny
    prompt = tokens_fn(21, seed=1)
    got = step_runner_cls(ours).step([("a", prompt)])["a"]
    ref = hf_logits(hf, prompt)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
def test_chunked_prefill_and_batched_decodes_match_hf(tiny, tokens_fn, step_runner_cls, use_kernel,
                                                      monkeypatch):
    """A's prompt in one step, B's in two chunks, C's prefill batched after decodes, then
    three decodes per step; every step's logits equal HF's over the whole sequence (with the
    C++ kernels when they build here, and with the pure-torch paths)."""
    arch, ours, hf, path = tiny
    if not use_kernel:
        from llmserve.ops import cpu_ops
        monkeypatch.setattr(cpu_ops, "get_cpu_ops", lambda: None)
    seqs = {"a": tokens_fn(27, 2), "b": tokens_fn(19, 3), "c": tokens_fn(13, 4)}
    refs = {r: hf_logits(hf, s) for r, s in seqs.items()}
    runner = step_runner_cls(ours)
    done = {"a": 0, "b": 0, "c": 0}

    def check(out):
        for rid, logits in out.items():
            n = logits.shape[0]
            torch.testing.assert_close(logits, refs[rid][done[rid]:done[rid] + n],
                                       atol=ATOL, rtol=1e-4, msg=lambda m: f"{arch}/{rid}: {m}")
            done[rid] += n

    # step 1: two prefills: A whole, B's first chunk
    check(runner.step([("a", seqs["a"][:23]), ("b", seqs["b"][:8])]))
    # step 2: A decodes; B's second chunk (with earlier context); C's whole prompt
    check(runner.step([("a", seqs["a"][23:24]), ("b", seqs["b"][8:15]), ("c", seqs["c"][:9])]))
    # steps 3..: three decodes batched
    while any(done[r] < len(seqs[r]) for r in seqs):
        batch = [(r, seqs[r][done[r]:done[r] + 1]) for r in ("a", "b", "c") if done[r] < len(seqs[r])]
        check(runner.step(batch))
    assert all(done[r] == len(seqs[r]) for r in seqs)


def test_registry_picks_class_and_rejects_unknown(tiny):
    arch, ours, hf, path = tiny
    assert issubclass(get_model_class(hf.config), LlamaForCausalLM)
    assert type(ours) is get_model_class(hf.config)

    class Cfg:
        architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM|GPT2LMHeadModel"):
        get_model_class(Cfg())


def test_load_weights_reports_missing_and_bad_shapes(tiny):
    arch, ours, hf, path = tiny
    state = dict(hf.state_dict())
    fresh = type(ours)(ours.config, torch.float32)
    dropped = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="missing weights"):
        fresh.load_weights((k, v) for k, v in state.items() if k != dropped)
    bad = dict(state)
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight"):
        fresh.load_weights(bad.items())


def test_fused_weights_hold_hf_weights(tiny):
    arch, ours, hf, path = tiny
    sd = hf.state_dict()
    attn = ours.model.layers[1].self_attn
    qkv = dense(attn.qkv_proj.weight)  # packed for oneDNN after loading
    ref = torch.cat([sd["model.layers.1.self_attn.q_proj.weight"],
                     sd["model.layers.1.self_attn.k_proj.weight"],
                     sd["model.layers.1.self_attn.v_proj.weight"]])
    assert torch.equal(qkv, ref)
    gu = dense(ours.model.layers[0].mlp.gate_up_proj.weight)
    assert torch.equal(gu, torch.cat([sd["model.layers.0.mlp.gate_proj.weight"],
                                      sd["model.layers.0.mlp.up_proj.weight"]]))


def test_get_model_bfloat16_from_safetensors(tiny, model_config_fn, tokens_fn,
                                             step_runner_cls):
    arch, ours, hf, path = tiny
    resolved = resolve_model(path)
    model = get_model(model_config_fn(resolved, load_hf_config(resolved), "bfloat16"))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    runner = step_runner_cls(model)
    prompt = tokens_fn(12, seed=5)
    got = runner.step([("a", prompt[:11])])["a"]
    got = torch.cat([got, runner.step([("a", prompt[11:])])["a"]])
    assert torch.isfinite(got).all()
    ref = hf_logits(hf, prompt)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max() + 0.02


def test_rope_tables_grow_on_demand_and_match_formula():
    from llmserve.models.llama import RotaryEmbedding
    rope = RotaryEmbedding(16, 20000, {"rope_type": "default", "rope_theta": 10000.0})
    assert rope.cos_cache.shape[0] == 8192
    pos = torch.tensor([3, 12345, 19999])
    cos, sin = rope.cos_sin(pos, torch.float32)
    assert rope.cos_cache.shape[0] == 20000
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    torch.testing.assert_close(cos[:, 0], torch.cos(pos.float()[:, None] * inv))
    torch.testing.assert_close(sin[:, 0], torch.sin(pos.float()[:, None] * inv))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        rope.cos_sin(torch.tensor([20000]), torch.float32)
    with pytest.raises(ValueError, match="rope_type"):
        RotaryEmbedding(16, 64, {"rope_type": "dynamic", "rope_theta": 1e4})
