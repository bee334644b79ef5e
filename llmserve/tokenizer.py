"""Tokenizer loading (HF directory or GGUF metadata) and chat-template selection.

As vLLM's ``get_tokenizer``: ``AutoTokenizer.from_pretrained`` with local files only; for a
GGUF checkpoint transformers rebuilds the tokenizer (and its chat template) from the GGUF
metadata, which takes a few seconds, so loaded tokenizers are cached per
(path, gguf_file, chat_template) in a bounded ``functools.lru_cache``.
"""
from __future__ import annotations

import copy
import functools
import os
from typing import TYPE_CHECKING, Any, Iterable, Optional

from transformers import AutoTokenizer, PreTrainedTokenizerBase

if TYPE_CHECKING:  # annotation only
    from llmserve.config import ModelConfig

_TEMPLATE_CHARS = "{}\n"


def lone_surrogate_problem(text: str) -> Optional[str]:
    """What is wrong with ``text`` when it cannot be UTF-8 encoded, i.e. it holds a lone
    UTF-16 surrogate such as ``"\\ud800"`` (valid JSON, but no tokenizer can encode it):
    the code point and its position in ``text`` (0-based, in code points); None when it
    is valid Unicode."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"the text contains a lone surrogate code point U+{ord(text[e.start]):04X} at "
                f"position {e.start}, which is not valid Unicode; send UTF-8 text.")
    return None


def check_encodable(text: str, param: str) -> None:
    """Raise ``SamplingParamsError`` (a ValueError naming ``param``) when ``text`` holds a
    lone surrogate (:func:`lone_surrogate_problem`). The servers turn it into a 400."""
    problem = lone_surrogate_problem(text)
    if problem is not None:
        from llmserve.sampling_params import SamplingParamsError

        raise SamplingParamsError(f"{param}: {problem}", param)


def check_texts(fields: Iterable[tuple[str, Any]]) -> None:
    """Every string under ``fields`` ((name, value) pairs: a request's fields that reach
    the prompt), object keys too, is valid Unicode: :func:`check_encodable` naming the
    client's path of the first one holding a lone surrogate (``messages.0.content``,
    ``input.1.content.0.text``, ``prompt.1``) and the position within that string (not
    within the rendered prompt, which the client never wrote). Walks strings, lists,
    dicts and pydantic models (their declared fields, then their extra ones) with a stack,
    not recursion: a deeply nested tool schema cannot exhaust Python's stack here."""
    stack: list[tuple[str, Any]] = list(reversed(list(fields)))
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            check_encodable(value, path)
            continue
        if isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, (list, tuple)):
            items = list(enumerate(value))
        elif hasattr(type(value), "model_fields"):  # a pydantic model
            items = [(k, getattr(value, k)) for k in type(value).model_fields]
            items += list((getattr(value, "model_extra", None) or {}).items())
        else:
            continue
        for key, item in reversed(items):  # reversed: the first string in the body is named first
            at = f"{path}.{key}"
            if isinstance(key, str):
                check_encodable(key, at)
            stack.append((at, item))


def resolve_chat_template(chat_template: Optional[str]) -> Optional[str]:
    """Turn the user's ``--chat-template`` value into template text.

    A path to an existing file is read (UTF-8); a string holding any of ``{``, ``}`` or a
    newline is taken as a literal Jinja template (vLLM's rule); None stays None.
    Raises ValueError (field ``chat_template``) for a value that is neither.
    """
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    if any(c in chat_template for c in _TEMPLATE_CHARS):
        return chat_template
    raise ValueError(f"chat_template {chat_template!r} is neither an existing file nor a "
                     "Jinja template string")


def _has_tokenizer_files(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, f))
        for f in ("tokenizer_config.json", "tokenizer.json", "config.json"))


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str, gguf_file: Optional[str],
                    template: Optional[str]) -> PreTrainedTokenizerBase:
    if template is not None:  # copy the cached base tokenizer rather than re-read the GGUF
        tok = copy.deepcopy(_load_tokenizer(path, gguf_file, None))
        tok.chat_template = template
        return tok
    kwargs = {"local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        if gguf_file:  # converting the GGUF vocabulary takes seconds: cached on disk (issue 16)
            from llmserve.model_loader.startup_cache import load_hf_object
            tok = load_hf_object(os.path.join(path, gguf_file), "tokenizer_config.json",
                                 lambda d: AutoTokenizer.from_pretrained(d, local_files_only=True),
                                 lambda: _tokenizer_from_gguf(path, kwargs))
        else:
            tok = AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        where = os.path.join(path, gguf_file) if gguf_file else path
        raise ValueError(f"cannot load a tokenizer from {where!r}: {_no_tokenizer_hint(path, gguf_file) or e}") from e
    if gguf_file:  # after the start-up cache too: entries written before this fix lack it
        _split_digits_first(tok, os.path.join(path, gguf_file))
    return tok


# Files any transformers tokenizer is built from (fast, sentencepiece, BPE, WordPiece vocabularies).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                    "vocab.txt", "merges.txt", "tiktoken.model")


def _no_tokenizer_hint(path: str, gguf_file: Optional[str]) -> str:
    """What to do when the model has no tokenizer at all: a folder without any of
    _TOKENIZER_FILES, or a GGUF file without ``tokenizer.ggml.model`` (a writer that stored
    only the weights); "" when it has one (the loader's own error then says what is wrong).
    transformers' words for these were "...You need to have sentencepiece or tiktoken
    installed..." and "stating tokenizer None", which do not say the files are missing."""
    if gguf_file:
        from llmserve.model_loader.gguf_loader import read_gguf_tensors
        meta: dict = {"tokenizer.ggml.model": None}
        try:
            read_gguf_tensors(os.path.join(path, gguf_file), meta)
        except ValueError:
            return ""
        if meta["tokenizer.ggml.model"] is not None:
            return ""
        what = "the file has no tokenizer.ggml.* vocabulary"
    else:
        if not os.path.isdir(path) or any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
            return ""
        what = f"the folder has none of {list(_TOKENIZER_FILES)}"
    return f"{what}; give the model's tokenizer with --tokenizer NAME_OR_PATH"


def _tokenizer_from_gguf(path: str, kwargs: dict) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(path, **kwargs)`` (kwargs naming ``gguf_file``): the
    vocabulary converted from the GGUF metadata, also where transformers runs without
    torch (the API server, issue 31: ``gguf_metadata_reads``), the file's metadata read by
    ``FastGGUFReader`` (gguf.GGUFReader took ~3 s of it)."""
    from llmserve.model_loader.gguf_fast_reader import fast_gguf_reads
    from llmserve.torch_hiding import gguf_metadata_reads

    with gguf_metadata_reads(), fast_gguf_reads():
        return AutoTokenizer.from_pretrained(path, **kwargs)


# llama.cpp's ``tokenizer.ggml.pre`` names whose pre-tokenizer is "each digit alone, then
# GPT-2's regex" (llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_STARCODER, REFACT, COMMAND_R, SMOLLM,
# CODESHELL, EXAONE, MINERVA, MELLUM2 share the regexes {"\p{N}", GPT-2's}); the models'
# own tokenizer.json say the same as Sequence[Digits(individual_digits), ByteLevel].
# transformers' GGUF converter (5.25, GGUF_PRE_TOKENIZER_SPLITS) maps none of these and
# leaves a plain ByteLevel, which cuts a whitespace run before a digit differently:
# "\n\n  0." became ĊĊĠ Ġ 0 where llama.cpp (and the model's tokenizer) give ĊĊĠĠ 0. On the
# GPL-3 text, SmolLM2 GGUF tokens left llama-perplexity's at token 795, and perplexity
# (same weights, float32) read 18.13 against llama.cpp's 18.30.
_DIGITS_FIRST_PRE = frozenset({"starcoder", "refact", "command-r", "smollm", "codeshell",
                               "exaone", "minerva-7b", "mellum2"})


def _split_digits_first(tok: PreTrainedTokenizerBase, gguf_path: str) -> None:
    """Give ``tok`` (converted from the GGUF file ``gguf_path``) the digits-first
    pre-tokenizer when the file's ``tokenizer.ggml.pre`` is one of ``_DIGITS_FIRST_PRE`` and
    the converter left a plain ByteLevel one; otherwise leave it as it is. In place."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or type(backend.pre_tokenizer).__name__ != "ByteLevel":
        return
    from llmserve.model_loader.gguf_loader import read_gguf_tensors
    meta: dict = {"tokenizer.ggml.pre": None}
    try:
        read_gguf_tensors(gguf_path, meta)
    except (OSError, ValueError):  # not a file this reader parses: keep the converter's
        return
    if meta["tokenizer.ggml.pre"] in _DIGITS_FIRST_PRE:
        from tokenizers import pre_tokenizers
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])


def get_tokenizer(path: str, gguf_file: Optional[str] = None,
                  chat_template: Optional[str] = None) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model, offline.

    path: a HF directory, a directory holding the GGUF ``gguf_file``, a .gguf file path, or
    any model name ``llmserve.model_loader.resolve_model`` accepts (packaged models, HF
    cache ids). chat_template: a file path or literal template that overrides the template
    from tokenizer_config / GGUF metadata (``tokenizer.chat_template``).

    Returns a ``PreTrainedTokenizerBase`` shared between callers with the same arguments
    (do not mutate it). Raises ValueError when the model or its tokenizer is not found.
    """
    if gguf_file is None:
        if path.lower().endswith(".gguf") and os.path.isfile(path):
            path, gguf_file = os.path.split(os.path.abspath(path))
        elif not _has_tokenizer_files(path):
            from llmserve.model_loader.resolve import resolve_model
            resolved = resolve_model(path)
            path, gguf_file = resolved.path, resolved.gguf_file
    template = resolve_chat_template(chat_template)
    return _load_tokenizer(os.path.abspath(path), gguf_file, template)


def get_model_tokenizer(model_config: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of the model a ``ModelConfig`` describes: the model's own (its HF
    directory or GGUF file) or, with ``--tokenizer``, another model or directory; the
    chat template override of ``--chat-template`` applied (vLLM's tokenizer init from the
    model config). Shared by the server front-end and the engine's structured outputs.
    Raises ValueError as :func:`get_tokenizer`."""
    mc = model_config
    if mc.tokenizer in (None, mc.model_path):
        return get_tokenizer(mc.model_path, mc.gguf_file, mc.chat_template)
    return get_tokenizer(mc.tokenizer, None, mc.chat_template)
