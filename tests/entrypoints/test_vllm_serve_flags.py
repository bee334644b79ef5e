"""Every `vllm serve` flag (vllm_serve_flags.txt) is known to `llmserve serve`: honoured,
a no-op with its reason in --help, or refused with an error naming it; the table in
docs/vllm_serve_flags.md is current."""
from __future__ import annotations

import argparse
import os

import pytest

from llmserve.entrypoints.cli import make_parser
from llmserve.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from llmserve.entrypoints.openai.vllm_compat_args import COMPAT_FLAGS, NOOP, REFUSED, read_vllm_flags
from llmserve.entrypoints.openai.vllm_flags_table import HONOURED, OWN_FLAG_KINDS, classify, render_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = read_vllm_flags()
# a value each flag's type and choices accept (default "1")
SAMPLE = {"--uvicorn-log-level": "debug", "--chat-template-content-format": "string", "--dtype": "float32",
          "--scheduling-policy": "priority", "--tokenizer-mode": "hf", "--load-format": "safetensors",
          "--distributed-executor-backend": "mp", "--kv-cache-dtype": "auto", "--generation-config": "vllm",
          "--override-generation-config": "{}", "--compilation-config": "0", "--allowed-origins": "*",
          "--allowed-methods": "*", "--allowed-headers": "*", "--quantization": "gguf", "--worker-cls": "auto",
          "--kv-transfer-config": "{}", "--lora-modules": "adapter=/tmp/adapter", "--lora-dtype": "float32"}


def _argv(vf, value=None):
    if vf.shape == "bool":
        return [vf.flag]
    return [vf.flag, value if value is not None else SAMPLE.get(vf.flag, "1")]


def _parse(argv):
    return make_parser(["serve", *argv]).parse_args(["serve", *argv])


def test_the_list_is_vllm_v011_sized_and_has_the_issue_flags():
    names = {vf.flag for vf in FLAGS}
    assert len(FLAGS) == len(names) == 182
    for flag in ("--enable-prompt-tokens-details", "--enable-force-include-usage", "--enable-server-load-tracking",
                 "--enable-request-id-headers", "--enable-tokenizer-info-endpoint", "--enable-lora"):
        assert flag in names


@pytest.mark.parametrize("vf", FLAGS, ids=lambda vf: vf.flag)
def test_every_vllm_flag_and_alias_parses(vf):
    """No flag (or short alias) of vllm serve is "unrecognized"."""
    for name in (vf.flag, *vf.aliases):
        args = _parse([name, *_argv(vf)[1:]])
        assert hasattr(args, vf.dest) or vf.flag == "--model"


def test_table_is_current_and_classifies_every_flag():
    rows = classify()
    assert [r for r in rows if r.kind is None] == []
    with open(os.path.join(ROOT, "docs", "vllm_serve_flags.md"), encoding="utf-8") as f:
        assert f.read() == render_markdown(rows), "regenerate: python -m llmserve.entrypoints.openai.vllm_flags_table"
    kinds = {r.flag: r.kind for r in rows}
    assert kinds["--enable-prompt-tokens-details"] == HONOURED
    assert kinds["--enable-request-id-headers"] == NOOP
    for flag in ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras",
                 "--lora-dtype"):  # issue 28
        assert kinds[flag] == HONOURED, flag
    assert kinds["--enable-sleep-mode"] == HONOURED  # issue 31
    counts = {k: sum(1 for r in rows if r.kind == k) for k in (HONOURED, NOOP, REFUSED)}
    assert sum(counts.values()) == 182 and min(counts.values()) > 0
    # the policy table names no flag that vLLM does not have (no stale entries)
    assert set(COMPAT_FLAGS) <= {vf.flag for vf in FLAGS}
    assert set(OWN_FLAG_KINDS) <= {vf.flag for vf in FLAGS}


def test_help_gives_each_noop_and_refused_flag_its_reason():
    parser = make_arg_parser()
    for flag, (kind, reason, _) in COMPAT_FLAGS.items():
        text = parser._option_string_actions[flag].help
        assert text.startswith("No-op" if kind == NOOP else "Refused") and reason in text, flag


@pytest.mark.parametrize("flag", [f for f, (k, _, _) in COMPAT_FLAGS.items() if k == REFUSED])
def test_refused_flags_fail_naming_the_flag(flag):
    vf = next(v for v in FLAGS if v.flag == flag)
    args = _parse(_argv(vf, "2"))
    with pytest.raises(ValueError) as e:
        validate_parsed_serve_args(args)
    assert str(e.value).startswith(f"{flag} is not supported by this engine: ")


def test_refused_flags_accept_vllms_default_and_noops_pass():
    args = _parse(["--api-server-count", "1", "--no-enable-lora", "--data-parallel-backend", "mp",
                   "--swap-space", "4", "--enable-request-id-headers", "--max-loras", "2", "-tp", "1"])
    validate_parsed_serve_args(args)
    assert args.tensor_parallel_size == 1


def test_refused_lora_bias_error_names_the_flag_and_why(capsys):
    from llmserve.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--enable-lora", "--enable-lora-bias"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--enable-lora-bias is not supported by this engine: LoRA bias weights are not applied" in err


def test_short_aliases_reach_the_engine_fields():
    args = _parse(["-tp", "1", "-pp", "1", "-dp", "1", "-q", "gguf", "-O0"])
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size) == (1, 1, 1)
    assert args.quantization == "gguf"
    assert args.compilation_config == "0"


def test_frontend_flag_values():
    args = _parse(["--enable-log-requests", "--max-log-len", "7", "--middleware", "a.b", "--middleware", "c.d"])
    validate_parsed_serve_args(args)
    assert args.disable_log_requests is False and args.max_log_len == 7 and args.middleware == ["a.b", "c.d"]
    with pytest.raises(ValueError, match="--chat-template-content-format openai"):
        validate_parsed_serve_args(_parse(["--chat-template-content-format", "openai"]))
    with pytest.raises(ValueError, match="--max-log-len"):
        validate_parsed_serve_args(_parse(["--max-log-len", "-1"]))


def test_vllm_flags_file_lines_are_well_formed():
    with open(os.path.join(ROOT, "llmserve", "entrypoints", "openai", "vllm_serve_flags.txt")) as f:
        lines = [ln for ln in f if ln.strip() and not ln.startswith("#")]
    assert len(lines) == len(FLAGS)


def test_env_vars_read_the_vllm_twin_and_are_listed_in_the_readme(monkeypatch):
    from llmserve import envs
    from llmserve.engine_config_builder import _default_kv_cache_bytes

    monkeypatch.delenv("LLMSERVE_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert _default_kv_cache_bytes(4 << 30) == 2 << 30
    monkeypatch.setenv("LLMSERVE_CPU_KVCACHE_SPACE", "1.5")  # the llmserve name wins
    assert _default_kv_cache_bytes(4 << 30) == 3 << 29
    monkeypatch.delenv("LLMSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert make_arg_parser().parse_args([]).api_key == "from-vllm"
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for name, (vllm_name, _) in envs.ENV_VARS.items():
        assert f"`{name}`" in readme and (vllm_name is None or f"`{vllm_name}`" in readme), name
    # every LLMSERVE_* variable the code reads goes through envs (one list)
    import subprocess

    found = subprocess.run(["grep", "-rhoE", "--include=*.py", "LLMSERVE_[A-Z_]+", os.path.join(ROOT, "llmserve")],
                           capture_output=True, text=True).stdout.split()
    assert set(found) <= set(envs.ENV_VARS), set(found) - set(envs.ENV_VARS)


def test_config_file_flags_come_first_and_the_command_line_wins(tmp_path):
    from llmserve.entrypoints.openai.vllm_compat_args import expand_config_file

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 9001\nmax_num_seqs: 8\nenable-prompt-tokens-details: true\n"
                   "enable_prefix_caching: false\nserved-model-name: [a, b]\n")
    argv = ["serve", "--config", str(cfg), "--port", "9002"]
    parser = make_parser(argv)
    args = parser.parse_args(expand_config_file(argv, parser))
    assert args.port == 9002 and args.max_num_seqs == 8 and args.enable_prompt_tokens_details
    assert args.enable_prefix_caching is False and args.served_model_name == ["a", "b"]
    with pytest.raises(SystemExit):
        expand_config_file(["serve", "--config", str(tmp_path / "missing.yaml")], parser)
