"""User-facing entry points: the offline ``LLM`` (llm.py), the ``llmserve`` CLI (cli.py) and
the OpenAI-compatible server (openai/)."""
