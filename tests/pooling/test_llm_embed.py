"""Offline pooling: ``LLM.embed``/``encode``/``score`` on all-MiniLM-L6-v2 against
sentence-transformers, runner checks, per-prompt params."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pooling_utils import make_sentences
from llmserve import PoolingParams


def _cos(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_supported_tasks_and_pooler_from_sentence_transformers_files(minilm_llm):
    assert minilm_llm.get_supported_tasks() == ("encode", "embed")
    pc = minilm_llm.model_config.pooler_config
    assert (pc.pooling_type, pc.normalize) == ("MEAN", True)


def test_embed_equals_sentence_transformers_in_any_batch_composition(minilm_llm, st_model):
    sentences = make_sentences(40)
    ref = st_model.encode(sentences, batch_size=64, convert_to_numpy=True)
    together = np.array([o.outputs.embedding for o in minilm_llm.embed(sentences, use_tqdm=False)])
    assert _cos(together, ref).min() >= 0.99999
    # Another composition: reversed order, in uneven slices, one alone.
    rev = sentences[::-1]
    parts = [rev[:1], rev[1:8], rev[8:]]
    other = np.array([o.outputs.embedding for p in parts for o in minilm_llm.embed(p, use_tqdm=False)])[::-1]
    assert _cos(other, ref).min() >= 0.99999
    # Batch invariant: the same vectors bit for bit, whatever else ran in the step.
    assert np.array_equal(other, together)
    assert np.allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)


def test_encode_token_ids_and_per_prompt_params(minilm_llm, st_model):
    tok = minilm_llm.get_tokenizer()
    ids = tok("Hello my name is").input_ids
    outs = minilm_llm.encode([{"prompt_token_ids": ids}, "Hello my name is"],
                             [PoolingParams(normalize=False), PoolingParams()], use_tqdm=False)
    raw, normed = outs[0].outputs.data, outs[1].outputs.data
    assert outs[0].prompt_token_ids == ids and raw.dtype == torch.float32 and raw.shape == (384,)
    assert abs(float(raw.norm()) - 1.0) > 1e-3  # not normalised
    assert torch.allclose(torch.nn.functional.normalize(raw, dim=0), normed, atol=1e-6)


def test_truncate_prompt_tokens_cuts_text_as_the_tokenizer_does(minilm_llm):
    # vLLM truncates pooling prompts on the right (vllm-project/vllm#12050): a text keeps
    # its first tokens and its [CLS] ... [SEP]; token ids keep their last k
    tok = minilm_llm.get_tokenizer()
    text = "one two three four five six seven eight nine ten"
    cut = list(tok(text, truncation=True, max_length=5).input_ids)
    out = minilm_llm.embed(text, truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert out.prompt_token_ids == cut and cut[0] == tok.cls_token_id and cut[-1] == tok.sep_token_id
    same = minilm_llm.embed({"prompt_token_ids": cut}, use_tqdm=False)[0]
    assert np.allclose(out.outputs.embedding, same.outputs.embedding, atol=1e-6)
    ids = tok(text).input_ids
    assert minilm_llm.embed({"prompt_token_ids": ids}, truncate_prompt_tokens=5,
                            use_tqdm=False)[0].prompt_token_ids == ids[-5:]


def test_errors(minilm_llm):
    with pytest.raises(ValueError, match="--runner generate"):
        minilm_llm.generate("Hello")
    with pytest.raises(ValueError, match="--runner generate"):
        minilm_llm.chat([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="matryoshka"):
        minilm_llm.embed("Hello", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        minilm_llm.embed("word " * 600, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        minilm_llm.embed({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)
    # Nothing was left running; the engine still answers.
    assert len(minilm_llm.embed(["ok", "fine"], use_tqdm=False)) == 2


def test_score_is_cosine_of_embeddings(minilm_llm, st_model):
    q = "What is the capital of France?"
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "The capital of Japan is Tokyo."]
    scores = [s.outputs.score for s in minilm_llm.score(q, docs, use_tqdm=False)]
    ref = st_model.encode([q] + docs)
    assert np.allclose(scores, _cos(ref[:1], ref[1:]), atol=1e-5)
    assert scores[0] == max(scores)
    pairs = minilm_llm.score(docs, docs, use_tqdm=False)
    assert all(abs(p.outputs.score - 1.0) < 1e-5 for p in pairs)
    with pytest.raises(ValueError, match="data_1"):
        minilm_llm.score(docs[:2], docs, use_tqdm=False)
