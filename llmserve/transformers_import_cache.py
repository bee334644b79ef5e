"""A disk cache of transformers' lazy-import tables, for llmserve's own processes' start-up.

``import transformers`` (5.x) builds the tables behind its lazy modules with
``transformers.utils.import_utils.define_import_structure``: it reads every source file
under ``transformers/models`` (3,385 in 5.25) to collect their ``__all__`` names. That was
~1.0 s of the ~1.2 s import on 2 cores, paid by both the API server and the engine at every
start (py-spy; the engine's ``import transformers`` is on the path to a warm start's
readiness). The table depends on nothing but those files, and transformers already keeps
it per process (the function is ``lru_cache``-d).

:func:`install` (call before transformers is imported) wraps that function as its module
is first executed, so the ``import transformers`` that follows reads the table from
``~/.cache/llmserve/transformers-imports/``, keyed by the transformers version, the
arguments, the Python version and every file's (path, size, mtime) under the scanned folder
(an edited or reinstalled transformers gets a new key; the walk costs ~40 ms). A missing or
unreadable entry is computed by transformers as before and written (atomically) for the
next start; a cache that cannot be written is ignored. The result is the same object
transformers would have built, so nothing transformers exposes changes.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.abc
import logging
import os
import pickle
import sys
import tempfile
from typing import Any, Optional

logger = logging.getLogger(__name__)

_TARGET = "transformers.utils.import_utils"
_FUNCTION = "define_import_structure"


def cache_dir() -> str:
    """``~/.cache/llmserve/transformers-imports`` (next to the start-up cache)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "llmserve", "transformers-imports")


@functools.lru_cache(maxsize=8)
def _fingerprint(module_path: str) -> str:
    """sha256 of every ``.py`` file's (relative path, size, mtime_ns) under ``module_path``
    (its folder's, for a file: transformers scans the parent folder then), the files
    transformers reads ``__all__`` from."""
    root = os.path.dirname(module_path) if os.path.isfile(module_path) else module_path
    h = hashlib.sha256()

    def walk(folder: str, rel: str) -> None:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                if e.name != "__pycache__":
                    walk(e.path, rel + e.name + "/")
            elif e.name.endswith(".py"):
                st = e.stat()
                h.update(f"{rel}{e.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())

    walk(root, "")
    return h.hexdigest()


def _key(version: str, module_path: Any, prefix: Optional[str]) -> str:
    parts = (version, sys.version, str(module_path), repr(prefix), _fingerprint(str(module_path)))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def cached(original: Any, version: str) -> Any:
    """``original`` (``define_import_structure(module_path, prefix=None)``) with its results
    kept on disk (module doc); per process, like the original, an lru_cache."""

    @functools.lru_cache
    def define_import_structure(module_path: Any, prefix: Optional[str] = None) -> Any:
        try:
            path = os.path.join(cache_dir(), _key(version, module_path, prefix) + ".pickle")
        except OSError:
            return original(module_path, prefix)
        try:
            with open(path, "rb") as f:
                return pickle.load(f)
        except FileNotFoundError:
            pass
        except Exception as e:  # a damaged entry: computed again and replaced below
            logger.debug("transformers import cache %s unreadable: %s", path, e)
        result = original(module_path, prefix)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except Exception as e:  # a read-only home: transformers' own path every start
            logger.debug("cannot write the transformers import cache %s: %s", path, e)
        return result

    define_import_structure.__wrapped_original__ = original
    return define_import_structure


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of ``transformers.utils.import_utils`` so its
    ``define_import_structure`` is replaced as soon as the module has run, before
    ``transformers/__init__.py`` and ``transformers/models/__init__.py`` call it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # once; the lookup below must not find this finder again
        from importlib.machinery import PathFinder
        spec = PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module: Any) -> None:
            exec_module(module)
            original = getattr(module, _FUNCTION, None)
            if original is not None:  # transformers/__init__.py set its __version__ first
                version = str(getattr(sys.modules.get("transformers"), "__version__", "?"))
                setattr(module, _FUNCTION, cached(original, version))

        spec.loader.exec_module = exec_and_wrap
        return spec


def install() -> bool:
    """Make the next ``import transformers`` in this process read its import tables from
    the cache (module doc). False (nothing done) when transformers' import utilities are
    imported already or ``LLMSERVE_TRANSFORMERS_IMPORT_CACHE=0``."""
    from llmserve import envs

    if _TARGET in sys.modules or envs.get("LLMSERVE_TRANSFORMERS_IMPORT_CACHE", "1") == "0":
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
