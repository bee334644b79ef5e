"""SmolLM2 (a Llama) as an embedding model with ``runner="pooling"``: the last token's
final hidden state, normalised, equals transformers' (vLLM's embed conversion)."""
from __future__ import annotations

import pytest
import torch

from llmserve import LLM, PoolingParams

TEXTS = ["The capital of France is", "Embeddings from a decoder use the last token.", "Hi"]


@pytest.fixture(scope="module")
def smol_pooling():
    llm = LLM("SmolLM2-135M-Instruct", runner="pooling", dtype="float32", multiprocess_mode=False,
              kv_cache_memory="64MiB", max_model_len=512)
    yield llm
    llm.shutdown()


def test_runner_pooling_is_last_token_normalised_as_transformers(smol_pooling, hf_model):
    assert smol_pooling.get_supported_tasks() == ("encode", "embed")
    tok = smol_pooling.get_tokenizer()
    outs = smol_pooling.embed(TEXTS, use_tqdm=False)
    for text, out in zip(TEXTS, outs):
        ids = tok(text).input_ids
        assert out.prompt_token_ids == ids
        with torch.inference_mode():
            h = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
        ref = torch.nn.functional.normalize(h, dim=0)
        assert torch.allclose(torch.tensor(out.outputs.embedding), ref, atol=1e-4)
    # The same prompts again are prefix-cache hits: the last token still pools the same.
    again = smol_pooling.embed(TEXTS, use_tqdm=False)
    for a, b in zip(outs, again):
        assert torch.allclose(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding), atol=1e-5)


def test_pooling_model_refuses_generate_and_generating_model_refuses_embed(smol_pooling, llm_fp32):
    with pytest.raises(ValueError, match="--runner generate"):
        smol_pooling.generate("Hello")
    with pytest.raises(ValueError, match="--runner pooling"):
        llm_fp32.embed("Hello")
    with pytest.raises(ValueError, match="--runner pooling"):
        llm_fp32.score("a", "b")
    assert llm_fp32.get_supported_tasks() == ("generate",)


def test_generating_model_embeds_hidden_states_in_its_own_steps(smol_pooling, llm_fp32, hf_model):
    """PoolingParams(hidden_state_embed=True) on a generating model (Ollama's embeddings
    from any model): the vector equals the pooling runner's (last token, normalised), in
    the same engine steps as a generate request, which samples as it does alone; a prompt
    longer than a step's token budget (512 here) is chunked and pools at its end, as
    transformers; without the flag the generating model still refuses (vLLM's rule)."""
    from llmserve import SamplingParams

    eng = llm_fp32.llm_engine
    greedy = SamplingParams(max_tokens=4, temperature=0)
    alone = llm_fp32.generate(TEXTS[0], greedy, use_tqdm=False)[0].outputs[0].token_ids
    eng.add_request("g", TEXTS[0], greedy)
    for i, text in enumerate(TEXTS):
        eng.add_request(f"e{i}", text, PoolingParams(task="embed", hidden_state_embed=True))
    eng.add_request("raw", TEXTS[2], PoolingParams(task="embed", hidden_state_embed=True, normalize=False,
                                                   dimensions=576))
    long_ids = [int(t) for t in torch.randint(100, 40000, (700,), generator=torch.Generator().manual_seed(0))]
    eng.add_request("long", {"prompt_token_ids": long_ids}, PoolingParams(task="embed", hidden_state_embed=True))
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert list(done["g"].outputs[0].token_ids) == list(alone)
    ref = smol_pooling.embed(TEXTS, use_tqdm=False)
    for i, r in enumerate(ref):
        got = torch.as_tensor(done[f"e{i}"].outputs.data)
        assert torch.allclose(got, torch.tensor(r.outputs.embedding), atol=1e-5)
    raw = torch.as_tensor(done["raw"].outputs.data)
    assert raw.shape == (576,) and raw.norm() > 2 and torch.allclose(
        torch.nn.functional.normalize(raw, dim=0), torch.tensor(ref[2].outputs.embedding), atol=1e-5)
    with torch.inference_mode():
        h = hf_model.model(torch.tensor([long_ids])).last_hidden_state[0, -1].float()
    assert torch.allclose(torch.as_tensor(done["long"].outputs.data), torch.nn.functional.normalize(h, dim=0),
                          atol=1e-4)
    with pytest.raises(ValueError, match="--runner pooling"):
        eng.add_request("x", "Hello", PoolingParams(task="embed"))


def test_runner_and_convert_values():
    from llmserve.engine_args import EngineArgs

    cfg = EngineArgs(model="SmolLM2-135M-Instruct", convert="embed").create_engine_config()
    assert cfg.model_config.runner == "pooling"
    assert cfg.model_config.pooler_config.pooling_type == "LAST"
    with pytest.raises(ValueError, match="runner"):
        EngineArgs(model="SmolLM2-135M-Instruct", runner="sample").create_engine_config()
    with pytest.raises(ValueError, match="encoder"):
        EngineArgs(model="all-MiniLM-L6-v2", runner="generate").create_engine_config()
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineArgs(model="all-MiniLM-L6-v2", max_num_batched_tokens=64).create_engine_config()
    assert PoolingParams(dimensions=4).dimensions == 4
