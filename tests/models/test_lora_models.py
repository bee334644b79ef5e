"""LoRA adapters on our Llama-family models vs transformers + peft (float32): PEFT
adapters of rank 8 and 16 mixed with base rows in one step (the LoRA kernel, or its torch
path where the kernel cannot be built), the same adapter merged into the base weights, and a GGUF LoRA
written in llama.cpp's ``convert_lora_to_gguf.py`` layout; and each refused adapter's
typed error naming its field."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from llmserve.lora.config import LoRAConfig
from llmserve.lora.errors import LoRAAdapterError
from llmserve.lora.models import write_gguf_lora
from llmserve.lora.request import LoRARequest
from llmserve.lora.worker_manager import LoRAModelManager
from llmserve.model_loader import get_model, load_hf_config, resolve_model

# Llama in make test; the other architectures in make test-all (same code, ~4 s each here).
ARCHS = ["llama"] + [pytest.param(a, marks=pytest.mark.slow) for a in ("mistral", "qwen2", "qwen3")]
ATOL = 1e-4


def our_model(path: str, model_config_fn, max_loras: int = 4):
    resolved = resolve_model(path)
    model = get_model(model_config_fn(resolved, load_hf_config(resolved), "float32"))
    mgr = LoRAModelManager(model, LoRAConfig(max_loras=max_loras, max_lora_rank=16), torch.float32,
                           torch.device("cpu"))
    return model, mgr


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def lora_step(runner, mgr, chunks):
    """One step of ``(request_id, tokens, lora_id)`` chunks (lora_id 0: the base model)."""
    mgr.begin_step([c[2] for c in chunks], [len(c[1]) for c in chunks])
    try:
        return runner.step([(c[0], c[1]) for c in chunks])
    finally:
        mgr.end_step()


@pytest.fixture(scope="module", params=ARCHS)
def tiny_lora(request, tmp_path_factory, save_tiny_model_fn, make_lora_adapter_fn):
    """(arch, base dir, hf base, {lora_id: (adapter dir, PeftModel)}) with a rank-8 (id 1)
    and a rank-16 (id 2) adapter on all seven projections."""
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    base = str(root / "base")
    hf = save_tiny_model_fn(request.param, base)
    adapters = {}
    for lid, r in ((1, 8), (2, 16)):
        path = str(root / f"r{r}")
        adapters[lid] = (path, make_lora_adapter_fn(hf, path, r, seed=lid))
    return request.param, base, hf, adapters


def check_mixed_steps(runner, mgr, refs, seqs, owners, atol: float = ATOL) -> float:
    """Prefill all of ``seqs`` in one step, then decode them together; every logit row
    equals the reference of its request's model. Returns the largest difference."""
    done = {rid: 0 for rid in seqs}
    worst = [0.0]
    firsts = {rid: len(s) - 3 for rid, s in seqs.items()}

    def check(out):
        for rid, logits in out.items():
            n = logits.shape[0]
            ref = refs[rid][done[rid]:done[rid] + n]
            torch.testing.assert_close(logits, ref, atol=atol, rtol=1e-4, msg=lambda m: f"{rid}: {m}")
            worst[0] = max(worst[0], float((logits - ref).abs().max()))
            done[rid] += n

    check(lora_step(runner, mgr, [(rid, seqs[rid][:firsts[rid]], owners[rid]) for rid in seqs]))
    while any(done[r] < len(seqs[r]) for r in seqs):
        check(lora_step(runner, mgr, [(r, seqs[r][done[r]:done[r] + 1], owners[r]) for r in seqs
                                      if done[r] < len(seqs[r])]))
    return worst[0]


def test_peft_adapters_mixed_with_base_match_peft(tiny_lora, model_config_fn, step_runner_cls, tokens_fn):
    """Rank 8 and rank 16 adapters and the base model in the same steps (three adapter
    segments, prompts of different lengths, a rank-8 adapter in rank-16 slots), then one
    adapter alone: logits within 1e-4 of peft's."""
    arch, base, hf, adapters = tiny_lora
    model, mgr = our_model(base, model_config_fn)
    for lid, (path, _) in adapters.items():
        assert mgr.add(LoRARequest(f"a{lid}", lid, path))
    seqs = {"a": tokens_fn(17, 1), "b": tokens_fn(11, 2), "c": tokens_fn(9, 3), "d": tokens_fn(14, 4)}
    owners = {"a": 1, "b": 2, "c": 0, "d": 1}
    models = {0: hf, 1: adapters[1][1], 2: adapters[2][1]}
    refs = {rid: hf_logits(models[owners[rid]], s) for rid, s in seqs.items()}
    assert not torch.allclose(refs["a"], hf_logits(hf, seqs["a"]), atol=1e-2)  # the adapter matters
    check_mixed_steps(step_runner_cls(model), mgr, refs, seqs, owners)
    alone = {"e": tokens_fn(12, 5)}
    check_mixed_steps(step_runner_cls(model), mgr, {"e": hf_logits(models[2], alone["e"])}, alone, {"e": 2})


def test_adapters_of_their_own_rank_and_targets_match_peft(tiny_lora, model_config_fn, step_runner_cls, tokens_fn,
                                                         make_lora_adapter_fn, tmp_path):
    """In slots sized for rank 16, each slot read at its own rank: a rank-4 adapter on
    PEFT's default Llama targets (q_proj, v_proj: its o/gate_up/down slots at rank 0, its
    k slice zero), the rank-8 and rank-16 all-linear ones and the base model in the same
    steps: logits within 1e-4 of peft's; then the q,v adapter's slot, once it is removed,
    taken by the rank-16 all-linear adapter (under a new id): peft's logits again."""
    arch, base, hf, adapters = tiny_lora
    model, mgr = our_model(base, model_config_fn, max_loras=3)
    qv_path = str(tmp_path / "qv")
    qv = make_lora_adapter_fn(hf, qv_path, 4, seed=7, targets=("q_proj", "v_proj"))
    for lid, (path, _) in adapters.items():
        assert mgr.add(LoRARequest(f"a{lid}", lid, path))
    assert mgr.add(LoRARequest("qv", 3, qv_path))
    seqs = {"a": tokens_fn(13, 1), "b": tokens_fn(9, 2), "c": tokens_fn(11, 3), "d": tokens_fn(7, 4)}
    owners = {"a": 3, "b": 1, "c": 0, "d": 2}
    models = {0: hf, 1: adapters[1][1], 2: adapters[2][1], 3: qv}
    refs = {rid: hf_logits(models[owners[rid]], s) for rid, s in seqs.items()}
    assert not torch.allclose(refs["a"], hf_logits(hf, seqs["a"]), atol=1e-2)  # the q,v adapter matters
    check_mixed_steps(step_runner_cls(model), mgr, refs, seqs, owners)
    qkv = next(w for (li, key), w in mgr.wrappers.items() if key == "self_attn.qkv_proj")
    down = next(w for (li, key), w in mgr.wrappers.items() if key == "mlp.down_proj")
    slot = mgr.slot(3)
    assert int(qkv.ranks[slot]) == 4 and int(down.ranks[slot]) == 0
    assert mgr.remove(3)
    assert mgr.add(LoRARequest("again", 4, adapters[2][0]))
    alone = {"e": tokens_fn(10, 5)}
    check_mixed_steps(step_runner_cls(model), mgr, {"e": hf_logits(models[2], alone["e"])}, alone, {"e": 4})
    assert mgr.slot(4) == slot and int(qkv.ranks[slot]) == 16 and int(down.ranks[slot]) == 16


def test_benchmark_adapters_target_what_they_are_given(tmp_path):
    """llmserve.benchmarks.lora writes PEFT's default Llama targets (q_proj, v_proj) when
    asked, all seven by default; load_adapter reads back exactly those at the rank given."""
    from types import SimpleNamespace

    from llmserve.benchmarks.lora import write_random_adapter
    from llmserve.lora.models import load_adapter

    cfg = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                          num_hidden_layers=2)
    qv = load_adapter(write_random_adapter(cfg, str(tmp_path / "qv"), 8, seed=0, targets=("q_proj", "v_proj")), 64)
    assert qv.targets == {"q_proj", "v_proj"} and qv.rank == 8
    assert qv.weights[(1, "v_proj")][1].shape == (32, 8)  # B [out = 2 kv heads x 16, r]
    every = load_adapter(write_random_adapter(cfg, str(tmp_path / "all"), 4, seed=0), 16)
    assert every.targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_one_adapters_step_runs_inside_the_packed_gemms_with_the_same_bits(tiny_lora, model_config_fn,
                                                                         step_runner_cls, tokens_fn):
    """On a packed base (every linear's weight in Q8_0 blocks, every step on them), a step
    whose adapter rows all run one adapter takes the deltas inside the GEMMs' threads
    (``begin_step`` arms each module's hook for the step) and gives, bit for bit, the rows
    that the same tokens give beside another adapter's rows (the kernel's own call after the
    GEMM); decode-sized steps switching adapter every step re-arm each step."""
    from llmserve.benchmarks.kquant_writer import quantize
    from llmserve.models.llama import Linear
    from llmserve.ops.kquant import quant_weight_from_gguf
    from llmserve.ops.quant_ops import ALL_STEPS, get_quant_ops

    if get_quant_ops() is None:
        pytest.skip("no AVX512-VNNI: the packed kernels are not built on this CPU")
    _, base, _, adapters = tiny_lora
    resolved = resolve_model(base)
    model = get_model(model_config_fn(resolved, load_hf_config(resolved), "float32"))
    for m in model.model.layers.modules():
        if isinstance(m, Linear):
            w = m.weight.to_dense() if m.weight.is_mkldnn else m.weight  # oneDNN-packed at load
            blocks = quantize(w.detach().float().numpy(), 8)  # Q8_0
            m.set_packed(quant_weight_from_gguf(torch.from_numpy(blocks), 8), ALL_STEPS)
    mgr = LoRAModelManager(model, LoRAConfig(max_loras=2, max_lora_rank=16), torch.float32, torch.device("cpu"))
    # Every bias-free packed module's GEMM runs its deltas (a module with a bias, as some of
    # these checkpoints' attention projections, takes the kernel's own call every step).
    assert len(mgr.hooked) >= 2 * len(model.model.layers)  # gate_up and down at least
    assert all((w._fused_qw is not None) == (w.base.bias is None) for w in mgr.wrappers.values())
    for lid, (path, _) in adapters.items():
        mgr.add(LoRARequest(f"a{lid}", lid, path))
    runner = step_runner_cls(model)
    seq, other = tokens_fn(6, 1), tokens_fn(5, 2)
    for lid, partner in ((1, 2), (2, 1), (1, 2)):  # the same row count each step: a stale arm would pass the checks
        fused = lora_step(runner, mgr, [(f"f{lid}", seq, lid), ("base", other, 0)])
        apart = lora_step(runner, mgr, [(f"a{lid}", seq, lid), ("o", other, partner)])
        assert torch.equal(fused[f"f{lid}"], apart[f"a{lid}"]), lid
    base_rows = lora_step(runner, mgr, [("b", seq, 0), ("base", other, 0)])["b"]
    assert not torch.equal(base_rows, fused[f"f{lid}"])  # the adapter changed the rows


def test_merged_adapter_and_gguf_lora_match_peft(tiny_lora, model_config_fn, step_runner_cls, tokens_fn,
                                                 tmp_path):
    """The rank-16 adapter merged into the base weights (peft's merge_and_unload) gives
    peft's logits; the same adapter as a GGUF LoRA (llama.cpp's layout, q/k rows permuted
    for Llama/Mistral) gives the PEFT directory's logits."""
    arch, base, hf, adapters = tiny_lora
    path, pm = adapters[2]
    tokens = tokens_fn(13, 7)
    ref = hf_logits(pm, tokens)
    merged = str(tmp_path / "merged")
    copy.deepcopy(pm).merge_and_unload().save_pretrained(merged)
    model, _ = our_model(merged, model_config_fn)
    torch.testing.assert_close(step_runner_cls(model).step([("m", tokens)])["m"], ref, atol=ATOL, rtol=1e-4)

    gguf_path = write_gguf_lora(path, str(tmp_path / "adapter.gguf"), hf.config)
    model, mgr = our_model(base, model_config_fn)
    mgr.add(LoRARequest("peft", 1, path))
    mgr.add(LoRARequest("gguf", 2, gguf_path))
    out = lora_step(step_runner_cls(model), mgr, [("p", tokens, 1), ("g", tokens, 2)])
    torch.testing.assert_close(out["g"], out["p"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["g"], ref, atol=ATOL, rtol=1e-4)


def test_refused_adapters_name_their_field(tiny_lora, model_config_fn, make_lora_adapter_fn, save_tiny_model_fn,
                                           tmp_path):
    arch, base, hf, adapters = tiny_lora
    if arch != "llama":
        return  # the refusals do not depend on the architecture; checked once
    model, mgr = our_model(base, model_config_fn)
    path16 = adapters[2][0]

    def refused(path, param, max_rank=16):
        m = LoRAModelManager.__new__(LoRAModelManager)
        m.__dict__.update(mgr.__dict__)
        m.config = LoRAConfig(max_loras=4, max_lora_rank=max_rank)
        with pytest.raises(LoRAAdapterError) as e:
            m.read(LoRARequest("x", 9, path))
        assert e.value.param == param, (e.value, e.value.param)
        return str(e.value)

    assert "greater than max_lora_rank 8" in refused(path16, "r", max_rank=8)
    assert "does not exist" in refused(str(tmp_path / "missing"), "lora_path")
    bad_cfg = tmp_path / "modules_to_save"
    bad_cfg.mkdir()
    cfg = json.load(open(os.path.join(path16, "adapter_config.json")))
    json.dump({**cfg, "modules_to_save": ["lm_head"]}, open(bad_cfg / "adapter_config.json", "w"))
    assert "modules_to_save" in refused(str(bad_cfg), "modules_to_save")
    # PEFT options that change the forward beyond A, B and the scale are refused by name (a
    # real lora_bias adapter was refused as an unsupported target_modules, its lora_B.bias)
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    biased = get_peft_model(copy.deepcopy(hf), LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True))
    biased.save_pretrained(str(tmp_path / "lora_bias"))
    assert "lora_bias" in refused(str(tmp_path / "lora_bias"), "lora_bias")
    for name, value in (("alora_invocation_tokens", [5, 6]), ("layer_replication", [[0, 2], [1, 2]]),
                        ("trainable_token_indices", [3]), ("use_qalora", True)):
        json.dump({**cfg, name: value}, open(bad_cfg / "adapter_config.json", "w"))
        refused(str(bad_cfg), name)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    json.dump(cfg, open(corrupt / "adapter_config.json", "w"))
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    assert "cannot read" in refused(str(corrupt), "lora_path")
    (corrupt / "adapter_config.json").write_text("{not json")
    assert "not valid JSON" in refused(str(corrupt), "lora_path")
    embed = tmp_path / "embed"
    make_lora_adapter_fn(hf, str(embed), 8, seed=3, targets=["q_proj", "embed_tokens"])
    assert "embed_tokens" in refused(str(embed), "target_modules")
    # An adapter of a wider model: its shapes do not match this base.
    other_hf = save_tiny_model_fn("qwen3", str(tmp_path / "other"))
    other = tmp_path / "other_lora"
    make_lora_adapter_fn(other_hf, str(other), 8, seed=4)
    assert "do not match the base model" in refused(str(other), "target_modules")


@pytest.mark.slow
def test_smollm2_adapters_match_peft_dense_and_packed(smollm2_hf, smollm2_resolved, smollm2_config, model_config_fn,
                                                      make_lora_adapter_fn, step_runner_cls, tokens_fn, tmp_path):
    """SmolLM2-135M: rank 8 and 16 adapters mixed with the base in one step give peft's
    logits (float32, within 1e-3 as the base model's own test: 30 layers' summation
    order; ~3e-4 measured, the base rows alike); on the packed 4-bit base (bfloat16, the GGUF's Q4_1
    blocks) the adapter moves the logits as it moves peft's (the delta over the same
    model's base logits, correlated with peft's; dense bfloat16 alongside)."""
    pms = {lid: make_lora_adapter_fn(smollm2_hf, str(tmp_path / f"r{r}"), r, seed=lid, alpha=r // 2)
           for lid, r in ((1, 8), (2, 16))}
    model = get_model(model_config_fn(smollm2_resolved, smollm2_config, "float32"))
    mgr = LoRAModelManager(model, LoRAConfig(max_loras=2, max_lora_rank=16), torch.float32, torch.device("cpu"))
    for lid, r in ((1, 8), (2, 16)):
        mgr.add(LoRARequest(f"a{lid}", lid, str(tmp_path / f"r{r}")))
    seqs = {"a": tokens_fn(12, 1), "b": tokens_fn(9, 2), "c": tokens_fn(7, 3)}
    owners = {"a": 1, "b": 2, "c": 0}
    models = {0: smollm2_hf, **pms}
    refs = {rid: hf_logits(models[owners[rid]], s) for rid, s in seqs.items()}
    worst = check_mixed_steps(step_runner_cls(model), mgr, refs, seqs, owners, atol=1e-3)
    print(f"SmolLM2 float32 LoRA vs peft: max |logit diff| {worst:.2e}")

    packed = get_model(model_config_fn(smollm2_resolved, smollm2_config, "bfloat16"))
    from llmserve.models.llama import Linear
    from llmserve.ops.quant_ops import ALL_STEPS

    assert packed.model.layers[0].mlp.gate_up_proj.qweight is not None
    for m in packed.modules():  # every step on the Q4_1 blocks, whatever this CPU's switch point
        if isinstance(m, Linear) and m.qweight is not None:
            m.set_packed(m.qweight, ALL_STEPS)
    mgr = LoRAModelManager(packed, LoRAConfig(max_loras=2, max_lora_rank=16), torch.bfloat16, torch.device("cpu"))
    mgr.add(LoRARequest("a2", 2, str(tmp_path / "r16")))
    ref = (hf_logits(pms[2], seqs["a"]) - hf_logits(smollm2_hf, seqs["a"])).flatten()

    def delta_corr(model, mgr) -> float:
        out = lora_step(step_runner_cls(model), mgr, [("l", seqs["a"], 2), ("b", seqs["a"], 0)])
        return float(torch.corrcoef(torch.stack([(out["l"] - out["b"]).flatten(), ref]))[0, 1])

    packed_corr = delta_corr(packed, mgr)
    # One adapter's rows run their deltas inside the packed GEMM's threads (LoRAMapping.fused);
    # beside a second adapter's rows, as a kernel call of their own: the same bits.
    mgr.add(LoRARequest("a1", 1, str(tmp_path / "r8")))
    alone = lora_step(step_runner_cls(packed), mgr, [("l", seqs["a"], 2), ("b", seqs["b"], 0)])
    mixed = lora_step(step_runner_cls(packed), mgr, [("l", seqs["a"], 2), ("o", seqs["c"], 1)])
    assert torch.equal(alone["l"], mixed["l"])
    # The same model on dense bfloat16 weights (the loader dropped them), made dense before
    # it is wrapped: a wrapper keeps the packed GEMM it found (LinearWithLoRA._fused_qw).
    dense = get_model(model_config_fn(smollm2_resolved, smollm2_config, "bfloat16"))
    for m in dense.modules():
        if isinstance(m, Linear) and m.qweight is not None:
            w = m.qweight.rows(torch.arange(m.qweight.n)).to(torch.bfloat16)
            m.weight = torch.nn.Parameter(w, requires_grad=False)
            m.set_packed(None, 0)
    dense_mgr = LoRAModelManager(dense, LoRAConfig(max_loras=2, max_lora_rank=16), torch.bfloat16, torch.device("cpu"))
    dense_mgr.add(LoRARequest("a2", 2, str(tmp_path / "r16")))
    dense_corr = delta_corr(dense, dense_mgr)
    print(f"SmolLM2 bf16 LoRA delta vs peft's: correlation packed {packed_corr:.4f}, dense {dense_corr:.4f}")
    # Measured: packed 0.972 (int8 activations in the packed kernel), dense bfloat16 0.993
    # (bfloat16 adapter weights, the LoRA kernel);
    # a delta missing or applied twice on the packed layers would correlate far less.
    assert packed_corr > 0.95 and dense_corr > 0.97
