"""The transformers baseline: static batches, left padding, only requested tokens count."""
from __future__ import annotations

import os

import pytest
import torch

from llmserve.benchmarks.hf_backend import load_hf_model, resolve_model_files, run_hf


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    return load_hf_model(tiny_llama_dir, "float32")


def test_packaged_model_resolves_to_the_gguf():
    path, gguf = resolve_model_files("SmolLM2-135M-Instruct")
    assert gguf is not None and gguf.endswith(".gguf")
    assert os.path.isfile(os.path.join(path, gguf))


def test_counts_only_requested_tokens(tiny_model):
    requests = [([5, 6, 7, 8, 9], 4), ([10, 11], 2), ([12, 13, 14], 3)]
    r = run_hf(tiny_model, requests, batch_size=2, temperature=0.0, keep_outputs=True)
    assert r.num_requests == 3
    assert r.prompt_tokens == 10
    assert r.output_tokens == 9  # 4 + 2 + 3, not the padded 4 + 4 + 3
    assert r.generated_tokens == 2 * 4 + 1 * 3  # batch 1 runs to 4 tokens, batch 2 to 3
    assert [len(o) for o in r.outputs] == [4, 2, 3]
    assert r.output_tokens_per_s == pytest.approx(9 / r.elapsed_s)
    assert r.total_tokens_per_s == pytest.approx(19 / r.elapsed_s)


def test_left_padded_batch_matches_each_prompt_alone(tiny_model):
    requests = [([100, 200, 300, 400, 500, 600], 5), ([700, 800], 5), ([900, 1000, 1100], 5)]
    batched = run_hf(tiny_model, requests, batch_size=3, temperature=0.0, keep_outputs=True).outputs
    alone = [run_hf(tiny_model, [r], batch_size=1, temperature=0.0, keep_outputs=True).outputs[0]
             for r in requests]
    assert batched == alone


def test_sampling_is_seeded(tiny_model):
    requests = [([5, 6, 7], 6), ([8, 9], 6)]
    a = run_hf(tiny_model, requests, temperature=1.0, seed=3, keep_outputs=True).outputs
    b = run_hf(tiny_model, requests, temperature=1.0, seed=3, keep_outputs=True).outputs
    assert a == b


@pytest.mark.parametrize("kw, field", [({"batch_size": 0}, "batch_size"),
                                       ({"requests": []}, "requests"),
                                       ({"requests": [([1], 0)]}, "output length"),
                                       ({"requests": [([], 3)]}, "empty prompt")])
def test_invalid_arguments_raise(tiny_model, kw, field):
    args = {"requests": [([1, 2], 2)], **kw}
    with pytest.raises(ValueError, match=field):
        run_hf(tiny_model, **args)
