"""Fill-in-the-middle: the model's FIM tokens and llama.cpp's infill prompt layout.

:func:`find_fim_tokens` looks for the tokens a code model was trained with, as llama.cpp's
vocabulary loader does (``llama-vocab.cpp``): first the GGUF metadata
(``tokenizer.ggml.fim_pre_token_id`` ... ``fim_sep_token_id``, and the older
``prefix_token_id`` / ``suffix_token_id`` / ``middle_token_id``), then the vocabulary by
name (Qwen2.5-Coder ``<|fim_prefix|>``, StarCoder/Granite ``<fim_prefix>``, CodeLlama
``<PRE>`` / ``▁<PRE>``, GLM ``<|code_prefix|>``, ...). A model without prefix, suffix and
middle tokens (SmolLM2) has none: FIM requests to it are a 400.

:func:`format_infill` builds llama-server's ``format_prompt_infill`` layout (the
repo-level pattern of Qwen2.5-Coder, arXiv 2409.12186)::

    [FIM_REP]myproject\\n [FIM_SEP]filename0\\n extra0 ... [FIM_SEP]filename\\n
    [BOS] [FIM_PRE]prefix [FIM_SUF]suffix [FIM_MID]prompt

with llama-server's budgets: the last ``3 * n_batch / 4`` prefix tokens, the first
``n_batch / 4 - (2 + len(prompt))`` suffix tokens, and the last ``n_ctx - n_batch - 2 *
n_predict`` tokens of the extra chunks (``n_batch`` 2048 and ``n_predict`` -1 are
llama-server's defaults, ``n_ctx`` the context length). Prefix, suffix and extra text are
tokenized without special tokens and without parsing special-token text (llama.cpp's
``parse_special = false``: a ``<|fim_middle|>`` typed in the code stays text); the
``prompt`` is tokenized with special-token text parsed, as llama-server does.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from llmserve.sampling_params import SamplingParamsError

logger = logging.getLogger(__name__)

# llama-server's defaults (``--batch-size``, ``--n-predict``); the layout's budgets use them
LLAMA_CPP_N_BATCH = 2048
LLAMA_CPP_N_PREDICT = -1
FIM_REPO_NAME = "myproject"  # llama-server's fixed project and file names
FIM_FILE_NAME = "filename"
FIM_EXTRA_FILE_NAME = "tmp"
# llama-server's separator of extra chunks when the model has no FIM_SEP token
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"

# token role -> names tried in order (llama-vocab.cpp's lists, plus CodeLlama's HF names)
_TOKEN_NAMES: dict[str, tuple[str, ...]] = {
    "prefix": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
               "<|prefix|>"),
    "suffix": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
               "<|suffix|>"),
    "middle": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>", "<|code_middle|>",
               "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "repo": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
# token role -> GGUF metadata keys (llama.cpp's current key first, then the older one)
_GGUF_KEYS: dict[str, tuple[str, ...]] = {
    "prefix": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    "suffix": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    "middle": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
    "pad": ("tokenizer.ggml.fim_pad_token_id",),
    "repo": ("tokenizer.ggml.fim_rep_token_id",),
    "sep": ("tokenizer.ggml.fim_sep_token_id",),
}

Piece = Union[str, int]
MixedInput = Union[str, Sequence[Piece]]


@dataclass(frozen=True)
class FimTokens:
    """Token ids of a model's FIM tokens: ``prefix``, ``suffix``, ``middle`` (always set),
    ``pad``, ``repo``, ``sep`` (None when the model has none); ``add_bos``: the tokenizer
    puts its BOS token first (llama.cpp's ``llama_vocab_get_add_bos``)."""

    prefix: int
    suffix: int
    middle: int
    pad: Optional[int] = None
    repo: Optional[int] = None
    sep: Optional[int] = None
    bos: Optional[int] = None
    add_bos: bool = False

    @property
    def stop_token_ids(self) -> list[int]:
        """The FIM tokens that end a completion (llama.cpp counts pad, repo and sep as
        end-of-generation tokens)."""
        return [t for t in (self.pad, self.repo, self.sep) if t is not None]


def _gguf_ids(gguf_path: Optional[str]) -> dict[str, int]:
    """FIM ids from the GGUF metadata (role -> id); {} without a GGUF file."""
    if not gguf_path or not os.path.isfile(gguf_path):
        return {}
    try:
        from gguf import GGUFReader

        fields = GGUFReader(gguf_path).fields
    except Exception as e:  # an unreadable file: the vocabulary names still apply
        logger.warning("FIM tokens: cannot read the GGUF metadata of %s: %s", gguf_path, e)
        return {}
    found: dict[str, int] = {}
    for role, keys in _GGUF_KEYS.items():
        for key in keys:
            field = fields.get(key)
            if field is not None and field.data:
                found[role] = int(field.parts[field.data[0]][0])
                break
    return found


def _vocab_ids(tokenizer: Any) -> dict[str, int]:
    """FIM ids found by name in the tokenizer's vocabulary (role -> id)."""
    vocab = tokenizer.get_vocab()
    found: dict[str, int] = {}
    for role, names in _TOKEN_NAMES.items():
        for name in names:
            if name in vocab:
                found[role] = vocab[name]
                break
    return found


def _adds_bos(tokenizer: Any) -> tuple[Optional[int], bool]:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None, False
    ids = tokenizer.encode("a", add_special_tokens=True)
    return bos, bool(ids) and ids[0] == bos and tokenizer.encode("a", add_special_tokens=False)[:1] != [bos]


def find_fim_tokens(tokenizer: Any, gguf_path: Optional[str] = None) -> Optional[FimTokens]:
    """The model's FIM tokens (GGUF metadata first, then the vocabulary by name), or
    None when it lacks a prefix, suffix or middle token. Cached per (tokenizer, path,
    vocabulary size), so a tokenizer given new tokens is looked at again."""
    return _find_fim_tokens(tokenizer, gguf_path, len(tokenizer))


@functools.lru_cache(maxsize=8)
def _find_fim_tokens(tokenizer: Any, gguf_path: Optional[str], vocab_size: int) -> Optional[FimTokens]:
    found = {**_vocab_ids(tokenizer), **_gguf_ids(gguf_path)}
    if not all(role in found for role in ("prefix", "suffix", "middle")):
        return None
    bos, add_bos = _adds_bos(tokenizer)
    return FimTokens(found["prefix"], found["suffix"], found["middle"], found.get("pad"), found.get("repo"),
                     found.get("sep"), bos, add_bos)


def require_fim_tokens(tokenizer: Any, gguf_path: Optional[str], param: str) -> FimTokens:
    """:func:`find_fim_tokens`, or SamplingParamsError (400 naming ``param``) when the
    model has no FIM tokens."""
    tokens = find_fim_tokens(tokenizer, gguf_path)
    if tokens is None:
        raise SamplingParamsError(
            f"`{param}` needs fill-in-the-middle, and this model's tokenizer has no FIM tokens (prefix, suffix and "
            "middle tokens such as <|fim_prefix|>, <fim_prefix> or <PRE>). Serve a code model trained for FIM, "
            f"or leave out `{param}`.", param)
    return tokens


def gguf_path_of(model_config: Any) -> Optional[str]:
    """The GGUF file a ModelConfig loads (None for a HF directory)."""
    path = getattr(model_config, "model_path", None)
    gguf_file = getattr(model_config, "gguf_file", None)
    if path and path.lower().endswith(".gguf"):
        return path
    if path and gguf_file:
        return os.path.join(path, gguf_file)
    return None


def text_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """llama.cpp's ``common_tokenize(text, add_special=false, parse_special=false)``:
    no BOS/EOS, and special-token text stays text."""
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def tokenize_mixed(encode: Callable[[str], list[int]], value: MixedInput, param: str) -> list[int]:
    """A string, or a list of strings and token ids (llama.cpp's ``tokenize_mixed``).
    Raises SamplingParamsError naming ``param`` for anything else."""
    if isinstance(value, str):
        return encode(value)
    ids: list[int] = []
    for piece in value:
        if isinstance(piece, bool) or not isinstance(piece, (str, int)):
            raise SamplingParamsError(f"`{param}` must be a string or a list of strings and token ids.", param)
        ids.extend(encode(piece) if isinstance(piece, str) else [piece])
    return ids


def _extra_tokens(tokens: FimTokens, encode: Callable[[str], list[int]],
                  extra: Sequence[tuple[str, str]]) -> list[int]:
    """The repo-level context: repo name, then each (filename, text) chunk, then the
    current file's name."""
    out: list[int] = []
    if tokens.repo is not None:
        out += [tokens.repo] + encode(FIM_REPO_NAME + "\n")
    for filename, text in extra:
        if tokens.sep is not None:
            out += [tokens.sep] + encode(filename + "\n")
        else:
            out += encode(CHUNK_SEPARATOR)
        out += encode(text)
    if tokens.sep is not None:
        out += [tokens.sep] + encode(FIM_FILE_NAME + "\n")
    return out


def _kept(prefix_len: int, suffix_len: int, extra_len: int, prompt_len: int, n_ctx: int, n_batch: int,
          n_predict: int) -> tuple[int, int, int]:
    """How many prefix, suffix and extra tokens llama-server's budgets keep."""
    n_prefix = min(prefix_len, 3 * (n_batch // 4))
    n_suffix = min(suffix_len, max(0, n_batch // 4 - (2 + prompt_len)))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), extra_len)
    return n_prefix, n_suffix, n_extra


def format_infill(tokens: FimTokens, prefix_ids: list[int], suffix_ids: list[int], extra_ids: list[int],
                  prompt_ids: list[int], n_ctx: int, n_batch: int = LLAMA_CPP_N_BATCH,
                  n_predict: int = LLAMA_CPP_N_PREDICT, spm: bool = False) -> list[int]:
    """The prompt token ids of one infill request (llama-server's ``format_prompt_infill``;
    see the module docstring). ``spm``: suffix first (llama-server's ``--spm-infill``)."""
    n_prefix, n_suffix, n_extra = _kept(len(prefix_ids), len(suffix_ids), len(extra_ids), len(prompt_ids),
                                        n_ctx, n_batch, n_predict)
    pre = [tokens.prefix] + prefix_ids[len(prefix_ids) - n_prefix:] + prompt_ids
    suf = [tokens.suffix] + suffix_ids[:n_suffix]
    first, second = (suf, pre) if spm else (pre, suf)
    if tokens.add_bos and tokens.bos is not None:
        first = [tokens.bos] + first
    extra = extra_ids[len(extra_ids) - n_extra:] if n_extra else []
    return extra + first + second + [tokens.middle]


@dataclass
class InfillLayout:
    """One infill prompt: its token ids, and how many tokens of each request field it
    keeps (field name -> count, after llama-server's budgets)."""

    token_ids: list[int]
    kept: dict[str, int]

    def largest_field(self) -> str:
        """The field holding the most tokens of the prompt: the one a prompt too long for
        the context is blamed on (the 400's ``param``)."""
        return max(self.kept, key=lambda name: self.kept[name])


def infill_layout(tokenizer: Any, tokens: FimTokens, prefix: MixedInput, suffix: MixedInput,
                  extra: Sequence[tuple[str, str]], prompt: str, n_ctx: int,
                  params: tuple[str, str] = ("input_prefix", "input_suffix")) -> InfillLayout:
    """Tokenize and lay out one infill request (:func:`format_infill` with llama-server's
    default budgets). ``params``: the field names of prefix and suffix, named by errors
    and in :attr:`InfillLayout.kept` (with ``input_extra`` and ``prompt``). Raises
    SamplingParamsError naming ``params[0]`` / ``params[1]`` for a malformed piece."""
    encode = text_encoder(tokenizer)
    prefix_ids = tokenize_mixed(encode, prefix, params[0])
    suffix_ids = tokenize_mixed(encode, suffix, params[1])
    prompt_ids = list(tokenizer.encode(prompt, add_special_tokens=False)) if prompt else []
    extra_ids = _extra_tokens(tokens, encode, extra)
    ids = format_infill(tokens, prefix_ids, suffix_ids, extra_ids, prompt_ids, n_ctx)
    n_prefix, n_suffix, n_extra = _kept(len(prefix_ids), len(suffix_ids), len(extra_ids), len(prompt_ids), n_ctx,
                                        LLAMA_CPP_N_BATCH, LLAMA_CPP_N_PREDICT)
    kept = {params[0]: n_prefix, params[1]: n_suffix, "input_extra": n_extra, "prompt": len(prompt_ids)}
    return InfillLayout(ids, kept)


def infill_prompt(tokenizer: Any, tokens: FimTokens, prefix: MixedInput, suffix: MixedInput,
                  extra: Sequence[tuple[str, str]], prompt: str, n_ctx: int,
                  params: tuple[str, str] = ("input_prefix", "input_suffix")) -> list[int]:
    """The token ids of :func:`infill_layout`."""
    return infill_layout(tokenizer, tokens, prefix, suffix, extra, prompt, n_ctx, params).token_ids
