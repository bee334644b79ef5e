"""EngineArgs and ``LLM`` kwargs as vLLM users write them: vLLM's names, defaults and
normalisations; a clear error naming each value this engine cannot honour yet; the closest
field for a typo; CLI flags generated from every field; the offline LLM surface
(from_engine_args, enqueue/enqueue_chat/wait_for_completion, use_tqdm as a callable)."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from types import SimpleNamespace

import cloudpickle
import pytest

from llmserve import LLM, EngineArgs, SamplingParams
from llmserve.config import (CacheConfig, CompilationConfig, CompilationMode, EngineConfig, KVTransferConfig,
                             VllmConfig)
from llmserve.engine_args import AsyncEngineArgs, log_non_default_args
from llmserve.worker.model_runner import ModelRunner


class MyWorker:
    """A user's worker class (vLLM's ``worker_cls``)."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, save_tiny_model_fn):
    path = tmp_path_factory.mktemp("args_model")
    save_tiny_model_fn("llama", str(path))
    return str(path)


def _args(tiny_dir, **kw) -> EngineArgs:
    return EngineArgs(model=tiny_dir, tokenizer="SmolLM2-135M-Instruct", device="cpu", max_model_len=128, **kw)


def _llm(tiny_dir, **kw) -> LLM:
    return LLM(tiny_dir, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
               kv_cache_memory="16MiB", max_model_len=128, max_num_batched_tokens=128, **kw)


def test_config_is_vllm_config_with_the_old_name_kept(tiny_dir):
    assert EngineConfig is VllmConfig
    cfg = _args(tiny_dir).create_engine_config()
    assert isinstance(cfg, VllmConfig)
    assert (cfg.parallel_config.tensor_parallel_size, cfg.parallel_config.data_parallel_size) == (1, 1)
    assert cfg.compilation_config == CompilationConfig() and cfg.kv_transfer_config is None
    assert cfg.shutdown_timeout == 0


def test_unknown_kwarg_names_the_closest_field():
    with pytest.raises(TypeError, match="'max_model_length'; did you mean 'max_model_len'"):
        EngineArgs(max_model_length=10)
    with pytest.raises(TypeError, match="'disable_log_request'; did you mean 'disable_log_requests'"):
        AsyncEngineArgs(disable_log_request=True)
    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'gpu_mem_utilization'; "
                                        r"did you mean 'gpu_memory_utilization'"):
        LLM("x", gpu_mem_utilization=0.5)
    with pytest.raises(TypeError, match="'zzz'$"):
        EngineArgs(zzz=1)


def test_compilation_config_int_and_dict_as_vllm(tiny_dir, caplog):
    assert EngineArgs(compilation_config=3).compilation_config == CompilationConfig(mode=CompilationMode(3))
    assert EngineArgs(compilation_config=0).compilation_config.mode is CompilationMode.NONE
    d = EngineArgs(compilation_config={"mode": 2, "backend": "eager"}).compilation_config
    assert (d.mode, d.backend) == (CompilationMode.DYNAMO_TRACE_ONCE, "eager")
    for bad in (7, {"not_a_field": 1}, "not json"):
        with pytest.raises(ValueError, match="compilation_config"):
            EngineArgs(compilation_config=bad)
    with caplog.at_level(logging.WARNING):
        cfg = _args(tiny_dir, compilation_config=3).create_engine_config()
    assert cfg.compilation_config.mode is CompilationMode.VLLM_COMPILE
    assert cfg.compilation_config.effective_mode is CompilationMode.NONE
    assert "runs eagerly" in caplog.text


def test_kv_transfer_config_dict_and_invalid_as_vllm(tiny_dir, caplog):
    kv = EngineArgs(kv_transfer_config={"kv_role": "kv_both"}).kv_transfer_config
    assert kv == KVTransferConfig(kv_role="kv_both")
    for bad in ({"kv_role": "leader"}, {"kv_connector": "X"}, {"no_such_key": 1}):
        caplog.clear()
        with caplog.at_level(logging.ERROR), pytest.raises(ValueError, match="Invalid 'kv_transfer_config' provided: "):
            EngineArgs(kv_transfer_config=bad)
        assert "Failed to convert 'kv_transfer_config'" in caplog.text
    with pytest.raises(ValueError, match="Invalid 'kv_transfer_config' provided: "):
        LLM("x", kv_transfer_config={"kv_role": "leader"})
    _args(tiny_dir, kv_transfer_config={"kv_role": "kv_both"}).create_engine_config()  # no connector: fine
    with pytest.raises(ValueError, match="unknown kv_connector 'NixlConnector'; known connectors: .*"
                                         "SharedStorageConnector"):
        _args(tiny_dir, kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_both"}
              ).create_engine_config()


def test_worker_cls_class_is_cloudpickled(tiny_dir):
    args = EngineArgs(worker_cls=MyWorker)
    assert isinstance(args.worker_cls, bytes) and cloudpickle.loads(args.worker_cls) is MyWorker
    with pytest.raises(ValueError, match="worker_cls=<class> is not supported by this engine: .*supported: .auto."):
        _args(tiny_dir, worker_cls=MyWorker).create_engine_config()
    for same in (ModelRunner, "llmserve.worker.model_runner.ModelRunner", "auto"):
        cfg = _args(tiny_dir, worker_cls=same).create_engine_config()
        assert cfg.parallel_config.resolve_worker_cls() in (ModelRunner, None)
    with pytest.raises(ValueError, match="worker_cls"):
        _args(tiny_dir, worker_cls="no.such.Worker").create_engine_config()


def test_parallel_sizes_beyond_one_are_clear_errors(tiny_dir):
    with pytest.raises(ValueError, match=r"data_parallel_size=2\) is not supported for single-process usage.*"
                                         r"examples/offline_inference/data_parallel.py"):
        LLM("x", data_parallel_size=2)
    for name in ("pipeline_parallel_size",):
        with pytest.raises(ValueError, match=f"{name}=2 is not supported by this engine: supported: 1"):
            _args(tiny_dir, **{name: 2}).create_engine_config()
        with pytest.raises(ValueError, match=name):
            _args(tiny_dir, **{name: 0}).create_engine_config()
    # tensor and data parallel are supported (tests/executor/test_tensor_parallel.py,
    # tests/engine/test_data_parallel.py); 0 is still refused
    for name in ("tensor_parallel_size", "data_parallel_size"):
        assert getattr(_args(tiny_dir, **{name: 2}).create_engine_config().parallel_config, name) == 2
        with pytest.raises(ValueError, match=name):
            _args(tiny_dir, **{name: 0}).create_engine_config()


@pytest.mark.parametrize("name,value", [
    ("distributed_executor_backend", "external_launcher"), ("tokenizer_mode", "slow"), ("skip_tokenizer_init", True),
    ("kv_cache_dtype", "fp8"), ("cpu_offload_gb", 4.0), ("long_prefill_token_threshold", 128),
    ("max_num_partial_prefills", 2), ("max_long_partial_prefills", 2), ("async_scheduling", True),
    ("load_format", "dummy"), ("quantization", "awq"), ("quantization", "gguf"), ("load_format", "gguf")])
def test_values_not_honoured_yet_raise_naming_the_field(tiny_dir, name, value):
    with pytest.raises(ValueError, match=name):
        _args(tiny_dir, **{name: value}).create_engine_config()


def test_kv_cache_dtype_narrows_a_float32_model_only(tiny_dir):
    """--kv-cache-dtype (vLLM's names): float16 / bfloat16 under a float32 model; a bfloat16
    model keeps its own dtype; fp8 is refused (test above). "auto" is the model's dtype but
    for quantized weights on the packed kernels under float32 (llama.cpp's float16 cache)."""
    for name in ("float16", "bfloat16", "float32"):
        cfg = _args(tiny_dir, dtype="float32", kv_cache_dtype=name).create_engine_config()
        assert cfg.cache_config.kv_dtype(cfg.model_config) == name
    cfg = _args(tiny_dir, dtype="bfloat16", kv_cache_dtype="bfloat16").create_engine_config()
    assert cfg.cache_config.kv_dtype(cfg.model_config) == "bfloat16"
    for bad in ("float16", "float32"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype='{bad}' needs a float32 model"):
            _args(tiny_dir, dtype="bfloat16", kv_cache_dtype=bad).create_engine_config()
    auto = CacheConfig()
    dense = _args(tiny_dir).create_engine_config().model_config  # safetensors: the exact dtype
    assert auto.kv_dtype(dense) == dense.dtype
    for dtype, packed, quant, want in [("float32", True, "gguf", "float16"),
                                       ("float32", True, "compressed-tensors", "float16"),
                                       ("float32", False, "gguf", "float32"),  # --dtype float32: exact
                                       ("bfloat16", False, "gguf", "bfloat16")]:
        mc = SimpleNamespace(dtype=dtype, packed_float32=packed, quantization=quant)
        assert auto.kv_dtype(mc) == want


def test_accepted_fields_reach_the_config(tiny_dir):
    cfg = _args(tiny_dir, gpu_memory_utilization=0.5, kv_sharing_fast_prefill=True, max_logprobs=5,
                distributed_executor_backend="mp", enforce_eager=False, tokenizer_mode="hf",
                load_format="safetensors", renderer_num_workers=4, shutdown_timeout=30,
                kv_cache_memory_bytes=1 << 24, scheduling_policy="priority").create_engine_config()
    assert cfg.cache_config.gpu_memory_utilization == 0.5 and cfg.cache_config.kv_sharing_fast_prefill
    assert cfg.cache_config.kv_cache_memory_bytes == 1 << 24
    assert cfg.model_config.max_logprobs == 5 and cfg.model_config.renderer_num_workers == 4
    assert cfg.parallel_config.distributed_executor_backend == "mp" and cfg.shutdown_timeout == 30
    assert cfg.scheduler_config.policy == "priority"
    for bad in (dict(gpu_memory_utilization=1.5), dict(renderer_num_workers=0), dict(shutdown_timeout=-1),
                dict(kv_cache_memory="1GiB", kv_cache_memory_bytes=1 << 30), dict(max_logprobs=-2)):
        with pytest.raises(ValueError, match=next(iter(bad)).split("_bytes")[0]):
            _args(tiny_dir, **bad).create_engine_config()


def test_disable_sliding_window_caps_the_context(tmp_path):
    from transformers import MistralConfig

    MistralConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                  sliding_window=64).save_pretrained(tmp_path)
    base = dict(model=str(tmp_path), tokenizer="SmolLM2-135M-Instruct", device="cpu")
    assert EngineArgs(**base).create_engine_config().model_config.max_model_len == 512
    assert EngineArgs(**base, disable_sliding_window=True).create_engine_config().model_config.max_model_len == 64


def test_every_field_is_a_cli_flag_with_vllms_parsing():
    from llmserve.entrypoints.openai.cli_args import make_arg_parser

    parser = make_arg_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    for f in dataclasses.fields(AsyncEngineArgs):
        assert "--" + f.name.replace("_", "-") in flags, f.name
    ns = parser.parse_args(["--compilation-config", "3", "--kv-transfer-config", '{"kv_role": "kv_both"}',
                            "--override-generation-config", '{"temperature": 0.5}', "--shutdown-timeout", "5",
                            "--renderer-num-workers", "4", "--data-parallel-size", "1", "--worker-cls", "auto",
                            "--generation-config", "vllm", "--kv-sharing-fast-prefill"])
    args = AsyncEngineArgs.from_cli_args(ns)
    assert args.compilation_config.mode is CompilationMode.VLLM_COMPILE
    assert args.kv_transfer_config == KVTransferConfig(kv_role="kv_both")
    assert args.override_generation_config == {"temperature": 0.5}
    assert (args.shutdown_timeout, args.renderer_num_workers, args.generation_config) == (5, 4, "vllm")
    assert args.kv_sharing_fast_prefill is True
    with pytest.raises(SystemExit):
        argparse.ArgumentParser.parse_args(parser, ["--override-generation-config", "[1]"])


def test_log_non_default_args(caplog):
    with caplog.at_level(logging.INFO, logger="llmserve.engine_args"):
        diff = log_non_default_args(EngineArgs(max_model_len=99, compilation_config=3))
    assert diff == {"max_model_len": 99, "compilation_config": CompilationConfig(mode=CompilationMode(3))}
    assert "non-default args" in caplog.text and "max_model_len" in caplog.text
    assert log_non_default_args(EngineArgs()) == {}
    assert log_non_default_args(argparse.Namespace(seed=3, port=80)) == {"seed": 3}


def test_llm_kwargs_as_vllm(tiny_dir, caplog):
    """swap_space popped with a DeprecationWarning; renderer_num_workers > 1 warns that it
    has no effect offline; compilation_config=3 normalised; stats logging off by default;
    non-default args logged; generate works."""
    with caplog.at_level(logging.INFO), pytest.warns(DeprecationWarning, match="swap_space"):
        llm = _llm(tiny_dir, swap_space=4, renderer_num_workers=4, compilation_config=3)
    try:
        assert "renderer_num_workers=4 has no effect on the offline LLM" in caplog.text
        assert "non-default args" in caplog.text
        cfg = llm.llm_engine.config
        assert cfg.compilation_config.mode is CompilationMode.VLLM_COMPILE
        assert cfg.observability_config.log_stats is False
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_llm_from_engine_args_enqueue_and_tqdm_callable(tiny_dir):
    engine_args = EngineArgs(model=tiny_dir, tokenizer="SmolLM2-135M-Instruct", dtype="float32",
                             kv_cache_memory="16MiB", max_model_len=128, max_num_batched_tokens=128)
    llm = LLM.from_engine_args(engine_args, multiprocess_mode=False)
    try:
        assert llm.engine_args == engine_args  # cls(**vars(engine_args)), as vLLM
        sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        ref = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [8, 9]], sp, use_tqdm=False)]
        bars = []

        def make_bar(**kw):
            from tqdm import tqdm

            bars.append(kw)
            return tqdm(**kw)

        ids = llm.enqueue([[5, 6, 7], [8, 9]], sp)
        chat_ids = llm.enqueue_chat([{"role": "user", "content": "hi"}], sp)
        assert len(ids) == 2 and len(chat_ids) == 1 and not set(ids) & set(chat_ids)
        # a generate() in between runs the enqueued requests too; their outputs are kept
        mid = llm.generate([8, 9], sp, use_tqdm=False)
        assert mid[0].outputs[0].token_ids == ref[1]
        outs = llm.wait_for_completion(use_tqdm=make_bar)
        assert [o.request_id for o in outs] == ids + chat_ids
        assert [o.outputs[0].token_ids for o in outs[:2]] == ref
        assert len(outs[2].outputs[0].token_ids) == 4
        assert bars and bars[0]["total"] == 3
        assert llm.wait_for_completion(use_tqdm=False) == []
    finally:
        llm.shutdown()


def test_llm_from_engine_args_applies_the_init_guards(caplog):
    """from_engine_args goes through LLM.__init__ (issue 29): the data-parallel refusal
    applies before any engine starts; the renderer warning is logged once per process."""
    from llmserve.entrypoints import llm as llm_mod

    with pytest.raises(ValueError, match="data_parallel_size=2"):
        LLM.from_engine_args(EngineArgs(model="SmolLM2-135M-Instruct", data_parallel_size=2))
    with caplog.at_level(logging.WARNING, logger="llmserve.entrypoints.llm"):
        llm_mod._warn_renderer_workers(7)
        caplog.clear()
        llm_mod._warn_renderer_workers(7)
    assert "renderer_num_workers=7" not in caplog.text


def test_a_kv_tier_folder_that_cannot_be_made_is_a_config_error(tiny_dir, tmp_path):
    """A shared_storage_path that is a file or lies under /proc fails at config time, naming
    the field, not in the engine after the model has loaded (fresh-user trial)."""
    a_file = tmp_path / "kvfile"
    a_file.write_text("x")
    for path in (str(a_file), "/proc/no_kv_here", str(a_file / "below")):
        kv = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": path}}
        with pytest.raises(ValueError, match="shared_storage_path .*cannot be used as the KV tier's folder"):
            _args(tiny_dir, kv_transfer_config=kv).create_engine_config()
    fine = str(tmp_path / "new" / "tier")
    kv["kv_connector_extra_config"]["shared_storage_path"] = fine
    _args(tiny_dir, kv_transfer_config=kv).create_engine_config()
    assert os.path.isdir(fine)


def test_served_model_name_follows_the_served_name_rule():
    """A served name reaches log lines and the ``model_name`` label of every metric: the
    rule of llmserve.served_names, as for LoRA adapter names (also through --extra-model
    JSON, which builds its EngineArgs the same way)."""
    names = ["org/model:tag", "gpt-4o-mini", "llama3.2:1b-q4_K_M"]
    assert EngineArgs(model="m", served_model_name=names).served_model_name == names
    for bad in ("a\nINFO forged", "tab\there", " lead", "a,b", "", "x" * 257, "zero\u200bwidth"):
        with pytest.raises(ValueError, match="served_model_name") as e:
            EngineArgs(model="m", served_model_name=["ok", bad])
        assert "\n" not in str(e.value)
