"""Beam search in the engine (issue 29) against transformers' ``generate(num_beams=k)``,
float32: the beams (token ids and order) and their cumulative logprobs (1e-4), on a tiny
random Llama whose EOS is made likely (so beams end, and length_penalty and
early_stopping matter) and on SmolLM2 (real EOS at the end of a chat answer); beam rows
beside ordinary requests, under preemption, and KV blocks shared by the forks."""
from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.beam_search import BeamSearchParams

EOS = 2  # SmolLM2's tokenizer's EOS (<|im_end|>), which serves the tiny checkpoints too


def hf_beams(hf, prompt: list[int], k: int, max_new: int, lp: float, es, eos: int = EOS):
    """transformers' beams: generated ids (up to and with EOS) and cumulative logprobs."""
    stops = eos if isinstance(eos, list) else [eos]
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k, max_new_tokens=max_new,
                        do_sample=False, length_penalty=lp, early_stopping=es, eos_token_id=eos, pad_token_id=stops[0],
                        output_scores=True, return_dict_in_generate=True)
    seqs = []
    for row, score in zip(g.sequences[:, len(prompt):].tolist(), g.sequences_scores.tolist()):
        end = next((i for i, t in enumerate(row) if t in stops), None)
        row = row[:end + 1] if end is not None else row
        seqs.append((row, score * len(row) ** lp))
    return seqs


def assert_same_beams(out, ref, prompt_len: int, what: str, tol: float = 1e-4) -> None:
    got = [s.tokens[prompt_len:] for s in out.sequences]
    assert got == [r for r, _ in ref], what
    for s, (_, cum) in zip(out.sequences, ref):
        assert abs(s.cum_logprob - cum) < tol, what


def eos_likely_model(save_tiny_model_fn, arch: str, path: str, seed: int, prompts: list[list[int]]):
    """A tiny random ``arch`` checkpoint at ``path`` whose LM-head row for EOS points along
    the mean final hidden state of ``prompts``, scaled to 0.95 of the mean top logit: EOS
    is then the second candidate at most steps (llama: greedy rank 1 at 28 of 30 steps),
    so beams end. Returns the transformers model (float32)."""
    hf = save_tiny_model_fn(arch, path, seed=seed)
    with torch.no_grad():
        hs = torch.cat([hf.model(torch.tensor([p])).last_hidden_state[0] for p in prompts])
        m = hs.mean(0)
        hf.lm_head.weight[EOS] = m / m.dot(m) * hf.lm_head(hs).max(-1).values.mean() * 0.95
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, save_tiny_model_fn):
    """(LLM, transformers model, prompts) on a tiny Llama made to end beams on EOS."""
    path = str(tmp_path_factory.mktemp("beam_tiny"))
    prompts = [[(37 * i + 11 * j) % 49000 + 5 for j in range(9 + 7 * i)] for i in range(3)]
    hf = eos_likely_model(save_tiny_model_fn, "llama", path, 3, prompts)
    llm = LLM(path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              kv_cache_memory="64MiB", block_size=16, max_num_seqs=16)
    yield llm, hf, prompts
    llm.shutdown()


@pytest.mark.parametrize("k,lp,es", [(2, 0.3, False), (4, 0.6, True),
                                     pytest.param(8, 2.0, "never", marks=pytest.mark.slow)])
def test_tiny_beams_equal_transformers(tiny, k, lp, es):
    llm, hf, prompts = tiny
    params = BeamSearchParams(beam_width=k, max_tokens=10, length_penalty=lp, early_stopping=es,
                              include_stop_str_in_output=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    ended = 0
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref = hf_beams(hf, p, k, 10, lp, es)
        ended += sum(r[-1] == EOS for r, _ in ref)
        assert_same_beams(out, ref, len(p), f"k={k} prompt {i}")
    assert ended, "no beam ended on EOS: the test would not cover EOS handling"


def test_temperature_scales_the_logits_the_beams_are_scored_on(tiny):
    """vLLM ranks beams on log_softmax(logits / temperature): at 0.5 the beams equal
    transformers' beams on the same model with its LM head scaled by 1 / 0.5 (and differ
    from the raw ones); 0 (the default) and 1 keep the raw beams."""
    import copy

    llm, hf, prompts = tiny
    t, p = 0.5, prompts[1]
    hot = copy.deepcopy(hf)
    with torch.no_grad():
        hot.lm_head.weight.div_(t)

    def beams(temperature: float):
        return llm.beam_search({"prompt_token_ids": p}, BeamSearchParams(
            beam_width=3, max_tokens=5, length_penalty=0.5, temperature=temperature,
            include_stop_str_in_output=True))[0]

    scaled, raw = beams(t), beams(0.0)
    assert_same_beams(scaled, hf_beams(hot, p, 3, 5, 0.5, False), len(p), "temperature 0.5")
    assert [s.cum_logprob for s in scaled.sequences] != [s.cum_logprob for s in raw.sequences]
    assert [s.tokens for s in beams(1.0).sequences] == [s.tokens for s in raw.sequences]


def _width3_beams(path: str, prompts: list[list[int]]) -> list:
    """``LLM.beam_search`` (width 3, 8 tokens, length_penalty 0.5, EOS kept) on the
    checkpoint at ``path``, in a fresh in-process engine."""
    llm = LLM(path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              kv_cache_memory="64MiB", block_size=16, max_num_seqs=8)
    try:
        return llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                               BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5,
                                                include_stop_str_in_output=True))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_other_architectures_end_on_eos_as_transformers(tmp_path_factory, save_tiny_model_fn, arch):
    path = str(tmp_path_factory.mktemp(f"beam_{arch}"))
    prompts = [[(41 * i + 13 * j) % 49000 + 5 for j in range(11 + 6 * i)] for i in range(2)]
    hf = eos_likely_model(save_tiny_model_fn, arch, path, 4, prompts)
    outs = _width3_beams(path, prompts)
    ended = 0
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref = hf_beams(hf, p, 3, 8, 0.5, False)
        ended += sum(r[-1] == EOS for r, _ in ref)
        assert_same_beams(out, ref, len(p), f"{arch} prompt {i}")
    assert ended, f"{arch}: no beam ended on EOS"


def test_eos_dropped_unless_include_stop_str(tiny):
    llm, _, prompts = tiny
    with_eos = llm.beam_search({"prompt_token_ids": prompts[0]},
                               BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.0,
                                                include_stop_str_in_output=True))[0]
    without = llm.beam_search({"prompt_token_ids": prompts[0]},
                              BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.0))[0]
    assert any(s.finish_reason == "stop" for s in with_eos.sequences)
    for a, b in zip(with_eos.sequences, without.sequences):
        assert b.tokens == (a.tokens[:-1] if a.finish_reason == "stop" else a.tokens)
        assert len(b.logprobs) == len(b.tokens) - len(prompts[0])
        assert a.cum_logprob == b.cum_logprob


def test_mixed_batch_preemption_and_shared_blocks(tmp_path_factory, save_tiny_model_fn):
    """Beam requests beside a greedy one in an engine whose cache (11 blocks) cannot hold
    them all: preemptions happen and every answer equals the one it gets alone; alone,
    a 4-beam request's forks share the prompt's full blocks (peak <= 3 shared + 2 own
    per beam = 11, against 4 x 5 = 20 unshared) and every block is freed at the end."""
    path = str(tmp_path_factory.mktemp("beam_mixed"))
    save_tiny_model_fn("qwen2", path, seed=5)
    llm = LLM(path, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
              num_gpu_blocks_override=12, block_size=16, max_num_seqs=12, max_model_len=160)
    try:
        prompts = [[(29 * i + 13 * j) % 49000 + 5 for j in range(50 + i)] for i in range(3)]
        bp = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        eng = llm.llm_engine
        sched = eng.engine_core.engine_core.scheduler

        def run(reqs):
            for rid, p, beam in reqs:
                eng.add_request(rid, {"prompt_token_ids": p}, sp.clone(), beam_search_params=beam)
            done, peak = {}, 0
            while eng.has_unfinished_requests():
                done.update((o.request_id, [list(c.token_ids) for c in o.outputs]) for o in eng.step() if o.finished)
                peak = max(peak, sched.kv_cache_manager.num_used_blocks)
            return done, peak

        alone, peak = run([("b0", prompts[0], bp)])
        assert peak <= 3 + 4 + 4, peak  # 66 tokens: 3 shared full blocks, 2 own per beam
        alone.update(run([("b1", prompts[1], bp)])[0])
        alone.update(run([("g", prompts[2], None)])[0])
        assert len(alone["b0"]) == 4 and len(alone["g"]) == 1
        before = sched.num_preemptions_total
        mixed, _ = run([("b0", prompts[0], bp), ("g", prompts[2], None), ("b1", prompts[1], bp)])
        assert sched.num_preemptions_total > before, "the cache was meant to force preemption"
        assert mixed == alone
        assert sched.kv_cache_manager.num_used_blocks == 0 and not sched.beam.groups
    finally:
        llm.shutdown()


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    from llmserve.core.kv_cache_manager import KVCacheManager
    from llmserve.core.request import Request

    kv = KVCacheManager(num_blocks=10, block_size=4)
    parent = Request("p", list(range(10)), SamplingParams(max_tokens=4), None)
    kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    child = Request("c", list(range(10)), SamplingParams(max_tokens=4), None)
    copy = kv.fork(parent, child)
    pb, cb = kv.req_to_blocks["p"], kv.req_to_blocks["c"]
    assert cb[:2] == pb[:2] and all(b.ref_cnt == 2 for b in pb[:2])
    assert copy == (pb[2].block_id, cb[2].block_id) and cb[2] is not pb[2]
    kv.free(child)
    assert all(b.ref_cnt == 1 for b in pb) and kv.num_used_blocks == 3


def test_beam_width_over_max_num_seqs_names_n(tiny):
    llm, _, prompts = tiny
    with pytest.raises(ValueError, match="max_num_seqs") as e:
        llm.beam_search({"prompt_token_ids": prompts[0]}, BeamSearchParams(beam_width=17, max_tokens=4))
    assert e.value.param == "n"
    with pytest.raises(ValueError) as e:
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    assert e.value.param == "early_stopping"


def test_chat_conversation_prompt(tiny):
    llm, _, _ = tiny
    conv = [{"role": "user", "content": "Hi"}]
    ids = llm.apply_chat_template(conv)
    a = llm.beam_search(conv, BeamSearchParams(beam_width=2, max_tokens=4))[0]
    b = llm.beam_search({"prompt_token_ids": ids}, BeamSearchParams(beam_width=2, max_tokens=4))[0]
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert a.sequences[0].tokens[:len(ids)] == ids and a.sequences[0].text


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4, 8])
def test_smollm2_beams_equal_transformers(llm_fp32, hf_model, k):
    """SmolLM2 (float32, the GGUF weights in transformers too): a chat answer's beams end
    on <|im_end|> and equal transformers' with the same stop ids."""
    stop = sorted({llm_fp32.get_tokenizer().eos_token_id} | set(llm_fp32.model_config.extra_eos_token_ids))
    ids = llm_fp32.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm_fp32.beam_search({"prompt_token_ids": ids},
                               BeamSearchParams(beam_width=k, max_tokens=20, include_stop_str_in_output=True))[0]
    ref = hf_beams(hf_model, ids, k, 20, 1.0, False, eos=stop)
    # 2e-4: 20 tokens' float32 logits of two GEMM libraries (measured: 1.26e-4 at k=8 on a
    # cum of -10.23, ~6e-6 per token; the beam arithmetic itself is float64 here)
    assert_same_beams(out, ref, len(ids), f"SmolLM2 k={k}", tol=2e-4)


def _writer(arch: str):
    """The tiny-checkpoint writer of ``arch``'s own model tests (same signature as
    ``save_tiny_model_fn``)."""
    if arch in ("mixtral", "qwen3_moe"):
        from tests.models.test_moe import save_tiny
    else:
        from tests.models.test_gemma_phi3 import save_tiny
    return lambda a, path, seed=0: save_tiny(a, path, seed)


@pytest.mark.parametrize("arch", ["phi3", "mixtral", pytest.param("gemma2", marks=pytest.mark.slow),
                                  pytest.param("gemma3", marks=pytest.mark.slow),
                                  pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_newer_architectures_beams_equal_transformers(tmp_path_factory, arch):
    """Beam search on the architectures added after it (Phi-3, Gemma 2/3 with their
    sliding windows and soft caps, MoE) equals transformers' beams (ids and order)."""
    path = str(tmp_path_factory.mktemp(f"beam_{arch}"))
    prompts = [[(29 * i + 17 * j) % 49000 + 5 for j in range(12 + 5 * i)] for i in range(2)]
    hf = eos_likely_model(_writer(arch), arch, path, 5, prompts)
    outs = _width3_beams(path, prompts)
    for i, (p, out) in enumerate(zip(prompts, outs)):
        assert_same_beams(out, hf_beams(hf, p, 3, 8, 0.5, False), len(p), f"{arch} prompt {i}")


@pytest.mark.parametrize("field,value", [("length_penalty", "x"), ("length_penalty", float("nan")),
                                         ("length_penalty", float("inf")), ("beam_width", True),
                                         ("ignore_eos", "no"), ("include_stop_str_in_output", 1),
                                         ("temperature", float("inf")), ("temperature", "0.5")])
def test_bad_beam_search_params_are_a_value_error_naming_the_field(field, value):
    """A length_penalty of the wrong type reached the engine's scoring (a TypeError in the
    engine step); each bad value is a ValueError naming the field before it is sent."""
    from llmserve.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError) as e:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 3, field: value})
    assert e.value.param == field
