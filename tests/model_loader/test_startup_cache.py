"""The GGUF start-up cache (issue 16): a warm start yields exactly what reading the GGUF
file yields (config, tokenizer, dequantized and packed weights); a damaged entry falls
back to the file; the entry is keyed by the file's content."""
from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from llmserve.model_loader import startup_cache
from llmserve.model_loader.gguf_loader import iterate_gguf_weights


@pytest.fixture()
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setattr(startup_cache, "cache_root", lambda: str(root))
    return root


def _tiny_gguf(path: str, seed: int = 0) -> None:
    import gguf
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", rng.standard_normal((8, 64)).astype(np.float32))
    for name, qtype in (("blk.0.attn_q.weight", gguf.GGMLQuantizationType.Q8_0),
                        ("blk.0.attn_k.weight", gguf.GGMLQuantizationType.Q4_1),
                        ("blk.0.ffn_up.weight", gguf.GGMLQuantizationType.Q4_0)):
        q = gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), qtype)
        w.add_tensor(name, q, raw_dtype=qtype)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_CFG = SimpleNamespace(num_attention_heads=2, num_key_value_heads=2)


def _load(path: str, packed):
    return [(n, t.clone()) for n, t in startup_cache.cached_gguf_weights(
        path, torch.bfloat16, packed, lambda: iterate_gguf_weights(path, _CFG, torch.bfloat16, packed))]


def test_weights_round_trip_and_damaged_entry(tmp_path, cache_root):
    path = str(tmp_path / "m.gguf")
    _tiny_gguf(path)
    ref_packed: dict = {}
    ref = list(iterate_gguf_weights(path, _CFG, torch.bfloat16, ref_packed))
    assert len(ref_packed) == 3
    cold_packed: dict = {}
    cold = _load(path, cold_packed)
    cache_file = os.path.join(startup_cache.entry_dir(path), "weights-bfloat16-packed.safetensors")
    assert os.path.isfile(cache_file)
    for damaged in (False, True):
        if damaged:
            with open(cache_file, "wb") as f:
                f.write(b"not a safetensors file")
        warm_packed: dict = {}
        warm = _load(path, warm_packed)
        for got in (cold, warm):  # the same tensors (in any order: load_weights goes by name)
            assert sorted(n for n, _ in got) == sorted(n for n, _ in ref)
            got_d = dict(got)
            for name, b in ref:
                assert got_d[name].dtype == b.dtype == torch.bfloat16 and torch.equal(got_d[name], b)
        for got in (cold_packed, warm_packed):
            assert sorted(got) == sorted(ref_packed)
            for name, (qtype, raw) in ref_packed.items():
                assert got[name][0] == qtype and torch.equal(got[name][1], raw)
    # The damaged entry was rewritten by the fallback read.
    assert os.path.getsize(cache_file) > 100
    # Without packed weights wanted: its own entry, no packed blocks reported.
    plain = _load(path, None)
    assert len(plain) == len(ref)
    assert os.path.isfile(os.path.join(startup_cache.entry_dir(path), "weights-bfloat16.safetensors"))


def test_entry_keyed_by_content(tmp_path, cache_root):
    path = str(tmp_path / "m.gguf")
    _tiny_gguf(path, seed=0)
    with open(path, "rb") as f:
        assert startup_cache.file_hash(path) == hashlib.sha256(f.read()).hexdigest()
    first = startup_cache.entry_dir(path)
    assert startup_cache.entry_dir(path) == first          # remembered per stat
    os.unlink(path)
    _tiny_gguf(path, seed=1)                                # other bytes at the same path
    assert startup_cache.entry_dir(path) != first
    other = str(tmp_path / "copy.gguf")
    with open(path, "rb") as src, open(other, "wb") as dst:
        dst.write(src.read())
    assert startup_cache.entry_dir(other) == startup_cache.entry_dir(path)  # same bytes, same entry


@pytest.mark.slow  # ~10 s on the real model: the config and tokenizer cache (the weights cache is tested above); `make test-all`
def test_smollm2_config_and_tokenizer_from_cache(cache_root):
    """The real GGUF: config and tokenizer read back from the cache equal the converted ones."""
    from llmserve.model_loader.resolve import _load_hf_config_cached, resolve_model
    from llmserve.tokenizer import _load_tokenizer

    r = resolve_model("SmolLM2-135M-Instruct")
    cold_cfg = _load_hf_config_cached.__wrapped__(r.path, r.gguf_file)
    cold_tok = _load_tokenizer.__wrapped__(r.path, r.gguf_file, None)
    hf_dir = os.path.join(startup_cache.entry_dir(os.path.join(r.path, r.gguf_file)), "hf")
    assert os.path.isfile(os.path.join(hf_dir, "config.json"))
    assert os.path.isfile(os.path.join(hf_dir, "tokenizer_config.json"))
    warm_cfg = _load_hf_config_cached.__wrapped__(r.path, r.gguf_file)
    warm_tok = _load_tokenizer.__wrapped__(r.path, r.gguf_file, None)
    skip = {"_name_or_path", "transformers_version"}
    assert ({k: v for k, v in warm_cfg.to_dict().items() if k not in skip}
            == {k: v for k, v in cold_cfg.to_dict().items() if k not in skip})
    assert warm_cfg.architectures == ["LlamaForCausalLM"]
    text = "Hello, world! 1234 <|im_start|>user\nnaïve café 日本語<|im_end|>"
    assert warm_tok(text).input_ids == cold_tok(text).input_ids
    assert warm_tok.eos_token_id == cold_tok.eos_token_id and warm_tok.bos_token_id == cold_tok.bos_token_id
    assert len(warm_tok) == len(cold_tok)
    msgs = [{"role": "user", "content": "Hi!"}]
    assert (warm_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == cold_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))


def test_a_new_entry_retires_the_same_files_older_entries(tmp_path, cache_root, monkeypatch):
    """An upgrade (FORMAT_VERSION or transformers) keys the same file anew: the first
    cold start of the new key removes the file's old entry, and only that one."""
    path, other = str(tmp_path / "m.gguf"), str(tmp_path / "o.gguf")
    _tiny_gguf(path, seed=0)
    _tiny_gguf(other, seed=1)
    monkeypatch.setattr(startup_cache, "FORMAT_VERSION", "old")
    old_entry = startup_cache.entry_dir(path)
    startup_cache.load_hf_object(path, "obj.txt", lambda d: "cached", lambda: _Saveable())
    keep = startup_cache.entry_dir(other)
    startup_cache.load_hf_object(other, "obj.txt", lambda d: "cached", lambda: _Saveable())
    unmarked = cache_root / "from-before-marks"
    (unmarked / "hf").mkdir(parents=True)
    monkeypatch.setattr(startup_cache, "FORMAT_VERSION", "new")
    new_entry = startup_cache.entry_dir(path)
    assert new_entry != old_entry and os.path.isdir(old_entry)
    assert isinstance(startup_cache.load_hf_object(path, "obj.txt", lambda d: "cached", lambda: _Saveable()),
                      _Saveable)  # cold under the new key
    assert not os.path.exists(old_entry) and os.path.isdir(new_entry)
    assert os.path.isdir(keep) and os.path.isdir(unmarked)  # another file's entry; an unmarked one
    assert startup_cache.load_hf_object(path, "obj.txt", lambda d: "cached", lambda: _Saveable()) == "cached"


class _Saveable:
    """A config/tokenizer stand-in: ``save_pretrained`` writes one marker file."""

    def save_pretrained(self, d: str) -> None:
        with open(os.path.join(d, "obj.txt"), "w") as f:
            f.write("x")
