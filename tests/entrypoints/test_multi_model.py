"""``--extra-model`` parsing, the extra engine's arguments, and the multi-model registry's
routing decisions (no engine: the served models are namespaces with a model config)."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from llmserve.engine_args import AsyncEngineArgs
from llmserve.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
from llmserve.entrypoints.openai.models.serving import BaseModelPath, ModelNotFoundError, OpenAIServingModels
from llmserve.entrypoints.openai.multi_model import (ModelRegistry, ModelRoutedHandler, ServedModel,
                                                      extra_engine_args, parse_extra_model, per_model_args)
from llmserve.sampling_params import SamplingParamsError


def test_parse_extra_model_forms():
    assert parse_extra_model("all-MiniLM-L6-v2") == {"model": "all-MiniLM-L6-v2"}
    assert parse_extra_model("SmolLM2-135M-Instruct:pooling") == {"model": "SmolLM2-135M-Instruct",
                                                                  "runner": "pooling"}
    # a colon that is not a runner stays in the model path
    assert parse_extra_model("/models/a:b") == {"model": "/models/a:b"}
    spec = parse_extra_model('{"model": "SmolLM2-135M-Instruct", "runner": "pooling", "served_model_name": "e"}')
    assert spec == {"model": "SmolLM2-135M-Instruct", "runner": "pooling", "served_model_name": "e"}
    for bad in ('{"runner": "pooling"}', '{"model": "m", "no_such_field": 1}', "{not json", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_extra_model(bad)


def test_extra_model_flag_is_repeatable_and_parsed():
    parser = make_arg_parser()
    args = parser.parse_args(["SmolLM2-135M-Instruct", "--extra-model", "all-MiniLM-L6-v2",
                              "--extra-model", "SmolLM2-135M-Instruct:pooling"])
    validate_parsed_serve_args(args)
    assert args.extra_model == [{"model": "all-MiniLM-L6-v2"}, {"model": "SmolLM2-135M-Instruct", "runner": "pooling"}]
    assert make_arg_parser().parse_args([]).extra_model is None


def test_extra_engine_keeps_resources_but_not_model_fields():
    main = AsyncEngineArgs(model="SmolLM2-135M-Instruct", served_model_name=["chat"], max_model_len=1024,
                           chat_template="{{ x }}", kv_cache_memory="256MiB", max_num_seqs=8, dtype="float32")
    extra = extra_engine_args(main, {"model": "all-MiniLM-L6-v2"})
    assert (extra.model, extra.served_model_name, extra.max_model_len, extra.chat_template) == (
        "all-MiniLM-L6-v2", None, None, None)
    assert (extra.kv_cache_memory, extra.max_num_seqs, extra.dtype) == ("256MiB", 8, "float32")
    named = extra_engine_args(main, {"model": "SmolLM2-135M-Instruct", "runner": "pooling",
                                     "served_model_name": "smol-embed"})
    assert named.runner == "pooling" and named.served_model_name == ["smol-embed"]
    args = per_model_args(argparse.Namespace(port=1, chat_template="{{ x }}", model="SmolLM2-135M-Instruct"), extra)
    assert (args.port, args.chat_template, args.model) == (1, None, "all-MiniLM-L6-v2")


def test_extra_engine_does_not_inherit_the_main_models_lora_flags():
    # --enable-lora belongs to the main model (its adapters): an extra BERT embedder that
    # inherited it refused to start ("LoRA adapters run on the Llama family ..., not 'bert'").
    main = AsyncEngineArgs(model="SmolLM2-135M-Instruct", enable_lora=True, max_loras=4, max_lora_rank=64,
                           max_cpu_loras=8, lora_dtype="float32", max_num_seqs=8)
    extra = extra_engine_args(main, {"model": "all-MiniLM-L6-v2"})
    defaults = AsyncEngineArgs()
    assert (extra.enable_lora, extra.max_loras, extra.max_lora_rank, extra.max_cpu_loras, extra.lora_dtype) == (
        defaults.enable_lora, defaults.max_loras, defaults.max_lora_rank, defaults.max_cpu_loras, defaults.lora_dtype)
    assert extra.max_num_seqs == 8  # resources still shared
    own = extra_engine_args(main, {"model": "SmolLM2-135M-Instruct", "served_model_name": "b", "enable_lora": True})
    assert own.enable_lora is True  # an extra Llama may ask for LoRA itself


def _served(name: str, tasks: tuple[str, ...], max_len: int) -> ServedModel:
    engine = SimpleNamespace(model_config=SimpleNamespace(supported_tasks=tasks))
    handler = SimpleNamespace(create=lambda request, tag: (name, request.model, tag))
    state = SimpleNamespace(openai_serving_models=OpenAIServingModels([BaseModelPath(name, "/p/" + name)], max_len),
                            openai_serving_chat=handler, openai_serving_embedding=handler,
                            openai_serving_tokenization=handler)
    return ServedModel(engine, state)


def test_registry_routes_by_model_and_task():
    reg = ModelRegistry([_served("chat", ("generate",), 2048), _served("emb", ("encode", "embed"), 512)])
    assert reg.resolve("emb").names == ["emb"]
    assert reg.resolve("emb:latest").names == ["emb"]  # the name /api/tags lists (Ollama's default tag)
    assert reg.resolve(None, "embed").names == ["emb"]  # no `model`: the first that can
    assert reg.resolve("", "text").names == ["chat"]
    assert reg.resolve(None).names == ["chat"]
    with pytest.raises(ModelNotFoundError) as nf:
        reg.resolve("nope", "text")
    assert "`chat`" in str(nf.value) and "`emb`" in str(nf.value)
    with pytest.raises(SamplingParamsError) as e:
        reg.resolve("emb", "text", "--runner generate")
    assert e.value.param == "model" and "--runner generate" in str(e.value) and '"model": "chat"' in str(e.value)
    with pytest.raises(SamplingParamsError) as e:
        reg.resolve("chat", "embed", "--runner pooling")
    assert "--runner pooling" in str(e.value) and '"model": "emb"' in str(e.value)
    # each routed handler calls the handler of the model the request names
    req = SimpleNamespace(model="emb")
    assert ModelRoutedHandler(reg, "openai_serving_embedding").create(req, tag=1) == ("emb", "emb", 1)
    assert ModelRoutedHandler(reg, "openai_serving_tokenization").create(req, 2) == ("emb", "emb", 2)
    with pytest.raises(SamplingParamsError):
        ModelRoutedHandler(reg, "openai_serving_chat").create(req, 3)
    cards = reg.serving_models().show_available_models().data
    assert [(c.id, c.max_model_len) for c in cards] == [("chat", 2048), ("emb", 512)]
    # Ollama's embeddings take any model (a generating one embeds its hidden states)
    assert ModelRoutedHandler(reg, "openai_serving_embedding").handler_for(
        SimpleNamespace(model="chat"), any_model=True) is reg.resolve("chat").state.openai_serving_embedding


def test_speech_model_is_not_routed_text_requests():
    """Whisper generates, but only from audio: chat/completions naming it are a 400 naming
    `model` and every model that can; a transcription naming the chat model likewise."""
    reg = ModelRegistry([_served("chat", ("generate",), 2048), _served("chat2", ("generate",), 2048),
                         _served("whisper", ("generate", "transcription"), 448)])
    with pytest.raises(SamplingParamsError) as e:
        ModelRoutedHandler(reg, "openai_serving_chat").create(SimpleNamespace(model="whisper"), 1)
    assert e.value.param == "model" and "`chat`, `chat2`" in str(e.value) and "audio" in str(e.value)
    with pytest.raises(SamplingParamsError) as e:
        reg.resolve("chat", "transcription", "a Whisper model")
    assert e.value.param == "model" and "`whisper`" in str(e.value)
    assert reg.resolve(None, "transcription").names == ["whisper"]
    assert reg.resolve(None, "text").names == ["chat"]


def test_registry_refuses_duplicate_names():
    with pytest.raises(ValueError, match="served_model_name"):
        ModelRegistry([_served("m", ("generate",), 8), _served("m", ("embed",), 8)])


def test_routed_admission_admits_by_the_serving_engine():
    """With several models, each request passes the controller of the engine that serves
    it: a full chat engine refuses chats, not embeddings; /ready follows the main model."""
    from llmserve.config import AdmissionConfig
    from llmserve.entrypoints.openai.admission import AdmissionController
    from llmserve.entrypoints.openai.routed_admission import ModelRoutedAdmission, model_of_body

    reg = ModelRegistry([_served("chat", ("generate",), 2048), _served("emb", ("encode", "embed"), 512)])
    chat_c, emb_c = (AdmissionController(AdmissionConfig(max_waiting_requests=0, engine_stall_timeout=0.0,
                                                         max_queue_delay=0.0), max_num_seqs=1) for _ in range(2))
    routed = ModelRoutedAdmission(reg, [chat_c, emb_c])
    assert model_of_body(b'{"messages": [{"model": "x"}], "model": "emb"}') == "emb"
    assert model_of_body(b"not json") is None and model_of_body(b'{"model": 3}') is None
    assert routed.controller_for("/v1/embeddings", b'{"model": "emb", "input": "a"}') is emb_c
    assert routed.controller_for("/v1/embeddings", b'{"input": "a"}') is emb_c  # no model: the first that can
    assert routed.controller_for("/v1/chat/completions", b'{"model": "chat"}') is chat_c
    assert routed.controller_for("/v1/chat/completions", b'{"model": "nope"}') is chat_c  # the handler 404s
    assert chat_c.admit() is None and chat_c.admit() is not None  # the chat engine is full
    assert routed.controller_for("/v1/embeddings", b'{"model": "emb"}').admit() is None
    routed.is_draining = lambda: True
    assert chat_c.is_draining() and emb_c.is_draining() and routed.check().reason == "draining"
