"""Fixtures of the entrypoint unit tests: the real SmolLM2 tokenizer (from the packaged
GGUF, loaded once per session)."""
import pytest


@pytest.fixture(scope="session")
def smol_tokenizer():
    from llmserve.tokenizer import get_tokenizer

    return get_tokenizer("SmolLM2-135M-Instruct")
