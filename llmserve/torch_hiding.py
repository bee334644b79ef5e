"""transformers without torch in llmserve's own processes: the API servers and the engine
(issue 31).

The ``llmserve serve`` API server never runs a model, and the engine runs llmserve's own
models (it needs transformers only for configs), but ``import transformers`` imports
torch whenever torch is installed (``modeling_rope_utils``, the config validators), which
cost its start ~3 s (2 cores, contended with the engine's own imports) and ~150 MiB of
resident memory. transformers 5 works without torch for what the server uses
(tokenizers, chat templates, configs, generation configs): ``is_torch_available()`` then
answers False and nothing imports torch.

- :func:`torch_hidden`: a context manager during which ``import torch`` fails and
  ``importlib.util.find_spec("torch")`` is None, by Python's documented way to block an
  import (``sys.modules["torch"] = None``); on exit torch is importable again.
- :func:`import_transformers_without_torch`: imports transformers under it, in a process
  that has not imported torch. transformers caches ``is_torch_available()`` (an
  ``lru_cache``), so for the rest of the process it keeps answering False and its later
  imports (``AutoConfig`` of a model, the GGUF tokenizer) do not import torch either,
  while llmserve code that needs tensors (pooling outputs, audio features, LoRA checks)
  can still ``import torch`` lazily and pays for it on first use only. For processes
  llmserve starts that run no transformers model (the API servers; the engine, whose
  models are llmserve's own): never in a user's process (the offline ``LLM`` in a
  script, a notebook), whose transformers must see torch.
- :func:`gguf_metadata_reads`: transformers refuses to read a GGUF file's metadata (its
  config and tokenizer) unless torch is available, although that read uses no tensors;
  this lets the read run in such a process (a cold start-up cache only).
"""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator

from llmserve.shared_patch import SharedPatch

_TORCH = "torch"
# transformers' one-line notice when it finds no torch (logged by its ``transformers``
# logger as it is imported): true, but meant for users, not the server's log.
_NO_TORCH_NOTICE = "PyTorch was not found"


class _DropNoTorchNotice(logging.Filter):
    """Drops transformers' "PyTorch was not found" notice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NO_TORCH_NOTICE)


@contextlib.contextmanager
def torch_hidden() -> Iterator[bool]:
    """Hide torch from imports for the duration of the block.

    Yields True when torch is hidden; False (and changes nothing) when torch is already
    imported (hiding it then would make two views of one process). On exit torch is
    importable again (``sys.modules["torch"]`` removed), whatever the block raised.
    """
    if _TORCH in sys.modules:  # imported already (or hidden by an outer block)
        yield False
        return
    sys.modules[_TORCH] = None  # type: ignore[assignment]  # "import torch" -> ImportError
    notice = _DropNoTorchNotice()
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addFilter(notice)
    try:
        yield True
    finally:
        transformers_logger.removeFilter(notice)
        if sys.modules.get(_TORCH, _TORCH) is None:  # still our marker
            del sys.modules[_TORCH]


def import_transformers_without_torch() -> bool:
    """Import transformers (and its tokenizer and config entry points) with torch hidden,
    so that transformers takes torch as absent for the rest of this process.

    For llmserve's own processes only (see the module docstring). Returns True when
    transformers runs without torch (also when an earlier call made it so); False when
    torch, or transformers with torch, was imported already: then nothing changes.
    """
    if "transformers" in sys.modules:
        return not _transformers_sees_torch()
    from llmserve.transformers_import_cache import install

    install()  # its lazy-import tables from disk: ~0.7 s less of the ~1.2 s import
    with torch_hidden() as hidden:
        if not hidden:
            return False
        import transformers  # noqa: F401  (caches is_torch_available() == False)
        from transformers import AutoConfig, AutoTokenizer  # noqa: F401  (their import chains)
    return not _transformers_sees_torch()


def transformers_without_torch() -> bool:
    """True in a process whose transformers was imported with torch hidden (the API
    server after :func:`import_transformers_without_torch`); False where transformers is
    not imported yet or sees torch."""
    return "transformers" in sys.modules and not _transformers_sees_torch()


def _transformers_sees_torch() -> bool:
    from transformers.utils import is_torch_available

    return bool(is_torch_available())


_GGUF_TORCH_CHECK = SharedPatch()


@contextlib.contextmanager
def gguf_metadata_reads() -> Iterator[None]:
    """Let transformers read a GGUF file's config and tokenizer in a process where it runs
    without torch (see :func:`import_transformers_without_torch`); a no-op elsewhere.

    ``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`` raises ImportError
    ("Please install torch and gguf>=0.10.0") when ``is_torch_available()`` is False,
    also for ``return_tensors=False``, the metadata-only read that ``AutoConfig`` and
    ``AutoTokenizer`` make and that uses no torch (transformers 5.25: the guard is the
    only use of torch on that path; its GGUF reader imports torch itself). During the
    block that module's check answers True. Thread-safe and re-entrant (a depth count:
    the config and the tokenizer may load in two threads at once). Reading tensors
    (``return_tensors=True``) in such a process is not supported.
    """
    if "transformers" not in sys.modules or _transformers_sees_torch():
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    with _GGUF_TORCH_CHECK.applied(gguf_utils, "is_torch_available", lambda: True):
        yield
