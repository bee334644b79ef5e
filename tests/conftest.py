"""Shared fixtures: the real default model (SmolLM2-135M-Instruct GGUF) in float32,
through llmserve and through Hugging Face transformers (the correctness reference)."""
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):",
    "The three primary colors are",
    "In 1969, the first humans",
    "Water boils at a temperature of",
    "My favourite recipe for pancakes",
    "The quick brown fox",
    "To be or not to be,",
    "Machine learning is a field of",
    "Paris, London and Berlin are",
    "The square root of 144 is",
    "Photosynthesis is the process",
    "A haiku about the ocean:",
    "import numpy as np\n",
    "Dear hiring manager, I am writing",
]


@pytest.fixture(scope="session")
def smollm():
    """ResolvedModel of the packaged default model."""
    from llmserve.model_loader import resolve_model

    return resolve_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def hf_model(smollm):
    """transformers' own Llama on the same GGUF weights, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(smollm.path, gguf_file=smollm.gguf_file, dtype=torch.float32)
    m.eval()
    return m


@pytest.fixture(scope="session")
def llm_fp32():
    """llmserve LLM on the default model, float32, engine in-process."""
    from llmserve import LLM

    llm = LLM("SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False, kv_cache_memory="512MiB",
              max_num_batched_tokens=512)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def hf_greedy(hf_model, llm_fp32):
    """HF greedy continuations (32 new tokens max, stopping at EOS like HF does) of PROMPTS."""
    import torch

    tok = llm_fp32.get_tokenizer()
    res = {}
    for p in PROMPTS:
        ids = tok.encode(p)
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=32, do_sample=False, eos_token_id=tok.eos_token_id,
                                    pad_token_id=tok.eos_token_id)
        res[p] = out[0, len(ids):].tolist()
    return res
