"""Tokenizer loading from GGUF metadata and HF dirs, chat templates and their overrides."""
from __future__ import annotations

import pytest

from tests.models.tiny_arch import finish_gguf

from llmserve.tokenizer import get_tokenizer, resolve_chat_template

MSGS = [{"role": "user", "content": "Hi"}]


def test_gguf_tokenizer_and_chat_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert len(tok) == 49152
    assert tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok("Hello world").input_ids) == "Hello world"


def test_cached_per_arguments(smollm2_resolved, smollm2_tokenizer):
    assert get_tokenizer(smollm2_resolved.path, smollm2_resolved.gguf_file) is smollm2_tokenizer
    # a model name or a .gguf path reach the same cached tokenizer
    assert get_tokenizer("SmolLM2-135M-Instruct") is smollm2_tokenizer
    assert get_tokenizer(smollm2_resolved.model_file) is smollm2_tokenizer


def test_chat_template_override_literal_and_file(smollm2_resolved, smollm2_tokenizer, tmp_path):
    literal = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    tok = get_tokenizer(smollm2_resolved.path, smollm2_resolved.gguf_file, chat_template=literal)
    assert tok is not smollm2_tokenizer
    assert tok.apply_chat_template(MSGS, tokenize=False) == "[user] Hi\n"
    f = tmp_path / "t.jinja"
    f.write_text(literal)
    assert resolve_chat_template(str(f)) == literal
    # the default tokenizer keeps its own template
    assert "<|im_start|>" in smollm2_tokenizer.chat_template
    with pytest.raises(ValueError, match="chat_template"):
        resolve_chat_template("no_such_template_file.jinja")


def test_hf_dir_tokenizer_roundtrip(smollm2_tokenizer, tmp_path):
    smollm2_tokenizer.save_pretrained(tmp_path)
    tok = get_tokenizer(str(tmp_path))
    ids = smollm2_tokenizer("The quick brown fox").input_ids
    assert tok("The quick brown fox").input_ids == ids
    assert tok.chat_template == smollm2_tokenizer.chat_template


def test_unknown_tokenizer_raises():
    with pytest.raises(ValueError, match="not found"):
        get_tokenizer("definitely/not-a-model")


def test_check_encodable_rejects_lone_surrogates():
    import pytest

    from llmserve.sampling_params import SamplingParamsError
    from llmserve.tokenizer import check_encodable

    check_encodable("plain", "prompt")
    check_encodable("caf\u00e9 \U0001F600", "prompt")  # real non-ASCII text is fine
    with pytest.raises(SamplingParamsError) as e:
        check_encodable("x\udc80y", "bad_words")
    assert e.value.param == "bad_words" and "U+DC80" in str(e.value) and "position 1" in str(e.value)


def _pieces(tok, text):
    return tok.convert_ids_to_tokens(tok(text, add_special_tokens=False).input_ids)


def test_gguf_tokenizer_splits_digits_first(smollm2_resolved, smollm2_tokenizer):
    """SmolLM2's GGUF says ``tokenizer.ggml.pre = "smollm"``: llama.cpp splits each digit
    off before GPT-2's regex, so a whitespace run before a digit stays one piece. Expected
    pieces: llama-perplexity's tokens of the GPL-3 text ("AND CONDITIONS\\n\\n  0. Definitions")."""
    import copy
    import os

    from tokenizers import pre_tokenizers

    from llmserve.tokenizer import _split_digits_first

    text = "AND CONDITIONS\n\n  0. Definitions. x  1"
    fixed = ["AND", "ĠCONDITIONS", "ĊĊĠĠ", "0", ".", "ĠDefinitions", ".", "Ġx", "ĠĠ", "1"]
    assert _pieces(smollm2_tokenizer, text) == fixed
    # what transformers' GGUF converter alone gives (and a start-up cache entry written
    # before the fix holds): GPT-2's regex gives the run's last space to the digit
    stale = copy.deepcopy(smollm2_tokenizer)
    stale.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert _pieces(stale, text)[2:5] == ["ĊĊĠ", "Ġ", "0"]
    _split_digits_first(stale, os.path.join(smollm2_resolved.path, smollm2_resolved.gguf_file))
    assert _pieces(stale, text) == fixed


def test_a_model_without_a_tokenizer_is_told_to_pass_one(tmp_path):
    # a weights-only folder said transformers' "...You need to have sentencepiece or tiktoken
    # installed...", a GGUF file without tokenizer.ggml.* "stating tokenizer None"
    import json

    import gguf
    import numpy as np

    folder = tmp_path / "weights_only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"has none of \['tokenizer.json'.*--tokenizer NAME_OR_PATH"):
        get_tokenizer(str(folder))
    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    finish_gguf(w)
    with pytest.raises(ValueError, match=r"no tokenizer.ggml.\* vocabulary; give .* --tokenizer NAME_OR_PATH"):
        get_tokenizer(str(path))
