"""The API server's transformers without torch (issue 31, llmserve/torch_hiding.py): a
server process that imports transformers with torch hidden gets the same config,
generation defaults, tokenizer and chat template as one with torch, never imports torch
for them, and can still import torch afterwards. The server side runs in a fresh
interpreter (this test process has imported torch already)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MODEL = "SmolLM2-135M-Instruct"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris? 12 + 30 =\n\n  42."},
            {"role": "assistant", "content": "Sure."},
            {"role": "user", "content": "naïve café 日本語 🙂 <|im_end|>"}]
TEXTS = ["Hello, world!", "\n\n  0. digits 1234567", "naïve café 日本語 🙂",
         "<|im_start|>user\nhi<|im_end|>", "  two  spaces\t\ttabs"]
# Paths and the version stamp name where a file was read, not what it says.
_SKIP_CONFIG_KEYS = {"_name_or_path", "transformers_version"}


def _plain(value) -> str:
    """A torch dtype and its transformers-without-torch string the same way: "float32"."""
    return str(value).removeprefix("torch.")


def snapshot(model: str) -> dict:
    """What the API server takes from transformers for ``model``, as JSON-able values:
    the engine config's model fields (hf_config, generation defaults, stop ids, context),
    tokenizer encodings and decodings, and the chat template rendered with and without
    tools. Run by the server-side interpreter and by this test process."""
    from llmserve.engine_args import EngineArgs
    from llmserve.tokenizer import get_model_tokenizer

    mc = EngineArgs(model=model).create_engine_config().model_config
    config = {k: v for k, v in mc.hf_config.to_dict().items() if k not in _SKIP_CONFIG_KEYS}
    tok = get_model_tokenizer(mc)
    ids = [tok.encode(t) for t in TEXTS]
    out = {
        "hf_config": json.loads(json.dumps(config, default=_plain, sort_keys=True)),
        "model_config": {k: _plain(v) for k, v in vars(mc).items() if k != "hf_config"},
        "tokenizer": [type(tok).__name__, len(tok), tok.eos_token_id, tok.bos_token_id],
        "ids": ids,
        "ids_no_special": [tok.encode(t, add_special_tokens=False) for t in TEXTS],
        "decoded": [tok.decode(i) for i in ids] + [tok.decode(i, skip_special_tokens=True) for i in ids],
        "tokens": [tok.convert_ids_to_tokens(i) for i in ids],
        "chat": tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
        "chat_tools": tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True),
        "chat_ids": tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=False)["input_ids"],
    }
    return json.loads(json.dumps(out, default=_plain))


_SERVER_SIDE = """
import json, sys
sys.path.insert(0, {tests!r})
from llmserve.torch_hiding import import_transformers_without_torch
without = import_transformers_without_torch()
from test_torch_hiding import snapshot
snap = snapshot({model!r})
torch_after_snapshot = "torch" in sys.modules
import torch  # hidden only while transformers was imported
print(json.dumps({{"without_torch": without, "torch_after_snapshot": torch_after_snapshot,
                  "torch_works": float(torch.ones(3).sum()), "snapshot": snap}}))
"""


def _server_side(model: str, env: dict | None = None) -> dict:
    code = _SERVER_SIDE.format(tests=TESTS_DIR, model=model)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _private_warm_home(home, monkeypatch) -> None:
    """A start-up cache under ``home`` holding the default model's config and tokenizer
    entry (copied from this user's, else converted here, with torch): the server side then
    reads them warm whatever another process does to the shared cache meanwhile."""
    import shutil

    from llmserve.model_loader import resolve_model, startup_cache
    from llmserve.model_loader.resolve import _load_hf_config_cached
    from llmserve.tokenizer import _load_tokenizer

    r = resolve_model(MODEL)
    gguf = os.path.join(r.path, r.gguf_file)
    shared = os.path.join(startup_cache.entry_dir(gguf), "hf")
    monkeypatch.setattr(startup_cache, "cache_root",
                        lambda: str(home / ".cache" / "llmserve" / "models"))
    private = os.path.join(startup_cache.entry_dir(gguf), "hf")
    try:
        shutil.copytree(shared, private)
    except OSError:  # no shared entry (a fresh machine): convert into the private cache
        _load_hf_config_cached.__wrapped__(r.path, r.gguf_file)
        _load_tokenizer.__wrapped__(r.path, r.gguf_file, None)


def test_server_process_transformers_without_torch_equals_with_torch(tmp_path, monkeypatch):
    """Warm start-up cache (the default model's GGUF config and tokenizer, as every start
    after the first): same answers as with torch, and torch never imported for them."""
    expected = snapshot(MODEL)
    _private_warm_home(tmp_path, monkeypatch)
    got = _server_side(MODEL, env={"HOME": str(tmp_path)})
    assert got["without_torch"] is True
    assert got["torch_after_snapshot"] is False
    assert got["torch_works"] == 3.0
    assert got["snapshot"] == expected


@pytest.mark.slow  # ~15 s: converts the GGUF metadata and vocabulary afresh; `make test-all`
def test_cold_gguf_read_without_torch(tmp_path):
    """A cold start-up cache (a new HOME): the server process converts the GGUF metadata
    in a child process (``startup_cache_fill``), so it never imports torch, and the
    config and tokenizer equal the ones read with torch."""
    got = _server_side(MODEL, env={"HOME": str(tmp_path)})
    assert got["without_torch"] is True
    # converted in a child (startup_cache_fill): transformers' GGUF reader imports torch
    assert got["torch_after_snapshot"] is False
    assert got["snapshot"] == snapshot(MODEL)
    assert os.path.isdir(tmp_path / ".cache" / "llmserve" / "models")  # it was cold: the entry is new


def test_torch_hidden_changes_nothing_once_torch_is_imported():
    import torch

    from llmserve.torch_hiding import gguf_metadata_reads, import_transformers_without_torch, torch_hidden

    with torch_hidden() as hidden:
        assert hidden is False
        assert sys.modules["torch"] is torch
    assert import_transformers_without_torch() is False  # this process's transformers has torch
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    check = gguf_utils.is_torch_available
    with gguf_metadata_reads():
        assert gguf_utils.is_torch_available is check


def test_torch_hidden_hides_and_restores():
    """In a fresh interpreter: ``import torch`` fails inside the block and is importable
    after it (the import itself is checked by the test above)."""
    code = ("import importlib.util, sys\n"
            "from llmserve.torch_hiding import torch_hidden\n"
            "with torch_hidden() as hidden:\n"
            "    assert hidden is True and importlib.util.find_spec('torch') is None\n"
            "    try:\n"
            "        import torch\n"
            "        raise SystemExit('torch imported while hidden')\n"
            "    except ImportError:\n"
            "        pass\n"
            "assert 'torch' not in sys.modules and importlib.util.find_spec('torch') is not None\n"
            "print('restored')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "restored"
