"""``python -m llmserve.ops``: build the ops package's four C++ extensions at once, each in
its own process (``make`` runs this once; later processes load the cached ``.so`` files),
and say for each whether it was built, loaded from the cache or is unavailable.

Built one after another, the three small extensions (packed GEMMs, LoRA, KV tier reader) were
compiled on first use inside the test run, one compiler at a time (~95 s of it on 2 cores);
side by side here they overlap with the main kernels' build. ``python -m llmserve.ops NAME``
builds one. A build that fails leaves its ops on their torch paths (logged), as on first use.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
import time

# name -> "module:getter"; the getter builds (or loads) the extension and returns None when it
# cannot be built here. The slowest first, so it starts before the others take the cores.
BUILDERS = {
    "quant_ops": "llmserve.ops.quant_ops:get_quant_ops",
    "cpu_ops": "llmserve.ops.cpu_ops:get_cpu_ops",
    "lora_ops": "llmserve.ops.lora_ops:get_lora_kernel",
    "tier_io": "llmserve.ops.tier_io:get_tier_io",
}


def build_one(name: str) -> bool:
    """Build (or load) the extension ``name`` of :data:`BUILDERS`; True when it is usable.
    Raises KeyError for a name not in :data:`BUILDERS`."""
    from llmserve.ops import cpu_ops

    module, getter = BUILDERS[name].split(":")
    t0 = time.time()
    compiled = len(cpu_ops.COMPILED)
    ok = getattr(importlib.import_module(module), getter)() is not None
    # "built" only when this process compiled it: make's second pass, and a first pass on a
    # machine whose cache holds the build, only load (both printed "built", then "ready").
    said = "built" if len(cpu_ops.COMPILED) > compiled else "loaded from the cache"
    print(f"llmserve {name}: {said if ok else 'UNAVAILABLE (torch paths)'} in {time.time() - t0:.1f}s", flush=True)
    return ok


def build_all() -> None:
    """Every extension of :data:`BUILDERS`, each in a child process, all at once."""
    procs = [subprocess.Popen([sys.executable, "-m", "llmserve.ops", name]) for name in BUILDERS]
    for p in procs:
        p.wait()


def main(argv: list[str]) -> None:
    if not argv:
        return build_all()
    for name in argv:
        if name not in BUILDERS:
            sys.exit(f"unknown extension {name!r}; one of {', '.join(BUILDERS)}")
        build_one(name)


if __name__ == "__main__":
    main(sys.argv[1:])
