"""Start-up errors as the command line's user reads them (cli_args.flag_message): the
configs name dataclass fields (right for ``LLM(...)``), the CLI names the flag typed
(``--kv-cache-dtype int4``), and each refusal says what is supported."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from llmserve.engine_args import EngineArgs
from llmserve.engine_config_builder import _SUPPORTED, check_supported
from llmserve.entrypoints.openai.cli_args import cli_flags, flag_message, make_arg_parser


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return make_arg_parser(argparse.ArgumentParser())


@pytest.mark.parametrize("field_text, cli_text", [
    ("kv_cache_dtype='int4' is not supported", "--kv-cache-dtype int4 is not supported"),
    ("needs a float32 model (dtype='bfloat16')", "needs a float32 model (--dtype bfloat16)"),
    ("async_scheduling=True is not supported; supported: async_scheduling=False.",
     "--async-scheduling is not supported; supported: --no-async-scheduling."),
    ("pipeline_parallel_size=2 is not", "--pipeline-parallel-size 2 is not"),
    ("max_num_batched_tokens (4) must be >= max_model_len (8)", "--max-num-batched-tokens (4) must be >= --max-model-len (8)"),
    ("kv_events_config.publisher must be one of", "publisher in --kv-events-config must be one of"),
    ("port must be in [0, 65535], got 70000", "--port must be in [0, 65535], got 70000"),
    ("dtype: unknown", "--dtype: unknown"),
    ("served_model_name='a b' is", "--served-model-name 'a b' is"),
    # not flags: English words, file names, JSON keys and flags already spelled as typed
    ("quantization='gguf' but the model 'x' is not GGUF", "--quantization gguf but the model 'x' is not GGUF"),
    ("a directory holding a generation_config.json", "a directory holding a generation_config.json"),
    ("kv_role must be set when kv_connector is set", "kv_role must be set when kv_connector is set"),
    ("--data-parallel-backend must be 'mp'", "--data-parallel-backend must be 'mp'"),
])
def test_fields_become_the_flags_typed(parser, field_text, cli_text):
    assert flag_message(field_text, parser) == cli_text


def test_every_flag_is_its_field_spelled_with_dashes(parser):
    flags = cli_flags(parser)
    for f in ("kv_cache_dtype", "max_model_len", "enable_prefix_caching", "api_key", "tensor_parallel_size"):
        assert flags[f][0] == "--" + f.replace("_", "-")
    assert flags["enable_prefix_caching"][1] and not flags["kv_cache_dtype"][1]


# field -> a value check_supported refuses
_BAD = {"pipeline_parallel_size": 2, "distributed_executor_backend": "tpu", "tokenizer_mode": "mistral",
        "skip_tokenizer_init": True, "kv_cache_dtype": "fp8", "cpu_offload_gb": 4.0,
        "long_prefill_token_threshold": 64, "max_num_partial_prefills": 2, "max_long_partial_prefills": 2,
        "async_scheduling": True, "load_format": "pt", "worker_cls": "my.Worker"}


@pytest.mark.parametrize("name", sorted(_SUPPORTED))
def test_each_refusal_names_field_or_flag_and_what_is_supported(parser, name):
    """The LLM(...) message names the field; the CLI's the flag; both what is supported,
    and none reads as a bug to be fixed ("not supported yet")."""
    with pytest.raises(ValueError) as e:
        check_supported(EngineArgs(**{name: _BAD[name]}))
    text, cli = str(e.value), flag_message(str(e.value), parser)
    assert text.startswith(f"{name}=") and "supported: " in text and "yet" not in text
    assert cli.startswith("--" + name.replace("_", "-")) and name not in cli and "supported: " in cli


def test_serve_names_the_flag_and_the_supported_values():
    """End to end: the one line ``llmserve serve`` prints (before any model loads)."""
    proc = subprocess.run([sys.executable, "-m", "llmserve.entrypoints.cli", "serve", "--port", "0",
                           "--kv-cache-dtype", "int4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "llmserve serve: error: --kv-cache-dtype int4 is not supported by this engine: supported: "
        "'auto', 'bfloat16', 'float16' or 'float32' (no fp8 or integer caches).")


@pytest.mark.parametrize("argv, env, cli", [
    (["--kv-cache-memory", "0"], {}, "--kv-cache-memory must be a positive size, got '0'"),
    (["--kv-cache-memory", "lots"], {}, "--kv-cache-memory: cannot parse memory size 'lots'"),
    (["--kv-cache-memory-bytes", "0"], {}, "--kv-cache-memory-bytes must be a positive size, got 0"),
    ([], {"LLMSERVE_CPU_KVCACHE_SPACE": "-1"}, "LLMSERVE_CPU_KVCACHE_SPACE must be a positive number of GiB"),
    ([], {"VLLM_CPU_KVCACHE_SPACE": "-1"}, "VLLM_CPU_KVCACHE_SPACE must be a positive number of GiB"),
    (["--data-parallel-size", "2", "--data-parallel-external-lb", "--data-parallel-start-rank", "3"], {},
     "--data-parallel-start-rank must be in [0, --data-parallel-size 2), got 3"),
])
def test_a_config_field_fed_by_another_flag_names_the_one_typed(parser, monkeypatch, argv, env, cli):
    """A config field whose value comes from a flag of another name (CacheConfig's
    kv_cache_memory_bytes from --kv-cache-memory or $LLMSERVE_CPU_KVCACHE_SPACE; the
    external-LB rank from --data-parallel-start-rank) is checked where the source is known:
    ``--kv-cache-memory 0`` was told "--kv-cache-memory-bytes must be positive" (fresh-user
    trial), vLLM's alias flag having the config field's name."""
    from llmserve.engine_config_builder import _cache_config, _parallel_config

    for name in ("LLMSERVE_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = EngineArgs.from_cli_args(parser.parse_args(argv))
    build = _parallel_config if "--data-parallel-size" in argv else _cache_config
    with pytest.raises(ValueError) as e:
        build(args)
    message = flag_message(str(e.value), parser)
    assert message.startswith(cli), message
    assert set(re.findall(r"--[\w-]+", message)) <= set(argv), message  # only flags typed
