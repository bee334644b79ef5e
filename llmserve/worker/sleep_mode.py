"""Sleep mode on the worker (vLLM's ``Worker.sleep`` / ``wake_up``; there the CuMemAllocator
offloads or discards GPU memory, here the CPU process drops its tensors).

Asleep, the model runner holds no weights and no KV cache: both are freed and, through
``malloc_trim``, handed back to the OS (a tensor's memory would otherwise stay in glibc's
arenas and in the process's RSS). Waking loads the model again the way start-up does:
- level 1 keeps the model's files in the OS page cache, so the wake reads the start-up
  cache's converted weights (``model_loader/startup_cache.py``) from memory;
- level 2 drops everything, page cache included (``posix_fadvise(POSIX_FADV_DONTNEED)``
  on the model's files and its start-up cache entry), so the wake reads them from disk.
The KV cache comes back zeroed with the same number of blocks; the scheduler's prefix
cache is reset by the caller (``EngineCore.sleep``), since the blocks' contents are gone.
"""
from __future__ import annotations

import ctypes
import gc
import logging
import os
import time
from typing import Any, Iterable, Optional

logger = logging.getLogger(__name__)

# vLLM's sleep/wake_up tags: what a partial wake brings back.
SLEEP_TAGS = ("weights", "kv_cache")


def check_level(level: Any) -> int:
    """The sleep level as an int; ValueError naming ``level`` unless it is 1 or 2."""
    if isinstance(level, bool) or level not in (1, 2):
        raise ValueError(f"level must be 1 or 2, got {level!r}")
    return int(level)


def check_tags(tags: Optional[Iterable[str]]) -> tuple[str, ...]:
    """The wake_up tags (None: all of them); ValueError naming ``tags`` for unknown ones."""
    if tags is None:
        return SLEEP_TAGS
    tags = tuple(tags)
    bad = [t for t in tags if t not in SLEEP_TAGS]
    if bad or not tags:
        raise ValueError(f"tags must be a non-empty subset of {list(SLEEP_TAGS)}, got {list(tags)}")
    return tags


def reraise_value_error(e: RuntimeError) -> None:
    """A utility call refused in the engine process comes back as RuntimeError("ValueError:
    ..."): raise it as the ValueError it was (the server maps that to HTTP 400)."""
    msg = str(e)
    if msg.startswith("ValueError: "):
        raise ValueError(msg[len("ValueError: "):]) from None


def release_freed_memory() -> None:
    """Collect garbage and return glibc's free heap pages to the OS (``malloc_trim(0)``;
    a no-op where libc has none)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _model_files(model_config: Any) -> list[str]:
    """The model's weight files and its start-up cache entry's files (GGUF models)."""
    paths = []
    path = model_config.model_path
    if os.path.isdir(path):
        paths += [os.path.join(path, f) for f in os.listdir(path)]
    gguf = model_config.gguf_file or (path if path.endswith(".gguf") else None)
    if gguf and not os.path.isabs(gguf):  # a file name inside the model directory
        gguf = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), gguf)
    if gguf and os.path.isfile(gguf):
        paths.append(gguf)
        from llmserve.model_loader.startup_cache import entry_dir

        entry = entry_dir(gguf)
        if os.path.isdir(entry):
            paths += [os.path.join(entry, f) for f in os.listdir(entry)]
    return [p for p in paths if os.path.isfile(p)]


def evict_page_cache(model_config: Any) -> int:
    """Ask the OS to drop the model files' cached pages (level 2). Returns the number of
    files advised; files that cannot be opened are skipped."""
    n = 0
    try:
        paths = _model_files(model_config)
    except OSError as e:  # best effort: the wake then reads from the page cache
        logger.warning("sleep level 2: could not list the model files: %s", e)
        return 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


class RunnerSleep:
    """What one model runner has put to sleep (``asleep``: a subset of SLEEP_TAGS) and the
    KV block count to rebuild. ``sleep``/``wake_up`` raise ValueError for a bad level/tag."""

    def __init__(self) -> None:
        self.asleep: set[str] = set()
        self.num_blocks = 0

    def sleep(self, runner: Any, level: int) -> None:
        check_level(level)
        if "kv_cache" not in self.asleep and runner.kv_caches:
            self.num_blocks = runner.kv_caches[0].shape[1]
            runner.shutdown()  # the KV connector registered these tensors
            runner.kv_caches = []
            runner._kv_prefault_next = None  # nothing to prefault while asleep
        self.asleep.add("kv_cache")
        if "weights" not in self.asleep:
            runner.model = None
            runner.lora_manager = None
        self.asleep.add("weights")
        release_freed_memory()
        if level == 2:
            evict_page_cache(runner.model_config)

    def wake_up(self, runner: Any, tags: Optional[Iterable[str]] = None) -> None:
        t0 = time.perf_counter()
        for tag in check_tags(tags):
            if tag not in self.asleep:
                continue
            if tag == "weights":
                runner.load_model()
            elif self.num_blocks:
                runner.initialize_kv_cache(self.num_blocks)
            self.asleep.discard(tag)
        release_freed_memory()  # the loader's temporaries (measured: ~200 MiB of RSS otherwise)
        logger.info("Woke up (%s) in %.2f s", ", ".join(check_tags(tags)), time.perf_counter() - t0)
