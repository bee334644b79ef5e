"""The C++ decoder-layer driver (``llmserve/models/layer_driver.py``, ``csrc/layer_driver.cpp``):
on a GGUF-packed Llama it gives the same logits, bit for bit, as the Python layer loop it
replaces (prompts whole and in chunks beside decodes, a sliding window, float32 and bfloat16
activations), and it leaves the models and steps it cannot run to that loop."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

from llmserve.models import layer_driver
from llmserve.ops.cpu_ops import get_cpu_ops
from tests.models.test_kquant_packed import _load as load_tiny
from tests.models.test_kquant_packed import needs_kernels, tiny_q4_k_m  # noqa: F401 (fixture)

needs_ops = pytest.mark.skipif(get_cpu_ops() is None, reason="needs the C++ CPU kernels")


def _load(cfg, path, dtype: str):
    """The tiny file's model: "packed32" is dtype auto on a CPU without bfloat16 (float32
    activations on the blocks), "float32" the exact dense path, "bfloat16" packed."""
    return load_tiny(cfg, path, "float32" if dtype == "packed32" else dtype, packed_float32=dtype == "packed32")


# Steps of a mixed batch: a prompt whole, another in two chunks beside the first's decodes.
PROMPT_A = [57, 93, 86, 369, 173, 315, 257, 217, 36, 162, 441, 402]
PROMPT_B = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177, 188, 199, 210]


def _run_steps(model, runner_cls, driver: bool, calls: list) -> list[torch.Tensor]:
    """Logits of every step of the schedule above, with the driver on or off; ``calls``
    counts the steps the driver ran."""
    real = layer_driver.run_layers

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(layer_driver, "ENABLED", driver)
    mp.setattr(layer_driver, "run_layers", counting)
    try:
        runner = runner_cls(model, num_blocks=24, block_size=4)
        out = [runner.step([("a", PROMPT_A)])["a"]]
        nxt = int(out[-1][-1].argmax())
        out.append(torch.cat(list(runner.step([("a", [nxt]), ("b", PROMPT_B[:7])]).values())))
        for _ in range(6):
            res = runner.step([("a", [int(out[-1][0].argmax())]), ("b", PROMPT_B[7:] if _ == 0 else [7 + _])])
            out.append(torch.cat(list(res.values())))
        return out
    finally:
        mp.undo()


def _assert_driver_equals_loop(model, runner_cls) -> None:
    """Every step ran by the driver, its logits bit for bit the Python loop's."""
    assert layer_driver.build_plan(model) is not None
    ran, skipped = [], []
    with_driver = _run_steps(model, runner_cls, True, ran)
    loop = _run_steps(model, runner_cls, False, skipped)
    assert ran and all(ran) and not any(skipped)
    for a, b in zip(with_driver, loop):
        assert torch.equal(a, b)


@needs_kernels
@needs_ops
@pytest.mark.parametrize("dtype,window", [("packed32", None), ("bfloat16", None), ("packed32", 6)])
def test_driver_equals_the_python_loop(tiny_q4_k_m, step_runner_cls, dtype, window):
    cfg, path, _ = tiny_q4_k_m
    if window:  # Mistral-style: every layer attends to the last `window` positions
        cfg = copy.deepcopy(cfg)
        cfg.sliding_window = window
    _assert_driver_equals_loop(_load(cfg, path, dtype), step_runner_cls)


@needs_kernels
@needs_ops
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_driver_over_a_narrow_kv_cache_equals_the_python_loop(tiny_q4_k_m, step_runner_cls, kv_dtype):
    """--kv-cache-dtype float16 / bfloat16 under float32 activations: the driver runs it,
    bit for bit the loop's logits."""
    cfg, path, _ = tiny_q4_k_m
    _assert_driver_equals_loop(_load(cfg, path, "packed32"), functools.partial(step_runner_cls, kv_dtype=kv_dtype))


@needs_kernels
@needs_ops
def test_models_the_driver_cannot_run_take_the_loop(tiny_q4_k_m):
    cfg, path, _ = tiny_q4_k_m
    dense = _load(cfg, path, "float32")  # explicit float32: dense weights, no blocks
    assert layer_driver.build_plan(dense) is None
    packed = _load(cfg, path, "packed32")
    assert layer_driver.build_plan(packed) is not None
    attn = packed.model.layers[0].self_attn
    attn.o_proj = torch.nn.Identity()  # a wrapped linear (LoRA, tensor parallel) is not a packed Linear
    assert layer_driver.build_plan(packed) is None


@needs_kernels
@needs_ops
def test_qwen3_qk_norms_equal_the_python_loop(tiny_q4_k_m, step_runner_cls):
    """Qwen3's per-head RMSNorm on q and k (random weights here) before RoPE."""
    from llmserve.models.llama import RMSNorm
    cfg, path, _ = tiny_q4_k_m
    model = _load(cfg, path, "packed32")
    g = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.qk_norm = True
        attn.q_norm, attn.k_norm = RMSNorm(attn.head_dim, 1e-6, torch.float32), RMSNorm(attn.head_dim, 1e-6, torch.float32)
        attn.q_norm.weight.copy_(1 + 0.3 * torch.randn(attn.head_dim, generator=g))
        attn.k_norm.weight.copy_(1 + 0.3 * torch.randn(attn.head_dim, generator=g))
    _assert_driver_equals_loop(model, step_runner_cls)
    model.model.layers[1].self_attn.k_norm.eps = 1e-5  # norms of different eps: the loop runs it
    assert layer_driver.build_plan(model) is None


@needs_kernels
@needs_ops
def test_plan_is_rebuilt_when_the_weights_change(tiny_q4_k_m):
    cfg, path, _ = tiny_q4_k_m
    model = _load(cfg, path, "packed32")
    first = layer_driver.plan_for(model)
    assert first is not None and layer_driver.plan_for(model) is first
    qkv = model.model.layers[0].self_attn.qkv_proj
    qkv.set_packed(copy.copy(qkv.qweight), qkv.packed_max_rows)  # a reload replaces the blocks
    second = layer_driver.plan_for(model)
    assert second is not first
    down = model.model.layers[0].mlp.down_proj  # a middle layer's linear (not in the cheap ids)
    down.set_packed(copy.copy(down.qweight), down.packed_max_rows)
    assert layer_driver.plan_for(model) is not second


@needs_kernels
@needs_ops
def test_wrong_linear_abi_is_refused():
    from llmserve.ops.quant_ops import get_quant_ops
    qops = get_quant_ops()
    with pytest.raises(RuntimeError, match="ABI"):
        get_cpu_ops().LlamaLayers(qops.packed_linear_address(), qops.packed_linear_abi() + 1, 4, 2, 64, 320)
