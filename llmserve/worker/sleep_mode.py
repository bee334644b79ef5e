"""Sleep mode on the worker (vLLM's ``Worker.sleep`` / ``wake_up``; there the CuMemAllocator
offloads or discards GPU memory, here the CPU process drops its tensors).

Asleep, the model runner holds no weights and no KV cache in memory:
- level 1 parks the weights (``worker/sleep_park.py``): the model object stays, its
  tensors' pages are written to an unlinked file on disk and freed, and the wake reads
  them back from the page cache into the same addresses (no rebuild: the wake's first
  token must come within 0.5 s). Where parking is not possible (no disk directory, a
  write error) the model is freed and rebuilt as at level 2;
- level 2 frees the model and drops the model files from the page cache too
  (``posix_fadvise(POSIX_FADV_DONTNEED)`` on them and on the start-up cache entry); the
  wake loads the model again the way start-up does, from disk. In the server the engine
  process then ends as well (``engine/sleep_process.py``).
Freed memory is handed back to the OS with ``malloc_trim`` (it would otherwise stay in
glibc's arenas and in the process's RSS). The KV cache comes back zeroed with the same
number of blocks; the scheduler's prefix cache is reset by the caller
(``EngineCore.sleep``), since the blocks' contents are gone.
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
        raise ValueError("level must be 1 or 2.")
    return int(level)


def check_tags(tags: Optional[Iterable[str]]) -> tuple[str, ...]:
    """The wake_up tags (None: all of them); ValueError naming ``tags`` for unknown ones."""
    if tags is None:
        return SLEEP_TAGS
    tags = tuple(tags)
    bad = [t for t in tags if t not in SLEEP_TAGS]
    if bad or not tags:
        raise ValueError(f"tags must be a non-empty subset of {list(SLEEP_TAGS)}"
                         f"{' (an unknown tag was given)' if bad else ''}.")
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
        self.parked: Optional[Any] = None  # sleep_park.Parked while level 1 holds the weights on disk

    def sleep(self, runner: Any, level: int) -> None:
        from llmserve.worker import sleep_park

        check_level(level)
        if "kv_cache" not in self.asleep and runner.kv_caches:
            self.num_blocks = runner.kv_caches[0].shape[1]
            runner.shutdown()  # the KV connector registered these tensors
            runner.kv_caches = []
            runner._kv_prefault_next = None  # nothing to prefault while asleep
        self.asleep.add("kv_cache")
        if level == 2 and self.parked is not None:  # deeper than a level 1 already taken
            self._drop_parked()
        if "weights" not in self.asleep:
            directory = sleep_park.park_dir() if level == 1 and runner.model is not None else None
            self.parked = sleep_park.park(runner.model, directory) if directory else None
            if self.parked is None:
                runner.model = None
                runner.lora_manager = None
        self.asleep.add("weights")
        release_freed_memory()
        if self.parked is not None:
            logger.info("Sleeping (level 1): %.0f MiB of weights parked on disk", self.parked.nbytes / 2**20)
        if level == 2:
            runner.model = None  # parked or not: level 2 rebuilds it
            runner.lora_manager = None
            release_freed_memory()
            evict_page_cache(runner.model_config)

    def _drop_parked(self) -> None:
        """Forget the parked weights (their file closes; the model is freed by the caller)."""
        import os

        parked, self.parked = self.parked, None
        parked.storages = []
        os.close(parked.fd)

    def _wake_weights(self, runner: Any) -> None:
        """Read the parked weights back, or rebuild the model (level 2, or a failed read)."""
        from llmserve.worker import sleep_park

        parked, self.parked = self.parked, None
        if parked is not None and runner.model is not None:
            try:
                sleep_park.unpark(parked)
                return
            except OSError as e:
                logger.warning("Wake: the parked weights could not be read back (%s): reloading the model", e)
                runner.model = None
        runner.load_model()

    def wake_up(self, runner: Any, tags: Optional[Iterable[str]] = None) -> None:
        t0 = time.perf_counter()
        for tag in check_tags(tags):
            if tag not in self.asleep:
                continue
            if tag == "weights":
                rebuilt = self.parked is None
                self._wake_weights(runner)
                if rebuilt:  # the loader's temporaries (measured: ~200 MiB of RSS otherwise)
                    release_freed_memory()
            elif self.num_blocks:
                runner.initialize_kv_cache(self.num_blocks)
            self.asleep.discard(tag)
        logger.info("Woke up (%s) in %.2f s", ", ".join(check_tags(tags)), time.perf_counter() - t0)
