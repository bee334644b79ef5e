"""Units of the FIM layout and token discovery, and of the Responses doors' policies
(unsupported tools, the event log that GET ?stream=true replays)."""
from __future__ import annotations

import asyncio
import copy

import pytest
from test_app import _output, app_and_engine  # noqa: F401  (the fixture)

from llmserve.entrypoints.openai.infill.fim import FimTokens, find_fim_tokens, format_infill, infill_layout
from llmserve.entrypoints.openai.responses.streaming import EventLog

BASE = {"model": "m", "input": "hi", "max_output_tokens": 2, "store": False}


@pytest.mark.parametrize("names, expected", [
    (["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<reponame>"], ("prefix", "middle", "suffix")),
    (["▁<PRE>", "▁<MID>", "▁<SUF>"], ("prefix", "middle", "suffix")),  # CodeLlama's HF names
    (["<|fim_prefix|>", "<|fim_suffix|>"], None),  # no middle token: no FIM
])
def test_fim_tokens_found_by_name(smol_tokenizer, names, expected):
    tok = copy.deepcopy(smol_tokenizer)
    assert find_fim_tokens(tok) is None  # SmolLM2 has none
    tok.add_special_tokens({"additional_special_tokens": names})
    found = find_fim_tokens(tok)
    if expected is None:
        assert found is None
    else:
        assert [getattr(found, r) for r in expected] == tok.convert_tokens_to_ids(names[:3])
        assert found.sep is None and found.add_bos is False


def test_fim_tokens_from_gguf_metadata(smol_tokenizer, tmp_path):
    import gguf

    path = str(tmp_path / "fim.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for key, value in [("fim_pre", 7), ("fim_suf", 8), ("fim_mid", 9), ("fim_sep", 10)]:
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    found = find_fim_tokens(smol_tokenizer, path)
    # the metadata's ids; the repo token it leaves out is found by name (SmolLM2 has StarCoder's <reponame>)
    assert (found.prefix, found.suffix, found.middle, found.sep) == (7, 8, 9, 10)
    assert found.repo == smol_tokenizer.convert_tokens_to_ids("<reponame>")


def test_format_infill_budgets_and_spm():
    t = FimTokens(prefix=-1, suffix=-2, middle=-3, bos=-9, add_bos=True)
    prefix, suffix, extra = list(range(2000)), list(range(1000, 1700)), [5] * 10
    ids = format_infill(t, prefix, suffix, extra, [42], n_ctx=4096)
    # llama-server: the last 1536 prefix tokens, the first 512 - 3 suffix tokens, all extra
    assert ids == extra + [-9, -1] + prefix[-1536:] + [42] + [-2] + suffix[:509] + [-3]
    assert format_infill(t, [1], [2], extra, [], n_ctx=2048)[:4] == [5, 5, -9, -1]  # room for 2048 - 2048 + 2
    assert format_infill(t, [1], [2], [], [], n_ctx=4096, spm=True) == [-9, -2, 2, -1, 1, -3]


class _EncodeThreads:
    """A tokenizer wrapper that records the thread of each ``encode`` of ``text``."""

    def __init__(self, tokenizer, text):
        self._tokenizer, self._text, self.threads = tokenizer, text, []

    def encode(self, text, *args, **kwargs):
        if text == self._text:
            import threading
            self.threads.append(threading.current_thread().name)
        return self._tokenizer.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_completion_logit_bias_text_keys_are_tokenized_in_the_renderer_pool(app_and_engine):
    """llama-server's ``/completion`` tokenizes ``logit_bias``'s text keys: that ran on the
    event loop (a long key held every other request); now in the renderer's pool, as the
    prompt's tokenization. The bias still reaches the engine."""
    client, engine = app_and_engine()
    engine.outputs = [_output("x", "stop")]
    handler = client.app.state.openai_serving_completion
    handler.tokenizer = recorder = _EncodeThreads(handler.tokenizer, " hello")
    r = client.post("/completion", json={"prompt": "hi", "n_predict": 1, "logit_bias": [[" hello", 3.0]]})
    assert r.status_code == 200, r.text
    assert recorder.threads and all(name.startswith("llmserve-renderer") for name in recorder.threads), recorder.threads
    assert engine.params[-1].logit_bias == {recorder.encode(" hello", add_special_tokens=False)[0]: 3.0}


def test_infill_layout_counts_the_kept_tokens_of_each_field(smol_tokenizer):
    """The field a too-long /infill prompt is blamed on: the one holding most of the laid-out
    tokens after llama-server's budgets (a 1536-token cap on the prefix, ...)."""
    t = FimTokens(prefix=-1, suffix=-2, middle=-3)
    word = " x" * 2000
    layout = infill_layout(smol_tokenizer, t, word, "b", [], "", n_ctx=512)
    assert layout.kept == {"input_prefix": 1536, "input_suffix": 1, "input_extra": 0, "prompt": 0}
    assert layout.largest_field() == "input_prefix" and len(layout.token_ids) == 1536 + 4
    assert infill_layout(smol_tokenizer, t, "a", "b", [], word + word, n_ctx=512).largest_field() == "prompt"


def test_unsupported_tools_reject_policy(app_and_engine):  # noqa: F811
    client, engine = app_and_engine("--responses-unsupported-tools", "reject")
    engine.outputs = [_output("x", "stop")]
    r = client.post("/v1/responses", json={**BASE, "tools": [{"type": "image_generation"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].type"
    assert "image_generation" in r.json()["error"]["message"] and engine.prompts == []
    client, engine = app_and_engine()  # the default drops it and says so
    engine.outputs = [_output("x", "stop")]
    r = client.post("/v1/responses", json={**BASE, "tools": [{"type": "image_generation"}, {"type": "local_shell"}]})
    assert r.status_code == 200 and r.headers["x-llmserve-dropped-tools"] == "image_generation,local_shell"


def test_event_log_replays_then_follows():
    async def run():
        log = EventLog()
        log.extend(["e0", "e1"])
        got = []

        async def reader():
            async for e in log.follow(0):
                got.append(e)
        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0)
        log.extend(["e2"])
        await asyncio.sleep(0)
        log.close()
        await asyncio.wait_for(task, 5)
        return got
    assert asyncio.run(run()) == ["e1", "e2"]


def test_audio_form_fields_follow_the_one_policy():
    from llmserve.entrypoints.openai.speech_to_text.protocol import parse_form
    from llmserve.sampling_params import SamplingParamsError

    upload = object()
    request, got = parse_form([("file", upload), ("model", "w"), ("colour", "red"), ("chunking_strategy", "auto")])
    assert got is upload and request.model == "w"  # unknown fields are ignored (logged), as on JSON routes
    for key, value, param in [("include[]", "logprobs", "include"), ("known_speaker_names[]", "a", "known_speaker_names"),
                              ("chunking_strategy", '{"type": "server_vad"}', "chunking_strategy")]:
        with pytest.raises(SamplingParamsError) as e:
            parse_form([("file", upload), (key, value)])
        assert e.value.param == param


def test_event_log_bounds_its_memory_and_keeps_its_newest_events():
    """Past max_events the older half goes: a follower still gets every newer event, the
    terminal one included; one behind what is kept stops (a resume there is the handler's 400)."""
    async def run():
        log = EventLog(max_events=4)
        live, behind = log.follow(-1), log.follow(-1)
        log.extend(["e0", "e1", "e2", "e3"])
        got = [await live.__anext__() for _ in range(4)]
        log.extend(["e4", "e5"])  # 6 > 4: e0..e3 go, the newest half stays
        log.extend(["done"])
        log.close()
        return got + [e async for e in live], [e async for e in behind], log
    followed, lagging, log = asyncio.run(run())
    assert followed == ["e0", "e1", "e2", "e3", "e4", "e5", "done"]
    assert log.first == 4 and log.events == ["e4", "e5", "done"] and log.count == 7 and log.replayable
    assert lagging == []
    log.drop()
    assert not log.replayable and log.events == [] and log.done
