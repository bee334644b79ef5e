"""Resource figures of a process tree for the benchmarks (psutil): CPU seconds and RSS of a
process and its live descendants (an API server and its EngineCore, llama-server)."""
from __future__ import annotations

import psutil


def process_tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and its descendants; [] when it is gone."""
    try:
        p = psutil.Process(pid)
        return [p] + p.children(recursive=True)
    except psutil.Error:
        return []


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants."""
    total = 0.0
    for q in process_tree(pid):
        try:
            t = q.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def tree_rss_mib(pid: int) -> float:
    """Resident MiB of ``pid`` and its live descendants."""
    total = 0
    for q in process_tree(pid):
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20
