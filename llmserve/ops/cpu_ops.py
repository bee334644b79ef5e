"""C++ CPU kernels for the model's hot path (sources in ``llmserve/ops/csrc/``), built on
first use with ``torch.utils.cpp_extension.load`` (-O3 -march=native, OpenMP).

- ``paged_decode``: paged-decode attention. The pure-torch decode path copies every
  request's K/V blocks out of the pool with advanced indexing before its matmuls, which
  DESIGN.md measured at 3-4 ms per layer for 64 sequences x 256 context; this kernel reads
  the blocks in place (vLLM's ``paged_attention_v1`` idea, written for CPU). In bfloat16 on
  CPUs with AVX512-BF16 it takes Q.K with the bf16 dot-product instruction and sums 16 keys
  at a time, and keeps the P.V accumulators in registers.
- ``rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul``, ``rotary_embedding`` and
  ``reshape_and_cache``: the element-wise parts of a Llama layer in one pass each (vLLM's
  ``csrc/cpu`` ops of the same names), with transformers' rounding to the model dtype
  between its ops, so results equal the torch path in float32 up to summation order. Run as
  separate torch ops they cost ~40 small kernels per layer; at batch 1 the dispatch alone is
  a few ms per step.

The build is cached under ``~/.cache/llmserve/torch_extensions``, one directory per source set,
torch version, CPU and Python environment (so checkouts with their own venvs do not rebuild
each other's). If it fails (no compiler, no ninja), ``get_cpu_ops``
returns None and the model and ``PagedAttention`` use their pure-torch paths, which the
tests compare with the kernels. ``LLMSERVE_CPU_OPS=0`` turns the kernels off.
Prebuild with ``python -m llmserve.ops`` (``make`` does, all four extensions at once). This module imports
nothing of llmserve: models, attention and the sampler import it.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
import sys
from typing import Any, Callable, Iterator, Optional

import torch

from llmserve import envs

logger = logging.getLogger(__name__)

CSRC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# Translation units, compiled separately; cpu_types.h and ops.h are included by them.
_SOURCES = ("bindings.cpp", "attention.cpp", "layernorm_activation.cpp", "sampler.cpp", "cache.cpp",
            "layer_driver.cpp")
_HEADERS = ("cpu_types.h", "ops.h", "packed_linear.h")
_NAME = "llmserve_cpu_ops"
# Names of the extensions this process compiled (not loaded from the cache):
# ``python -m llmserve.ops`` says "built" for these and "loaded" for the others.
COMPILED: set[str] = set()


def _source_text() -> str:
    """All C++ sources and headers, concatenated (the build cache key)."""
    parts = []
    for name in _HEADERS + _SOURCES:
        with open(os.path.join(CSRC_DIR, name)) as f:
            parts.append(f.read())
    return "".join(parts)


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    import platform
    return platform.processor()


def _build_dir() -> str:
    root = os.path.join(os.path.expanduser("~"), ".cache", "llmserve", "torch_extensions")
    # sys.prefix and the source folder too: the build files hold the venv's include paths and
    # the sources' absolute paths, so venvs or checkouts (git worktrees) sharing one directory
    # would keep rebuilding each other's kernels (seen: ~100 s per engine start).
    key = _source_text() + torch.__version__ + _cpu_signature() + sys.prefix + os.path.dirname(__file__)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    path = os.path.join(root, f"cpu_ops_{digest}")
    os.makedirs(path, exist_ok=True)
    return path


@functools.lru_cache(maxsize=1)
def get_cpu_ops() -> Optional[Any]:
    """The compiled ops module, or None when it cannot be built here (logged once) or
    ``LLMSERVE_CPU_OPS=0``. Ops (all write in place, return None):

    - ``paged_decode(out, q, kv_cache, block_tables, seq_lens, n, scale, window, softcap)``: out/q
      ``[N, num_heads, head_dim]`` (model dtype); kv_cache: one layer's ``[2, num_blocks,
      block_size, num_kv_heads, head_dim]``; block_tables ``[>=n, M]`` and seq_lens ``[>=n]``
      int32; n: decode requests; window: sliding window (0 = none); softcap: attention
      logit soft-capping ``c * tanh(s / c)`` on the scaled scores (0 = none; Gemma 2).
    - ``rms_norm(out, x, weight, eps)``: x/out ``[R, H]`` or ``[A, B, H]``, weight ``[H]``.
    - ``fused_add_rms_norm(out, x, residual, weight, eps)``: residual <- x + residual, out <-
      rms_norm(residual); contiguous ``[R, H]``.
    - ``silu_and_mul(out [T, I], gate_up [T, 2I])``.
    - ``rotary_embedding(positions [T] int64, x [T, heads, head_dim], cos [P, head_dim/2],
      sin [P, head_dim/2])``: float32 tables, x rotated in place.
    - ``reshape_and_cache(key, value, kv_cache, slot_mapping [T] int64)``.
    - ``to_float(out [R, C] float32, x [R, C])``.
    - ``sample_inverse_cdf(out [n] int64, x [n, V] float32, k [n] float32, u [n] float32)``:
      a token per row drawn from softmax(x * k / log2(e)) (k = log2(e) / temperature) at
      the uniform u, by the inverse CDF over 64-wide chunks; -inf logits are never drawn.
    - ``apply_token_bitmask(logits [N, V], bitmask int32 [R, W], rows [K] int64,
      bm_rows [K] int64)``: logits[rows[i], t] <- -inf where bitmask[bm_rows[i]] has bit t
      clear (xgrammar's layout), for t < min(V, 32 W); float32/bfloat16/float16 logits.
    Each raises RuntimeError on a shape, dtype or range mismatch.
    The first build takes ~40 s on 2 cores; later processes load the cached .so.
    """
    if envs.get("LLMSERVE_CPU_OPS", "1") == "0":
        return None
    build_dir = _build_dir()
    try:
        return cached_or_built(build_dir, _NAME, "C++ CPU kernels", "minutes", lambda: _compile(build_dir))
    except Exception as e:  # no compiler / ninja / headers: the torch path still works
        logger.warning("CPU kernels unavailable (%s: %s); using the torch path",
                       type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def cached_or_built(build_dir: str, name: str, what: str, takes: str, build: Callable[[], Any]) -> Any:
    """Module ``name`` from ``build_dir``: the cached ``<name>.so`` if it imports, else the
    one another process is building (waited for under :func:`build_lock`), else
    ``build()``'s (added to :data:`COMPILED`). "Building ... this takes <takes>" is logged
    only before ``build()`` runs: it was logged on every cache miss, so a process that
    waited for another's build and then loaded it (engines started together, tests) said it
    was building. The cached module is imported directly: ``cpp_extension.load`` would
    import setuptools and rerun the compiler check and ninja first (2-6 s of every engine
    start on a busy 2-core machine). Exceptions of ``build()`` propagate."""
    module = import_built(build_dir, name)
    if module is not None:
        return module
    with build_lock(build_dir, what):
        module = import_built(build_dir, name)  # built by the holder we waited for
        if module is not None:
            return module
        # the cache key (build_dir_for, _build_dir) covers the CPU, torch, the sources, the
        # venv and the checkout's folder: a fresh clone or venv builds again
        logger.warning("Building the %s for this CPU into %s (once per CPU, torch version, kernel source, venv "
                       "and checkout folder: a new clone or venv builds again; this takes %s)",
                       what, build_dir, takes)
        module = build()
        COMPILED.add(name)
        return module


@contextlib.contextmanager
def build_lock(build_dir: str, what: str = "kernels") -> Iterator[None]:
    """One builder per build directory, by an ``flock`` the kernel drops when its holder dies;
    waiting for a live holder is logged (``what``: the extension, for the message).

    torch's own lock (``FileBaton``: a ``lock`` file that exists while a build runs) is never
    removed when the builder is killed, and every later start then waits on it forever (seen:
    an engine killed by a test timeout during its first build hung all later starts). Under
    this flock any such file is left over from a dead builder, so it is removed first."""
    with open(os.path.join(build_dir, "build.flock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("Waiting for another process building the %s into %s", what, build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                logger.warning("removing a stale kernel build lock left by a killed build: %s", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(build_dir: str) -> Any:
    """Compile the kernels into ``build_dir`` and import them (2-6 min on 2 busy cores; the
    caller announces it, or the first start looks hung: fresh-user trial of stop 42)."""
    from torch.utils.cpp_extension import load
    return load(
        name=_NAME,
        sources=[os.path.join(CSRC_DIR, name) for name in _SOURCES],
        extra_include_paths=[CSRC_DIR],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
        extra_ldflags=["-fopenmp"],
        build_directory=build_dir,
        verbose=False,
    )


def kv_dtypes_ok(act_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether ``paged_decode`` / ``reshape_and_cache`` take activations (q, K/V written) of
    ``act_dtype`` with a KV cache of ``cache_dtype``: the same dtype, or float32 over a
    float16 / bfloat16 cache (``--kv-cache-dtype``; rounded to nearest even on write,
    widened exactly on read)."""
    return cache_dtype is act_dtype or (act_dtype is torch.float32 and cache_dtype in (torch.float16, torch.bfloat16))


def get_decode_kernel() -> Optional[Callable]:
    """``get_cpu_ops().paged_decode``, or None when the kernels are unavailable."""
    ops = get_cpu_ops()
    return None if ops is None else ops.paged_decode


def cpu_ops_for(t: torch.Tensor) -> Optional[Any]:
    """The ops module when ``t`` is a CPU tensor and the kernels are built, else None."""
    return get_cpu_ops() if t.device.type == "cpu" else None


def main() -> None:
    """Build (or load) the kernels and say where they are (``make`` runs this once)."""
    import time
    t0 = time.time()
    ops = get_cpu_ops()
    print(f"llmserve CPU kernels: {ready_word(ops is not None, _NAME)} in {time.time() - t0:.1f}s ({_build_dir()})")


def ready_word(ok: bool, name: str) -> str:
    """What the ``python -m`` entry points print for extension ``name``: "built" (compiled
    by this process), "loaded from the cache" or "UNAVAILABLE (torch paths)"."""
    if not ok:
        return "UNAVAILABLE (torch paths)"
    return "built" if name in COMPILED else "loaded from the cache"


def build_dir_for(source: str, prefix: str) -> str:
    """``~/.cache/llmserve/torch_extensions/<prefix>_<hash>`` (created) for one small
    extension built from ``csrc/<source>``: the hash covers the source (and the csrc headers
    it includes), torch's version, the CPU, the venv (``sys.prefix``) and the checkout's
    ``csrc`` folder, so any change, a new venv or a fresh clone builds into a fresh folder."""
    with open(os.path.join(CSRC_DIR, source)) as f:
        text = f.read()
    # The headers it includes from csrc/ too (quant_gemv.cpp's simd16.h): editing one rebuilds.
    for header in re.findall(r'^#include "([^"]+)"', text, flags=re.M):
        with open(os.path.join(CSRC_DIR, header)) as f:
            text += f.read()
    key = text + torch.__version__ + _cpu_signature() + sys.prefix + CSRC_DIR
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    path = os.path.join(os.path.expanduser("~"), ".cache", "llmserve", "torch_extensions", f"{prefix}_{digest}")
    os.makedirs(path, exist_ok=True)
    return path


def import_built(build_dir: str, name: str) -> Optional[Any]:
    """The built module ``<build_dir>/<name>.so``, imported without ``cpp_extension.load``'s
    compiler checks (seconds of every engine start), or None (absent, partial, foreign)."""
    import importlib.util

    path = os.path.join(build_dir, f"{name}.so")
    if not os.path.exists(path):
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception:  # a partial or foreign file: rebuild
        return None


def load_small_extension(name: str, source: str, prefix: str, what: str, fallback: str,
                         cflags: list[str], ldflags: Optional[list[str]] = None,
                         env_switch: Optional[str] = "LLMSERVE_CPU_OPS") -> Optional[Any]:
    """One small extension (``csrc/<source>`` as module ``name``): the cached build, else
    built once under :func:`build_lock`; None when ``env_switch`` (an environment variable,
    None: none) is "0" or the build fails (logged: ``what`` is unavailable, ``fallback``
    runs instead). The LoRA kernel, the KV tier reader and the packed-weight kernels are
    built this way, apart from the model kernels, so that none rebuilds another."""
    if env_switch is not None and envs.get(env_switch, "1") == "0":
        return None
    build_dir = build_dir_for(source, prefix)

    def build() -> Any:
        from torch.utils.cpp_extension import load  # imports setuptools: only when building
        return load(name=name, sources=[os.path.join(CSRC_DIR, source)], extra_cflags=cflags,
                    extra_ldflags=ldflags or [], build_directory=build_dir, verbose=False)
    try:
        return cached_or_built(build_dir, name, what, "20 s to minutes", build)
    except Exception as e:  # no compiler: the caller's fallback still works
        logger.warning("%s unavailable (%s: %s); using %s", what[0].upper() + what[1:], type(e).__name__,
                       str(e).splitlines()[0] if str(e) else "", fallback)
        return None


if __name__ == "__main__":
    main()
