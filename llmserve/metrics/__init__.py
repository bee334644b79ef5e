"""Engine metrics: per-step stats (stats.py) and their loggers (prometheus.py, loggers.py)."""
