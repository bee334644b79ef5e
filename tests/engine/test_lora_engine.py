"""LoRA through the engine (in process): LLM.generate(lora_request=...) gives peft's
greedy tokens; 8 adapters and the base model mixed in one batch give exactly the tokens
each gives alone (and the prefix cache keeps each adapter's KV apart); a step never holds
more than max_loras adapters; the adapter utilities and their typed errors."""
from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.lora.errors import LoRAAdapterError
from llmserve.lora.request import LoRARequest

PROMPT = list(range(300, 340))  # 40 tokens: two full KV blocks the prefix cache can share
N_ADAPTERS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, save_tiny_model_fn, make_lora_adapter_fn):
    """(base dir, hf base, [(LoRARequest, PeftModel)] x 8 rank-16 adapters)."""
    root = tmp_path_factory.mktemp("lora_engine")
    base = str(root / "base")
    hf = save_tiny_model_fn("llama", base)
    out = []
    for i in range(1, N_ADAPTERS + 1):
        path = str(root / f"a{i}")
        out.append((LoRARequest(f"a{i}", i, path), make_lora_adapter_fn(hf, path, 16, seed=i)))
    return base, hf, out


def make_llm(base: str, **kw) -> LLM:
    return LLM(base, tokenizer="SmolLM2-135M-Instruct", dtype="float32", multiprocess_mode=False,
               kv_cache_memory="64MiB", enable_lora=True, max_lora_rank=16, **kw)


SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm8(adapters):
    llm = make_llm(adapters[0], max_loras=N_ADAPTERS)
    yield llm
    llm.shutdown()


def test_adapters_match_peft_and_mixed_batch_equals_alone(adapters, llm8):
    base, hf, loras = adapters
    reqs = [None] + [lr for lr, _ in loras]
    prompt = {"prompt_token_ids": PROMPT}
    alone = [tokens(llm8.generate([prompt], SP, lora_request=lr, use_tqdm=False))[0] for lr in reqs]
    ids = torch.tensor([PROMPT])
    for (lr, pm), got in zip(loras[:2], alone[1:3]):
        ref = pm.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(PROMPT):].tolist()
        assert got == ref, lr.lora_name
    ref_base = hf.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(PROMPT):].tolist()
    assert alone[0] == ref_base
    assert len({tuple(t) for t in alone}) == len(alone)  # each adapter answers differently
    outs = llm8.generate([prompt] * len(reqs), SP, lora_request=reqs, use_tqdm=False)
    assert tokens(outs) == alone
    # Each request hit its own adapter's cached prefix (two full blocks), none another's.
    assert all(o.num_cached_tokens == 32 for o in outs)


def test_max_loras_bounds_the_adapters_of_each_step(adapters, llm8):
    base, _, loras = adapters
    reqs = [lr for lr, _ in loras[:4]]
    want = tokens(llm8.generate([{"prompt_token_ids": PROMPT}] * 4, SP, lora_request=reqs, use_tqdm=False))
    llm = make_llm(base, max_loras=2, max_cpu_loras=3)
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        seen: list[set] = []
        schedule = sched.schedule

        def spy():
            so = schedule()
            seen.append({s.request.lora_request.lora_int_id for s in so.scheduled})
            return so
        sched.schedule = spy
        got = tokens(llm.generate([{"prompt_token_ids": PROMPT}] * 4, SP, lora_request=reqs, use_tqdm=False))
        assert got == want
        assert max(map(len, seen)) == 2
        # max_cpu_loras=3: four adapters used, the least recently used idle one unloaded.
        assert len(llm.llm_engine.list_loras()) == 3
        engine = llm.llm_engine
        assert engine.add_lora(reqs[0]) in (True, False) and reqs[0].lora_int_id in engine.list_loras()
        assert engine.add_lora(reqs[0]) is False  # already loaded
        assert engine.pin_lora(reqs[0].lora_int_id)
        assert engine.remove_lora(reqs[0].lora_int_id) and reqs[0].lora_int_id not in engine.list_loras()
        assert engine.remove_lora(reqs[0].lora_int_id) is False
        with pytest.raises(LoRAAdapterError) as e:
            engine.add_lora(LoRARequest("missing", 99, "/nonexistent/adapter"))
        assert e.value.param == "lora_path"
        with pytest.raises(ValueError, match="does not exist"):  # a request's adapter: refused, not base
            llm.generate([{"prompt_token_ids": PROMPT}], SP, lora_request=LoRARequest("m", 98, "/nope"),
                         use_tqdm=False)
    finally:
        llm.shutdown()


def test_lora_request_without_enable_lora_is_refused(llm_fp32):
    with pytest.raises(LoRAAdapterError, match="LoRA is not enabled") as e:
        llm_fp32.generate("hi", SP, lora_request=LoRARequest("a", 1, "/x"), use_tqdm=False)
    assert e.value.param == "lora_request"


def test_beam_search_runs_every_beam_with_the_adapter(adapters, llm8):
    from llmserve.beam_search import BeamSearchParams

    _, hf, loras = adapters
    (lr, pm) = loras[0]
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    got = llm8.beam_search([{"prompt_token_ids": PROMPT}], params, lora_request=lr)[0].sequences
    base = llm8.beam_search([{"prompt_token_ids": PROMPT}], params)[0].sequences
    ids = torch.tensor([PROMPT])
    ref = pm.generate(ids, max_new_tokens=5, min_new_tokens=5, num_beams=2, num_return_sequences=2,
                      do_sample=False, early_stopping=False)
    assert [s.tokens[len(PROMPT):] for s in got] == [r[len(PROMPT):].tolist() for r in ref]
    assert [s.tokens for s in got] != [s.tokens for s in base]  # not the base model's beams


def test_evicted_adapter_whose_files_are_gone_names_the_model(tmp_path):
    """An adapter unloaded for room (max_cpu_loras) is re-read from its path when next
    used; when its files were deleted, a request for it is refused naming the model
    (param "model") and saying the files are gone (it was a 400 'lora_path ... does not
    exist' with param null: the refusal crossed the process split as plain text). An
    adapter never loaded keeps the lora_path error."""
    import os
    import shutil

    from llmserve.engine.output_processor import OutputProcessor
    from llmserve.lora.config import LoRAConfig
    from llmserve.lora.errors import error_from_text, failure_text
    from llmserve.lora.models import load_adapter
    from llmserve.lora.registry import LoRARegistry

    class _Executor:  # reads as the worker does: the path must exist
        def read_lora(self, request):
            load_adapter(request.lora_path, 16) if not os.path.exists(request.lora_path) else None

        def add_lora(self, request, weights=None):
            self.read_lora(request)

        def remove_lora(self, lid):
            pass

    paths = [tmp_path / "a1", tmp_path / "a2"]
    for p in paths:
        p.mkdir()
    a1, a2 = (LoRARequest(f"a{i}", i, str(p)) for i, p in enumerate(paths, 1))
    reg = LoRARegistry(LoRAConfig(max_loras=1, max_cpu_loras=1), _Executor(), set)
    assert reg.add(a1) and reg.add(a2) and reg.list() == {2}  # a1 evicted
    shutil.rmtree(paths[0])
    for call in (lambda: reg.read(a1), lambda: reg.add(a1)):  # off the loop, or in process
        with pytest.raises(LoRAAdapterError) as e:
            call()
        assert e.value.param == "model"
        assert str(e.value).startswith("The model 'a1' (a LoRA adapter) cannot be used: it was unloaded to make "
                                       f"room (--max-cpu-loras) and its files at {str(paths[0])!r} are gone, so it "
                                       "cannot be reloaded."), str(e.value)
        # the refusal's text crosses the process split and comes back typed, param kept
        back = error_from_text(failure_text(e.value))
        assert isinstance(back, LoRAAdapterError) and back.param == "model" and str(back) == str(e.value)
    with pytest.raises(LoRAAdapterError) as e:
        reg.read(LoRARequest("new", 3, str(tmp_path / "never")))
    assert e.value.param == "lora_path"
    assert type(error_from_text("prompt too long")) is ValueError
    # the client side of a refused request: the caller's collector gets the typed error
    from types import SimpleNamespace

    from llmserve.engine.messages import EngineCoreRejection

    got = []
    st = SimpleNamespace(parent=None, collector=SimpleNamespace(put=got.append))
    proc = SimpleNamespace(states={"r": st}, parents={}, _forget=lambda *a: None)
    OutputProcessor.reject_requests(proc, [EngineCoreRejection("r", failure_text(e.value))])
    assert isinstance(got[0], LoRAAdapterError) and got[0].param == "lora_path"
