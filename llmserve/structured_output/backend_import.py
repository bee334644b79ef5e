"""The API server's first structured-output request imports xgrammar off the event loop.

The API server runs without torch (``llmserve/torch_hiding.py``), but xgrammar imports
torch when it is imported, and the server builds each request's grammar to check it
(``grammar.validate_structured_outputs``, a 400 before the engine sees it). Imported
inline by the first such request, that import (~1.5-3 s on 2 cores) held the event loop:
in a fresh-user trial every other stream stopped for 1.6-1.7 s and ``/health`` took up to
1.2 s. :func:`prepare_grammar_backend` imports it in a worker thread instead, awaited by
the requests that need it only; the loop keeps serving the others (the import still holds
the GIL in its C parts: measured longest loop stall ~0.2 s instead of the whole import).
Importing it at start would cost every server ~200 MiB at rest that few of them use.
"""
from __future__ import annotations

import asyncio
import importlib
import logging
import sys
from typing import Optional

logger = logging.getLogger(__name__)

GRAMMAR_BACKEND = "xgrammar"
# Bytes of a request body that may ask for a grammar: OpenAI's response_format and
# tool_choice, vLLM's structured_outputs and guided_* fields, Ollama's format, the
# Responses API's text.format, Anthropic's tool_choice and output_format. A body that
# names none of them never builds a grammar; one that does but needs none only waits.
GRAMMAR_MARKERS = (b'format"', b'"structured_outputs"', b'"tool_choice"', b'"guided_')

_importing: Optional["asyncio.Future[None]"] = None


def may_need_grammar(body: bytes) -> bool:
    """Whether a JSON request body names a field that can ask for a grammar."""
    return any(marker in body for marker in GRAMMAR_MARKERS)


async def prepare_grammar_backend(body: bytes, module: str = GRAMMAR_BACKEND) -> None:
    """Import ``module`` (xgrammar) in a worker thread when ``body`` may need a grammar and
    it is not imported yet; concurrent callers wait for the one import. Never raises: a
    failed import is logged and left to the request's own (inline) import to report."""
    global _importing
    if module in sys.modules or not may_need_grammar(body):
        return
    if _importing is None or _importing.done():
        _importing = asyncio.ensure_future(_import_in_thread(module))
    await asyncio.shield(_importing)


async def _import_in_thread(module: str) -> None:
    try:
        await asyncio.get_running_loop().run_in_executor(None, importlib.import_module, module)
    except Exception as e:  # noqa: BLE001 - the request's inline import reports it
        logger.warning("importing %s for structured outputs failed: %s", module, e)
