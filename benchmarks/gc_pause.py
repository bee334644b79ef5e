"""Issue 17, /health spikes: how long one full (generation 2) garbage collection stops the
API server's event loop, with the server's modules imported, before and after
``gc.freeze()`` (what ``llmserve.gc_utils.freeze_gc_heap`` does after start-up). Medians of
``--rounds`` collections each, and the load average. Run from the repository root:
``PYTHONPATH=$PWD python benchmarks/gc_pause.py``."""
import argparse
import gc
import json
import os
import statistics
import time

import llmserve.entrypoints.openai.api_server  # noqa: F401  (the server's import set)
import transformers  # noqa: F401


def _pause_ms() -> float:
    t = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t) * 1000


def main() -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    res = {"load_avg": os.getloadavg()[0], "tracked_objects": len(gc.get_objects())}
    res["full_gc_ms_median"] = statistics.median(_pause_ms() for _ in range(args.rounds))
    gc.freeze()
    res["frozen_objects"] = gc.get_freeze_count()
    res["full_gc_ms_median_after_freeze"] = statistics.median(_pause_ms() for _ in range(args.rounds))
    print(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
