"""Kernels under the models: the C++ CPU ops (``csrc/``) and their loader
(``cpu_ops``). Imports nothing above it; ``models``, ``attention`` and ``sample`` call it."""
