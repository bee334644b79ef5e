"""Ollama's front door without a server: ``options`` / ``format`` -> the common request's
fields, messages -> the common messages, the common stream objects -> NDJSON lines (tool
calls assembled from their fragments, an error after the start as a last ``{"error"}``
line), and /api/tags listing LoRA adapters. The real server and clients are
tests/e2e/test_ollama_api.py."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from test_app import _output, app_and_engine  # noqa: F401  (fixture)

from llmserve.entrypoints.ollama import info
from llmserve.entrypoints.ollama.options import sampling_fields, structured_fields
from llmserve.entrypoints.ollama.protocol import OllamaMessage
from llmserve.entrypoints.ollama.serving import openai_message
from llmserve.entrypoints.ollama.stream import OllamaWire, RunStats
from llmserve.entrypoints.openai.chat_completion.protocol import (ChatCompletionResponseStreamChoice,
                                                                  ChatCompletionStreamResponse, DeltaFunctionCall,
                                                                  DeltaMessage, DeltaToolCall)
from llmserve.entrypoints.openai.common.protocol import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                                         ChatCompletionLogProbsContent, CompletionLogProbs, UsageInfo)
from llmserve.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse
from llmserve.entrypoints.openai.models.lora import LoRAAdapters
from llmserve.entrypoints.openai.models.serving import BaseModelPath, OpenAIServingModels
from llmserve.lora.request import LoRARequest
from llmserve.sampling_params import SamplingParamsError


def test_options_map_to_sampling_fields():
    got = sampling_fields({"temperature": 0.2, "top_k": 40, "num_predict": -1, "repeat_penalty": 1.1,
                           "stop": ["\n"], "num_ctx": 8192, "num_thread": 4, "mirostat": 0, "new_knob": 1})
    assert got == {"temperature": 0.2, "top_k": 40, "max_tokens": None, "repetition_penalty": 1.1, "stop": ["\n"]}
    assert sampling_fields({"num_predict": 5, "seed": 3.0}) == {"max_tokens": 5, "seed": 3}
    for no_limit in (0, -2, -3):  # Ollama's runner limits only above 0
        assert sampling_fields({"num_predict": no_limit}) == {"max_tokens": None}
    for bad, param in (({"mirostat": 2}, "options.mirostat"), ({"temperature": "hot"}, "options.temperature"),
                       ({"top_k": 1.5}, "options.top_k"), ({"num_predict": 2.5}, "options.num_predict"),
                       ({"stop": [1]}, "options.stop"), ({"seed": True}, "options.seed")):
        with pytest.raises(SamplingParamsError) as e:
            sampling_fields(bad)
        assert e.value.param == param


def test_format_maps_to_structured_outputs():
    assert structured_fields(None) == structured_fields("") == {}
    assert structured_fields("json") == {"structured_outputs": {"json_object": True}}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert structured_fields(schema) == {"structured_outputs": {"json": schema}}
    with pytest.raises(SamplingParamsError) as e:
        structured_fields("yaml")
    assert e.value.param == "format"


def test_messages_map_to_common_messages():
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    out = openai_message(OllamaMessage(role="assistant", content="", tool_calls=[call]), 1)
    assert out["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    tool = openai_message(OllamaMessage(role="tool", content="Sunny", tool_name="get_weather"), 2)
    assert tool["name"] == "get_weather" and tool["tool_call_id"]
    for bad in (OllamaMessage(role="user", content="x", images=["AA=="]), OllamaMessage(role="robot")):
        with pytest.raises(SamplingParamsError):
            openai_message(bad, 0)


def _chunk(delta: DeltaMessage, finish=None) -> ChatCompletionStreamResponse:
    return ChatCompletionStreamResponse(id="c", created=0, model="m", choices=[
        ChatCompletionResponseStreamChoice(index=0, delta=delta, finish_reason=finish)])


async def _gen(items, fail: bool = False):
    for item in items:
        yield item
    if fail:
        raise ValueError("the engine said no")


async def _lines(items, fail: bool = False) -> list[dict]:
    return [json.loads(line) async for line in OllamaWire("m", chat=True).lines(_gen(items, fail), RunStats())]


async def test_stream_lines_with_tool_call_fragments():
    frags = [DeltaToolCall(index=0, id="call_1", type="function", function=DeltaFunctionCall(name="get_weather")),
             DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"city": ')),
             DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='"Paris"}'))]
    items = [_chunk(DeltaMessage(role="assistant", content="")), _chunk(DeltaMessage(content="Let me see.")),
             *[_chunk(DeltaMessage(tool_calls=[f])) for f in frags], _chunk(DeltaMessage(), "tool_calls"),
             ChatCompletionStreamResponse(id="c", created=0, model="m", choices=[],
                                          usage=UsageInfo(prompt_tokens=7, completion_tokens=9, total_tokens=16))]
    lines = await _lines(items)
    assert [ln["done"] for ln in lines] == [False, False, True]
    assert lines[0]["message"] == {"role": "assistant", "content": "Let me see."}
    assert lines[1]["message"]["tool_calls"] == [
        {"id": "call_1", "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}]
    last = lines[-1]
    assert last["done_reason"] == "stop" and last["prompt_eval_count"] == 7 and last["eval_count"] == 9
    assert last["total_duration"] >= last["prompt_eval_duration"] >= 0 and last["load_duration"] == 0


async def test_error_after_start_is_an_ndjson_error_line():
    lines = await _lines([_chunk(DeltaMessage(content="Hi"))], fail=True)
    assert lines[0]["message"]["content"] == "Hi"
    assert lines[-1] == {"error": "the engine said no"}


async def test_cut_off_tool_call_is_an_error_not_text():
    items = [_chunk(DeltaMessage(tool_calls=[DeltaToolCall(index=0, id="c", function=DeltaFunctionCall(
        name="f", arguments='{"city": "Par'))])), _chunk(DeltaMessage(), "length")]
    with pytest.raises(ValueError, match="cut off"):
        await OllamaWire("m", chat=True).whole(_gen(items), RunStats())
    assert "cut off" in (await _lines(items))[-1]["error"]



async def test_logprobs_lines_in_ollamas_shape():
    """A chat chunk's logprobs and a completion chunk's parallel lists both become Ollama's
    api.Logprob entries on the line of their tokens, with at most ``top_logprobs``
    alternatives (the completion map also holds the sampled token: cut), none at 0."""
    alt = [ChatCompletionLogProb(token="Hi", logprob=-0.1, bytes=[72, 105]),
           ChatCompletionLogProb(token="Yo", logprob=-2.0)]
    chat = _chunk(DeltaMessage(content="Hi"))
    chat.choices[0].logprobs = ChatCompletionLogProbs(content=[ChatCompletionLogProbsContent(
        token="Hi", logprob=-0.1, bytes=[72, 105], top_logprobs=alt)])
    lines = [json.loads(ln) async for ln in OllamaWire("m", chat=True, top_logprobs=1).lines(_gen([chat]), RunStats())]
    assert lines[0]["logprobs"] == [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                                     "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}]}]
    assert "logprobs" not in lines[-1]
    raw = CompletionStreamResponse(id="c", created=0, model="m", choices=[CompletionResponseStreamChoice(
        index=0, text="é", logprobs=CompletionLogProbs(tokens=["é"], token_logprobs=[-1.5], text_offset=[0],
                                                       top_logprobs=[{"a": -0.5, "é": -1.5}]))])
    for top, alts in ((0, None), (1, [{"token": "a", "logprob": -0.5, "bytes": [97]}])):
        whole = await OllamaWire("m", chat=False, top_logprobs=top).whole(_gen([raw]), RunStats())
        assert whole["logprobs"] == [{"token": "é", "logprob": -1.5, "bytes": [195, 169],
                                      **({"top_logprobs": alts} if alts else {})}], top


def test_keep_alive_strings_must_be_durations():
    """Trial of stop 43: ``keep_alive: "forever"`` was a silent 200 where Ollama answers
    400 (time.ParseDuration). Durations, numbers and numeric strings pass on every
    request type; anything else names the field."""
    import pydantic
    from llmserve.entrypoints.ollama.protocol import OllamaChatRequest, OllamaEmbedRequest, OllamaGenerateRequest
    for ok in ("5m", "1h30m", "-1s", "0", "1.5h", "300ms", "-1", 5, -1, None):
        assert OllamaChatRequest(model="m", messages=[], keep_alive=ok).keep_alive == ok
    for cls, extra in ((OllamaChatRequest, {"messages": []}), (OllamaGenerateRequest, {"prompt": "hi"}),
                       (OllamaEmbedRequest, {"input": "hi"})):
        for bad in ("forever", "", "5 m", "10x"):
            with pytest.raises(pydantic.ValidationError, match="keep_alive"):
                cls(model="m", keep_alive=bad, **extra)


def test_tags_and_ps_list_the_lora_adapters_that_chat_serves(tmp_path):
    # /api/chat and /api/generate serve an adapter by name, but /api/tags listed only the
    # base model, so an Ollama client (which offers what /api/tags lists) never saw it.
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"x" * 10)
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"y" * 3)
    adapters = LoRAAdapters(engine_client=None, base_names=["m"])
    adapters.lora_requests["sql"] = LoRARequest("sql", 1, str(adapter))
    adapters.parents["sql"] = "m"
    config = SimpleNamespace(model=str(base), model_path=str(base), gguf_file=None, quantization=None, dtype="bfloat16",
                             hf_config=SimpleNamespace(model_type="llama"), max_model_len=64)
    state = SimpleNamespace(engine_client=SimpleNamespace(model_config=config),
                            openai_serving_models=OpenAIServingModels([BaseModelPath("m", str(base))], 64,
                                                                      lora=[adapters]))
    tags = info.tags(state)["models"]
    assert [(t["name"], t["size"], t["details"]["parent_model"]) for t in tags] == \
        [("m:latest", 10, ""), ("sql:latest", 3, "m")]
    assert tags[0]["digest"] != tags[1]["digest"]
    assert [m["name"] for m in info.ps(state)["models"]] == ["m:latest", "sql:latest"]
    # /api/show of the adapter says so as Ollama does (ADAPTER after FROM, its base as
    # parent_model); it showed the base model's Modelfile and details
    state.engine_client.tokenizer = SimpleNamespace(chat_template=None, get_vocab=dict)
    state.openai_serving_chat = SimpleNamespace(default_sampling_params={})
    state.openai_serving_render = SimpleNamespace(renderer=None)
    shown = {n: info.show(state, n) for n in ("m", "sql")}
    assert f"\nADAPTER {adapter}\n" in shown["sql"]["modelfile"] and "ADAPTER" not in shown["m"]["modelfile"]
    assert (shown["sql"]["details"]["parent_model"], shown["m"]["details"]["parent_model"]) == ("m", "")


def _roles(messages):
    return [m.role for m in messages]


def test_context_fit_drops_whole_turns_and_keeps_the_template_valid():
    """Ollama's truncation of an over-long chat drops whole messages from the front: system
    messages and the last message stay, a dropped call takes its tool results with it,
    and what is kept starts with a user turn (never an assistant or a tool result)."""
    from llmserve.entrypoints.ollama.context_fit import _drop_oldest

    m = [SimpleNamespace(role=r) for r in ("system", "user", "assistant", "tool", "tool", "user", "assistant", "user")]
    once = _drop_oldest(m)
    assert _roles(once) == ["system", "user", "assistant", "user"]
    assert once[1] is m[5] and once[-1] is m[-1]
    assert _roles(_drop_oldest(once)) == ["system", "user"] and _drop_oldest(once)[-1] is m[-1]
    assert _drop_oldest([m[0], m[-1]]) is None and _drop_oldest([m[-1]]) is None
    # a tool round trip keeps its question, call and result: nothing before them to drop
    trip = [SimpleNamespace(role=r) for r in ("system", "user", "assistant", "tool")]
    assert _drop_oldest(trip) is None
    older = [SimpleNamespace(role=r) for r in ("user", "assistant")] + trip[1:]
    assert _drop_oldest(older) == trip[1:]


def test_context_fit_of_a_raw_prompt_keeps_half_the_context():
    from llmserve.entrypoints.ollama.context_fit import fit_completion, truncating
    from llmserve.entrypoints.ollama.protocol import OllamaGenerateRequest
    from llmserve.entrypoints.openai.completion.protocol import CompletionRequest

    req = CompletionRequest(model="m", prompt="x", max_tokens=None)
    assert fit_completion(req, 511, 512) is req
    cut = fit_completion(req, 900, 512)
    assert (cut.truncate_prompt_tokens, cut.max_tokens) == (256, 256)
    cut = fit_completion(CompletionRequest(model="m", prompt="x", max_tokens=20), 900, 512)
    assert (cut.truncate_prompt_tokens, cut.max_tokens) == (256, 20)
    cut = fit_completion(req, 100, 64)  # options.num_ctx 64: half of that context
    assert (cut.truncate_prompt_tokens, cut.max_tokens) == (32, 32)
    assert truncating(OllamaGenerateRequest(model="m")) and truncating(OllamaGenerateRequest(model="m", truncate=True))
    assert not truncating(OllamaGenerateRequest(model="m", truncate=False))


def test_num_ctx_is_the_request_context_within_the_servers():
    """``options.num_ctx``: the request's context, as Ollama: below 4 raised to 4 (its
    scheduler), above the server's context the server's (its cap at the trained context);
    absent, the server's; not an integer, a 400 naming it."""
    from llmserve.entrypoints.ollama.options import context_size

    assert context_size(None, 512) == 512 and context_size({"num_ctx": None}, 512) == 512
    assert context_size({"num_ctx": 64}, 512) == 64 and context_size({"num_ctx": 64.0}, 512) == 64
    assert context_size({"num_ctx": 0}, 512) == 4 and context_size({"num_ctx": -9}, 512) == 4
    assert context_size({"num_ctx": 10 ** 30}, 512) == 512
    for bad in ("big", 64.5, True, float("inf")):
        with pytest.raises(SamplingParamsError) as e:
            context_size({"num_ctx": bad}, 512)
        assert e.value.param == "options.num_ctx"
    with pytest.raises(SamplingParamsError) as e:
        sampling_fields({"num_ctx": "big"})
    assert e.value.param == "options.num_ctx"


def test_ollama_names_match_without_case_and_with_latest_as_the_default_tag():
    """Ollama's rule (names.py): case does not matter, ``name`` is ``name:latest`` both
    ways, another tag is another model, a ``:`` before the last ``/`` is a port, and the
    exact name wins; an unknown one is Ollama's 404 message for the route."""
    from llmserve.entrypoints.ollama.names import OllamaModelNotFound, match_name, resolve
    from llmserve.entrypoints.openai.common.errors import error_response_from_exception

    served = ["SmolLM2", "llama3:latest", "host:5000/team/m", "Qwen/Qwen2.5-0.5B-Instruct"]
    assert match_name("smollm2", served) == "SmolLM2" and match_name("SMOLLM2:latest", served) == "SmolLM2"
    assert match_name("llama3", served) == "llama3:latest" and match_name("Llama3:LATEST", served) == "llama3:latest"
    assert match_name("qwen/qwen2.5-0.5b-instruct:latest", served) == "Qwen/Qwen2.5-0.5B-Instruct"
    assert match_name("host:5000/team/m:latest", served) == "host:5000/team/m"
    assert match_name("smollm2:1b", served) is None and match_name("llama3:8b", served) is None
    assert match_name("smollm2", ["SMOLLM2", "smollm2"]) == "smollm2"  # the exact name first
    with pytest.raises(OllamaModelNotFound) as e:
        resolve("x", served)
    assert error_response_from_exception(e.value)[0] == 404 and str(e.value) == "model 'x' not found"
    assert str(OllamaModelNotFound("x", pull_hint=True)) == 'model "x" not found, try pulling it first'
    assert len(str(OllamaModelNotFound("y" * 100_000))) < 300


def test_details_name_the_file_type_and_parameter_count_as_ollama_does(tmp_path):
    # /api/show said quantization_level "gguf" and parameter_size "" for the packaged
    # Q4_1 file; Ollama says "Q4_1" and "134.52M" (format.HumanNumber) for it
    import torch
    from safetensors.torch import save_file

    from llmserve.entrypoints.ollama.weight_facts import human_number
    from llmserve.model_loader.resolve import resolve_model

    assert [human_number(n) for n in (999, 12_345, 135_000_000, 134_515_008, 1_240_000_000, 2_000_000_000)] == \
        ["999", "12K", "135M", "134.52M", "1.2B", "2B"]
    hf = SimpleNamespace(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=1000, tie_word_embeddings=True)
    smol = resolve_model("SmolLM2-135M-Instruct")
    gguf = SimpleNamespace(model_path=smol.path, gguf_file=smol.gguf_file, quantization=None, dtype="float32",
                           hf_config=hf)
    assert {k: info.details(gguf)[k] for k in ("format", "parameter_size", "quantization_level")} == \
        {"format": "gguf", "parameter_size": "134.52M", "quantization_level": "Q4_1"}
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"a": torch.zeros(1000, 1500, dtype=torch.bfloat16), "n": torch.zeros(10)}, str(folder / "m.safetensors"))
    config = SimpleNamespace(model_path=str(folder), gguf_file=None, quantization=None, dtype="float32", hf_config=hf,
                             max_model_len=64)
    assert (info.details(config)["quantization_level"], info.details(config)["parameter_size"]) == ("BF16", "1.50M")
    state = SimpleNamespace(engine_client=SimpleNamespace(model_config=config),
                            openai_serving_models=OpenAIServingModels([BaseModelPath("m", str(folder))], 64))
    assert info.tags(state)["models"][0]["details"] == info.ps(state)["models"][0]["details"] == info.details(config)
    bare = tmp_path / "bin"  # a .bin checkpoint: both from the config, never empty
    bare.mkdir()
    (bare / "pytorch_model.bin").write_bytes(b"x")
    fallback = info.details(SimpleNamespace(model_path=str(bare), gguf_file=None, quantization=None,
                                            dtype="bfloat16", hf_config=hf))
    # 1000*64 embeddings + 2 layers * (64*16*(8+4) attention + 3*64*128 MLP) = 137,728
    assert (fallback["quantization_level"], fallback["parameter_size"]) == ("BF16", "138K")


@pytest.mark.parametrize("route,body", [
    ("/api/chat", '{"model":"m","messages":[{"role":"user","content":"\\ud800x"}],"stream":false}'),
    ("/api/generate", '{"model":"m","prompt":"a\\udc00\\ud800\\ud83d\\ude00b","system":"\\ud800","stream":false}'),
])
def test_ollama_reads_lone_surrogate_escapes_as_go_does(app_and_engine, route, body):  # noqa: F811
    # valid JSON (RFC 8259 allows any \uXXXX escape) that pydantic's parser refused as
    # "unexpected end of hex escape": Ollama (Go's encoding/json) reads each lone
    # surrogate as U+FFFD and keeps a valid pair (here U+1F600)
    client, engine = app_and_engine()
    engine.outputs = [_output("ok", "stop")]
    r = client.post(route, content=body.encode())
    assert r.status_code == 200, r.text
    prompt = str(engine.prompts[-1])
    assert ("\ufffdx" in prompt) if route == "/api/chat" else ("a\ufffd\ufffd\U0001F600b" in prompt), prompt
    assert not re.search("[\ud800-\udfff]", prompt)
    for bad in ('{"model":"m","prompt":"\\ud800', '{"model":"m","prompt":"\\ud800",}', '{"model":"m",,}'):
        r = client.post("/api/generate", content=bad.encode())  # still invalid JSON: the same 400
        assert r.status_code == 400 and r.json()["error"].startswith("Invalid JSON in the request body: "), r.text


def test_ollama_type_errors_name_the_field_in_gos_words(app_and_engine):  # noqa: F811
    """Last review: ``/api/show {"model": 5}`` was told "must be an object", naming no
    field (``model`` read as a pydantic label), and ``context: [true]`` reached the
    handler as token 1. Ollama answers Go's encoding/json error: the JSON kind, the
    innermost Go struct, the field's path without indexes and the Go type; a field Go
    decodes itself (keep_alive) keeps its own message, which names it."""
    client, engine = app_and_engine()
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    cases = [  # (route, body, error)
        ("/api/show", {"model": 5},
         "json: cannot unmarshal number into Go struct field ShowRequest.model of type string"),
        ("/api/show", [1], "json: cannot unmarshal array into Go value of type api.ShowRequest"),
        ("/api/show", {"model": "m", "verbose": "yes"},
         "json: cannot unmarshal string into Go struct field ShowRequest.verbose of type bool"),
        ("/api/generate", {"model": "m", "prompt": "hi", "context": [1, True]},
         "json: cannot unmarshal bool into Go struct field GenerateRequest.context of type int"),
        ("/api/generate", {"model": "m", "prompt": "hi", "top_logprobs": 1.5},
         "json: cannot unmarshal number 1.5 into Go struct field GenerateRequest.top_logprobs of type int"),
        ("/api/chat", {**chat, "messages": 5},
         "json: cannot unmarshal number into Go struct field ChatRequest.messages of type []api.Message"),
        ("/api/chat", {**chat, "messages": [{"role": 5, "content": "x"}]},
         "json: cannot unmarshal number into Go struct field Message.messages.role of type string"),
        # Go reports the first error in the body's order
        ("/api/chat", {"stream": "no", "model": 7, "messages": []},
         "json: cannot unmarshal string into Go struct field ChatRequest.stream of type bool"),
        ("/api/embed", {"model": "m", "input": "x", "dimensions": True},
         "json: cannot unmarshal bool into Go struct field EmbedRequest.dimensions of type int"),
        ("/api/embeddings", {"model": "m", "prompt": 5},
         "json: cannot unmarshal number into Go struct field EmbeddingRequest.prompt of type string"),
        # a history tool call's arguments are an object (Go's map): Ollama parses no JSON string
        ("/api/chat", {**chat, "messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": '{"city": "Paris"}'}}]}]},
         "json: cannot unmarshal string into Go struct field ToolCallFunction.messages.tool_calls.function.arguments "
         "of type api.ToolCallFunctionArguments"),
        ("/api/chat", {**chat, "messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": ["Paris"]}}]}]},
         "json: cannot unmarshal array into Go struct field ToolCallFunction.messages.tool_calls.function.arguments "
         "of type api.ToolCallFunctionArguments"),
        ("/api/chat", {**chat, "messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": "f"}]}]},
         "json: cannot unmarshal string into Go struct field ToolCall.messages.tool_calls.function "
         "of type api.ToolCallFunction"),
        # options were not type-checked on the embedding routes (200), as they are on chat and generate
        ("/api/embed", {"model": "m", "input": "x", "options": {"num_ctx": "5"}},
         "options.num_ctx must be a number, got str."),
        ("/api/embeddings", {"model": "m", "prompt": "x", "options": {"temperature": True}},
         "options.temperature must be a number, got bool."),
        ("/api/embed", {"model": "m", "input": "x", "options": {"stop": 5}}, "options.stop must be a list of strings."),
        ("/api/chat", {**chat, "keep_alive": "forever"},
         'keep_alive: time: invalid duration (a Go duration such as "5m", "1h30m" or "-1s", or a number of seconds)'),
        # options ignored here still have Ollama's JSON types (its Options.FromMap refuses
        # others); they were a silent 200 with any value
        ("/api/chat", {**chat, "options": {"use_mmap": "yes"}}, "options.use_mmap must be a boolean, got str."),
        ("/api/generate", {"model": "m", "prompt": "hi", "options": {"num_thread": "4"}},
         "options.num_thread must be a number, got str."),
        ("/api/embed", {"model": "m", "input": "x", "options": {"low_vram": 1}},
         "options.low_vram must be a boolean, got int."),
        ("/api/embeddings", {"model": "m", "prompt": "x", "options": {"num_gpu": None, "num_keep": [1]}},
         "options.num_keep must be a number, got list."),
    ]
    for route, body, error in cases:
        r = client.post(route, json=body)
        assert r.status_code == 400 and r.json() == {"error": error}, (route, body, r.text)
    # the client's value is not echoed back (role, think, format, keep_alive, context)
    secret = "s3cr3t-value"
    for route, body, param in (
            ("/api/chat", {**chat, "messages": [{"role": secret, "content": "x"}]}, "messages"),
            ("/api/chat", {**chat, "think": secret}, "think"),
            ("/api/chat", {**chat, "format": secret}, "format"),
            ("/api/chat", {**chat, "keep_alive": secret}, "keep_alive"),
            ("/api/generate", {"model": "m", "prompt": "x", "stream": False, "context": [987654321]}, "context")):
        r = client.post(route, json=body)
        assert r.status_code == 400 and param in r.json()["error"], (route, r.text)
        assert secret not in r.text and "987654321" not in r.text, r.text
    ok = client.post("/api/chat", json={**chat, "options": {"use_mmap": True, "num_thread": 2, "mirostat_eta": 0.1,
                                                            "numa": False, "num_gpu": None}})
    assert ok.status_code == 200, ok.text
    assert len(engine.prompts) == 1  # only the last request ran


@pytest.mark.parametrize("file_arch,model_type", [("gemma3", "gemma3_text"), ("llama", "mixtral")])
def test_a_gguf_models_family_is_the_files_architecture(tmp_path, file_arch, model_type):
    # /api/show of a Gemma 3 GGUF said family and general.architecture "gemma3_text" (and
    # keys "gemma3_text.context_length"), of a Mixtral GGUF "mixtral": Ollama reads the
    # file's general.architecture ("gemma3", "llama")
    import gguf
    import numpy as np

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), file_arch)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf = SimpleNamespace(model_type=model_type, hidden_size=4, num_hidden_layers=1)
    config = SimpleNamespace(model_path=str(path), gguf_file=str(path), quantization=None, dtype="float32",
                             hf_config=hf, max_model_len=64, model=str(path))
    assert (info.details(config)["family"], info.details(config)["families"]) == (file_arch, [file_arch])
    shown = info.model_info(config)
    assert shown["general.architecture"] == file_arch
    assert (shown[f"{file_arch}.context_length"], shown[f"{file_arch}.embedding_length"]) == (64, 4)
    folder = SimpleNamespace(**{**vars(config), "gguf_file": None, "model_path": str(tmp_path)})
    assert info.details(folder)["family"] == model_type  # a safetensors folder keeps its model_type


def test_ollama_reads_null_as_gos_zero_value(app_and_engine):  # noqa: F811
    """Go's encoding/json leaves a field alone on ``null`` (its zero value): Ollama takes
    ``"messages": null`` as no messages (/api/chat loads the model: done_reason "load"),
    ``"input": null`` as no input, a null option or field as unset. Each was a 400 here
    ("messages: must be a valid array"). An empty body is Ollama's "missing request body"."""
    client, engine = app_and_engine()
    ask = [{"role": "user", "content": "hi"}]
    for route, body in (("/api/chat", {"model": "m", "messages": None, "stream": None}),
                        ("/api/generate", {"model": "m", "prompt": None, "system": None, "suffix": None,
                                           "context": None, "raw": None, "images": None})):
        r = client.post(route, json=body)
        assert r.status_code == 200 and r.json()["done_reason"] == "load", r.text
    assert client.post("/api/embeddings", json={"model": "m", "prompt": None}).json() == {"embedding": []}
    engine.outputs = [_output("ok", "stop")]
    nulls = {"model": "m", "stream": False, "format": None, "keep_alive": None, "think": None, "tools": None,
             "options": {"temperature": None, "stop": None}, "truncate": None, "top_logprobs": None,
             "messages": [{"role": "user", "content": "hi", "images": None, "tool_calls": None, "thinking": None},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": None, "function": {"index": None, "name": "f", "arguments": None}}]},
                          {"role": "tool", "content": "1", "tool_name": None, "tool_call_id": None}]}
    r = client.post("/api/chat", json=nulls)
    assert r.status_code == 200 and r.json()["message"]["content"] == "ok", r.text
    assert not engine.params[-1].stop
    for no_input in (None, ""):  # no input: Ollama answers no embeddings (it embedded "" here)
        r = client.post("/api/embed", json={"model": "m", "input": no_input})
        assert r.status_code == 200 and r.json() == {"model": "m", "embeddings": []}, r.text
    r = client.post("/api/chat", json={"model": "m", "messages": [None]})  # a zero Message: no role
    assert r.status_code == 400 and "role" in r.json()["error"], r.text
    for empty in (b"", b"  \n"):
        r = client.post("/api/chat", content=empty)
        assert r.status_code == 400 and r.json() == {"error": "missing request body"}, r.text
    assert len(engine.prompts) == 1


def test_ollama_errors_name_options_and_non_utf8_bytes(app_and_engine):  # noqa: F811
    """A check made past the mapping (the sampling parameters') named the common field:
    ``options.stop: [""]`` said "stop cannot contain an empty string", ``temperature: -1``
    "temperature must be...": each now names ``options.<key>`` (num_predict for
    max_tokens). A body not UTF-8 outside any string (Go refuses it too; inside a string
    it is read as U+FFFD) said "Invalid JSON ... line 1 column 1"; now the byte."""
    client, engine = app_and_engine()
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    for route, body, said in (
            ("/api/chat", {**chat, "options": {"stop": [""]}}, "options.stop cannot contain an empty string."),
            ("/api/chat", {**chat, "stream": True, "options": {"temperature": -1}}, "options.temperature must be"),
            ("/api/generate", {"model": "m", "prompt": "hi", "options": {"top_p": 5}}, "options.top_p must be"),
            ("/api/generate", {"model": "m", "prompt": "hi", "raw": True, "options": {"top_p": 5}},
             "options.top_p must be")):
        r = client.post(route, json=body)
        assert r.status_code == 400 and r.json()["error"].startswith(said), (body, r.text)
    r = client.post("/api/chat", content=b'\xff{"model":"m"}')
    assert r.status_code == 400 and r.json()["error"].startswith(
        "Invalid JSON in the request body: byte 0xff at offset 0 is not UTF-8 and stands outside a string"), r.text
    engine.outputs = [_output("ok", "stop")]
    r = client.post("/api/chat", content=json.dumps(chat).replace("hi", "hi \\u00ff").encode().replace(
        b"\\u00ff", b"\xff"))
    assert r.status_code == 200 and "hi \ufffd" in str(engine.prompts[-1]), r.text


def test_an_empty_suffix_is_no_suffix_as_in_ollama(app_and_engine):  # noqa: F811
    """Ollama's ``suffix`` is a Go string: ``""`` is unset, so the template applies (and an
    empty prompt is the load answer). It ran the prompt raw, without the chat template
    (a 7-token prompt instead of 37 on SmolLM2), and ``prompt: "", suffix: ""`` was a 400."""
    client, engine = app_and_engine()
    engine.outputs = [_output("ok", "stop")]
    for suffix in (None, ""):
        body = {"model": "m", "prompt": "hi", "stream": False, **({} if suffix is None else {"suffix": suffix})}
        assert client.post("/api/generate", json=body).status_code == 200
    assert engine.prompts[-1] == engine.prompts[-2] and engine.prompts[-1] != "hi", engine.prompts[-2:]
    r = client.post("/api/generate", json={"model": "m", "prompt": "", "suffix": "", "stream": False})
    assert r.status_code == 200 and r.json()["done_reason"] == "load", r.text


def test_model_management_routes_answer_as_ollama_for_served_and_unknown_models(app_and_engine):  # noqa: F811
    """Agent-door trial: /api/pull, /api/push, /api/delete and /api/copy answered 501 for
    every body, so ``ollama.pull(model)`` before a chat (common in scripts and apps) failed
    on a model the server serves, and an unknown model was a 5xx where Ollama answers 404.
    Now a pull of a served model succeeds (streamed or not, through the real ``ollama``
    client), an unknown model is Ollama's 404 on each route, a missing name its 400, and
    push/delete/copy of a served model stay 501 (nothing can change here)."""
    import httpx
    import ollama
    client, engine = app_and_engine()

    def via_app(request: httpx.Request) -> httpx.Response:  # the ollama client's httpx over the in-process app
        r = client.request(request.method, request.url.path, content=request.read(), headers=dict(request.headers))
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)
    oc = ollama.Client(host="http://server", transport=httpx.MockTransport(via_app))
    assert oc.pull("m").status == "success" and oc.pull("M:latest", stream=False).status == "success"
    assert [p.status for p in oc.pull("m", stream=True)] == ["pulling manifest", "success"]
    with pytest.raises(ollama.ResponseError) as e:
        oc.pull("llama3")
    assert e.value.status_code == 404 and e.value.error.startswith("model 'llama3' not found; llmserve downloads no")
    for call, status, error in (
            (lambda: oc.delete("nope"), 404, "model 'nope' not found"),
            (lambda: oc.copy("nope", "x"), 404, 'model "nope" not found'),
            (lambda: oc.push("nope"), 404, "model 'nope' not found"),
            (lambda: oc.delete("m"), 501, "/api/delete is not available"),
            (lambda: oc.copy("m", "x"), 501, "/api/copy is not available"),
            (lambda: oc.push("m"), 501, "/api/push is not available"),
            (lambda: oc.create("x", from_="m"), 501, "/api/create is not available")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert (e.value.status_code, e.value.error[:len(error)]) == (status, error)
    for method, route, body, error in (
            ("POST", "/api/pull", {}, "model is required"),
            ("POST", "/api/pull", {"name": "m", "stream": False}, None),  # older clients' field
            ("POST", "/api/pull", {"model": 5}, "json: cannot unmarshal number into Go struct field PullRequest.model "
                                                "of type string"),
            ("POST", "/api/copy", {"source": "m"}, 'destination "" is invalid'),
            ("POST", "/api/copy", {"destination": "x"}, 'source "" is invalid'),
            ("DELETE", "/api/delete", None, "missing request body")):
        r = client.request(method, route, json=body)
        want = (200, {"status": "success"}) if error is None else (400, {"error": error})
        assert (r.status_code, r.json()) == want, (route, body, r.text)
    # the Go client's `ollama create` asks HEAD /api/blobs/<digest> first: 404 (no blob
    # here) lets it go on to the upload's 501; it was a 405
    assert client.head(f"/api/blobs/sha256:{'a' * 64}").status_code == 404
    assert engine.prompts == []


def test_a_final_assistant_message_is_continued_as_ollama_continues_it(app_and_engine):  # noqa: F811
    """Fresh-user trial: /api/chat closed a final assistant message and opened a new turn,
    so the answer repeated it. Ollama's templates leave the last assistant message open and
    the model continues it: the prompt ends with the text unclosed (one assistant header),
    the reply (whole or streamed) is the continuation only; with tools and no parser the
    continuation is text (tool choice "none", not a forced call). An empty final assistant
    message opens the turn; /api/generate is unaffected."""
    client, engine = app_and_engine()
    ask = {"role": "user", "content": "Capital of France?"}
    messages = [ask, {"role": "assistant", "content": "The capital of France is"}]
    for stream in (False, True):
        engine.outputs = [_output(" Paris.", "stop")]
        r = client.post("/api/chat", json={"model": "m", "stream": stream, "messages": messages})
        lines = [json.loads(line) for line in r.text.splitlines() if line.strip()]
        assert r.status_code == 200 and "".join(x["message"]["content"] for x in lines) == " Paris.", r.text
        prompt = engine.prompts[-1]["prompt"]
        assert prompt.endswith("Capital of France?<|im_end|>\n<|im_start|>assistant\nThe capital of France is"), prompt
        assert prompt.count("<|im_start|>assistant") == 1
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = client.post("/api/chat", json={"model": "m", "stream": False, "messages": messages, "tools": tools})
    assert r.status_code == 200 and r.headers["X-Llmserve-Tool-Choice"] == "none", r.text
    client.post("/api/chat", json={"model": "m", "stream": False,
                                   "messages": [ask, {"role": "assistant", "content": ""}]})
    assert engine.prompts[-1]["prompt"].endswith("Capital of France?<|im_end|>\n<|im_start|>assistant\n")
    client.post("/api/generate", json={"model": "m", "stream": False, "prompt": "The capital of France is"})
    assert engine.prompts[-1]["prompt"].endswith("The capital of France is<|im_end|>\n<|im_start|>assistant\n")


def test_a_developer_message_is_a_system_message_on_api_chat(app_and_engine):  # noqa: F811
    """Fresh-user trial: /api/chat refused role ``developer`` (400 "must be one of ['system',
    'user', 'assistant', 'tool']") while every other chat route takes it; the renderer makes
    it a system message for a template that does not name it (SmolLM2's)."""
    client, engine = app_and_engine()
    engine.outputs = [_output("ok", "stop")]
    r = client.post("/api/chat", json={"model": "m", "stream": False, "messages": [
        {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert engine.prompts[-1]["prompt"].startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n")
    r = client.post("/api/chat", json={"model": "m", "stream": False, "messages": [{"role": "bogus", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"], r.text


def _weights_at(engine, path) -> None:
    """Give the stub engine's model config what /api/tags reads (a weights folder)."""
    engine.model_config.__dict__.update(model_path=str(path), gguf_file=None, quantization=None, dtype="bfloat16",
                                        hf_config=SimpleNamespace(model_type="llama"))


def test_tags_list_name_latest_and_every_route_serves_that_name(app_and_engine, tmp_path):  # noqa: F811
    """/api/tags lists a name served without a tag as Ollama lists it, ``name:latest``
    (langchain-ollama's ``validate_model_on_init`` looks for ``NAME:latest`` there and
    failed on the bare name: the client itself in test_ollama_client_faults.py), and every route takes that listed name for the served one:
    VS Code Copilot Chat reads the name from /api/tags and sends it to
    /v1/chat/completions (a 404 once /api/tags listed tags). /v1/models keeps the served
    names; another tag or case stays another model on the OpenAI routes."""
    client, engine = app_and_engine()
    _weights_at(engine, tmp_path)
    listed = [m["name"] for m in client.get("/api/tags").json()["models"]]
    assert listed == ["m:latest"] and [m["model"] for m in client.get("/api/ps").json()["models"]] == listed
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["m"]
    assert client.get("/v1/models/m:latest").json()["id"] == "m"
    ask = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/chat/completions", {"messages": ask}), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/messages", {"messages": ask}), ("/v1/responses", {"input": "hi"}),
                       ("/api/chat", {"messages": ask, "stream": False})):
        engine.outputs = [_output("ok", "stop")]
        r = client.post(path, json={"model": listed[0], "max_tokens": 3, **body})
        assert r.status_code == 200, (path, r.text)
        assert r.json()["model"] == ("m" if path.startswith("/v1/c") or path == "/v1/responses" else listed[0])
    for name in ("m:1b", "M:latest", "m:latest:latest"):
        r = client.post("/v1/chat/completions", json={"model": name, "messages": ask, "max_tokens": 3})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", (name, r.text)


def test_latest_match_is_the_default_tag_rule_of_every_route():
    """served_names.latest_match: ``m:latest`` calls ``m`` and ``m`` calls ``m:latest``,
    the exact name first; another tag, another case, a port (``host:5000/m``) or a doubled
    tag is no match."""
    from llmserve.served_names import latest_match, ollama_listed_name
    served = ["m", "llama3:latest", "host:5000/team/x", "both", "both:latest"]
    assert latest_match("m:latest", served) == "m" and latest_match("llama3", served) == "llama3:latest"
    assert latest_match("host:5000/team/x:latest", served) == "host:5000/team/x"
    assert latest_match("both", served) == "both" and latest_match("both:latest", served) == "both:latest"
    for name in ("m:1b", "M", "M:latest", "m:latest:latest", "host:5000/team/x:5000", "", None):
        assert latest_match(name, served) is None, name
    assert [ollama_listed_name(n) for n in ("m", "llama3:8b", "host:5000/x")] == \
        ["m:latest", "llama3:8b", "host:5000/x:latest"]


def test_generate_template_is_rendered_as_ollama_renders_it(app_and_engine):  # noqa: F811
    """/api/generate ``template`` (the ollama client's ``generate(template=...)``) was a 400
    "not served here"; Ollama renders the request's Go template over .System, .Prompt,
    .Messages..., keeps what comes before {{ .Response }} and runs that text, returning a
    context. Unsupported Go template parts are a 400 naming ``template`` (no echo)."""
    from llmserve.entrypoints.ollama.go_template import TemplateError, render_prompt
    chatml = ("{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}{{ if .Prompt }}<|im_start|>user\n"
              "{{ .Prompt }}<|im_end|>\n{{ end }}<|im_start|>assistant\n{{ .Response }}<|im_end|>\n")
    assert render_prompt(chatml, None, "hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ranged = "{{- range .Messages }}[{{ .Role }}] {{ .Content }}\n{{ end }}{{ if eq $.Suffix \"\" }}A:{{ end -}}  "
    assert render_prompt(ranged, "be brief", "hi") == "[system] be brief\n[user] hi\nA:"
    branches = '{{ if not .System }}none{{ else if and .System .Prompt }}both{{ else }}sys{{ end }} {{/* c */}}'
    assert [render_prompt(branches, s, p) for s, p in ((None, "p"), ("s", "p"), ("s", ""))] == \
        ["none ", "both ", "sys "]
    for bad in ("{{ .Prompt", "{{ if .System }}x", "{{ end }}", "{{ $x := 1 }}", '{{ printf "%s" .Prompt }}',
                "{{ .Prompt | upper }}", "{{ not " + "(" * 5000 + ".Prompt" + ")" * 5000 + " }}",
                "{{ if .Prompt }}" * 100 + "{{ end }}" * 100,  # nesting, steps and output are bounded:
                "{{ range $.Messages }}" * 60 + "{{ end }}" * 60,  # 2**60 loops writing nothing
                "{{ range $.Messages }}" * 30 + "{{ $.Prompt }}" + "{{ end }}" * 30):
        with pytest.raises(TemplateError):
            render_prompt(bad, "s", "p" * 100_000)  # two messages to range over
    client, engine = app_and_engine()
    engine.outputs = [_output("ok", "stop")]
    r = client.post("/api/generate", json={"model": "m", "prompt": "hi", "system": "S", "stream": False,
                                           "template": chatml, "options": {"num_predict": 2}})
    assert r.status_code == 200 and r.json()["response"] == "ok" and r.json()["context"], r.text
    assert engine.prompts[-1]["prompt"] == \
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", engine.prompts[-1]
    bad = client.post("/api/generate", json={"model": "m", "prompt": "hi", "stream": False,
                                             "template": "{{ s3cr3t .Prompt }}"})
    assert bad.status_code == 400 and bad.json()["error"].startswith("template: ") and "s3cr3t" not in bad.text


def test_a_missing_capability_is_ollamas_does_not_support_400(app_and_engine):  # noqa: F811
    """``think`` on a server without a reasoning parser and ``suffix`` on a model without
    FIM tokens: Ollama's 400 says ``"NAME" does not support thinking`` / ``insert`` (its
    CLI matches that phrase to go on without thinking); they said other words."""
    client, engine = app_and_engine()
    for route, body, error in (
            ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "think": True},
             '"m:latest" does not support thinking ('),
            ("/api/generate", {"prompt": "hi", "think": "high"}, '"m:latest" does not support thinking ('),
            ("/api/generate", {"prompt": "def f(", "suffix": "  return 1"}, '"m:latest" does not support insert (')):
        r = client.post(route, json={"model": "m:latest", "stream": False, **body})
        assert r.status_code == 400 and r.json()["error"].startswith(error), (route, r.text)
    assert engine.prompts == []
