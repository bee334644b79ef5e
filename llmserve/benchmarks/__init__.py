"""Benchmarks behind ``llmserve bench``: serve (online, against a running server),
throughput and latency (offline engine). Each module exposes ``add_cli_args(parser)`` and
``main(args)``; datasets.py holds the request samplers they share."""
