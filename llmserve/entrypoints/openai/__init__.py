"""OpenAI-compatible HTTP server: protocol models, one serving handler per endpoint family,
the FastAPI app (api_server.py) and its CLI flags (cli_args.py)."""
