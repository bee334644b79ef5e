"""Fill a GGUF file's start-up cache entry (config and tokenizer, ``startup_cache``'s
``hf/``) in a process of its own: ``python -m llmserve.model_loader.startup_cache_fill FILE``.

The API server runs transformers without torch (issue 31, ``torch_hiding``), but
transformers' GGUF reader (``transformers.integrations.gguf.reader``, 5.x) imports torch at
module level, so a cold start converting the file's metadata in the server process loaded
torch there for the rest of its life (~150 MiB resident, seen on a first start of a
llama-quantize Q4_K_M file). ``startup_cache.load_hf_object`` runs this module instead when
its process hides torch; later starts read the entry as before. Exit status 0 when both
objects are cached; errors go to stderr (the caller then converts in process)."""
from __future__ import annotations

import os
import sys


def fill(gguf_path: str) -> None:
    """Convert and cache ``gguf_path``'s config and tokenizer (as the engine's first start
    would). Raises what the conversion raises (ValueError for an unsupported file)."""
    from llmserve.model_loader.resolve import _load_hf_config_cached
    from llmserve.tokenizer import _load_tokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    _load_hf_config_cached(folder, name)
    _load_tokenizer(folder, name, None)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m llmserve.model_loader.startup_cache_fill FILE.gguf", file=sys.stderr)
        return 2
    fill(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
