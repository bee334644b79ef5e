"""What Ollama's model routes tell about the served models: ``/api/tags`` (the models),
``/api/show`` (one model: capabilities, context length, template, parameters, details),
``/api/ps`` (the loaded models: all of them, always), ``/api/version``.

The fields follow Ollama's ``api/types.go`` (``ListModelResponse``, ``ShowResponse``,
``ProcessModelResponse``); clients read ``capabilities`` (VS Code Copilot lists a model
for agent mode only with ``tools``) and ``model_info["<architecture>.context_length"]``.
Sizes are bytes of the weight files; the digest is a hash of the model's path and file
time (a stable id, not Ollama's manifest digest); the models never unload, so
``expires_at`` is where Ollama puts a model loaded with ``keep_alive`` < 0 (forever):
now plus Go's longest duration (2^63 - 1 ns, ~292 years), which ``ollama ps`` shows as
"Forever" (Go's zero time, sent before, it showed as "Stopping...").
"""
from __future__ import annotations

import hashlib
import os
from datetime import datetime, timedelta, timezone
from typing import Any

from llmserve.entrypoints.ollama.serving import served_name
from llmserve.entrypoints.ollama.weight_facts import human_number, weight_facts
from llmserve.served_names import ollama_listed_name

# The Ollama API version these routes follow (clients compare it with their minimum).
# 0.13.4: Ollama serves /v1/responses since 0.13.3 (so does this server), and Codex CLI
# 0.171's `--oss --local-provider ollama` refuses any Ollama older than 0.13.4.
OLLAMA_API_VERSION = "0.13.4"
# Go's longest time.Duration: Ollama's keep_alive < 0 (api/types.go reads it so).
FOREVER = timedelta(microseconds=(2 ** 63 - 1) // 1000)
WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt")
FIM_MARKERS = ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<PRE>")
# SamplingParams names -> Ollama's Modelfile parameter names (``/api/show`` parameters).
PARAMETER_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repeat_penalty", "max_tokens": "num_predict",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


def model_states(state: Any) -> list[Any]:
    """Each served model's state (its handlers): one on a plain server, one per model
    with ``--extra-model``."""
    return list(getattr(state, "served_models", None) or [state])


def state_of(state: Any, name: str) -> Any:
    """The state of the model served as ``name`` (after ``served_name``)."""
    for s in model_states(state):
        if name in s.openai_serving_models.model_names:
            return s
    return state


def _weights_path(config: Any) -> str:
    """The GGUF file (``gguf_file`` may be a name inside ``model_path``), else the directory."""
    gguf, path = getattr(config, "gguf_file", None), config.model_path
    if gguf and not os.path.isfile(path):
        return os.path.join(path, gguf) if not os.path.isabs(gguf) else gguf
    return path


def size_bytes(config: Any) -> int:
    """Bytes of the model's weight files (0 when they cannot be read)."""
    return _path_bytes(_weights_path(config))


def _path_bytes(path: str) -> int:
    """Bytes of a weight file, or of the weight files in a folder (0 when unreadable)."""
    try:
        if os.path.isfile(path):
            return os.path.getsize(path)
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(WEIGHT_SUFFIXES))
    except OSError:
        return 0


def modified_at(config: Any) -> str:
    """The weights' modification time (RFC 3339, UTC)."""
    try:
        ts = os.path.getmtime(_weights_path(config))
    except OSError:
        ts = 0.0
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def digest(config: Any) -> str:
    """A stable id of the model (hex SHA-256 of its path and modification time)."""
    return hashlib.sha256(f"{_weights_path(config)}|{modified_at(config)}".encode()).hexdigest()


def architecture(config: Any) -> str:
    """Ollama's architecture name (``details.family``, ``model_info``'s
    ``general.architecture`` and key prefix): a GGUF file's own ``general.architecture``,
    as Ollama reads it (the transformers model_type differs: "gemma3_text" for a "gemma3"
    file, "mixtral" for llama.cpp's "llama" Mixtral), else the config's model_type."""
    arch = weight_facts(config, _weights_path(config)).arch if getattr(config, "gguf_file", None) else ""
    return arch or getattr(config.hf_config, "model_type", None) or "unknown"


def details(config: Any) -> dict[str, Any]:
    """Ollama's ``details`` (the same in /api/show, /api/tags and /api/ps): format,
    family, parameter size ("135M", "134.52M", "1.2B") and quantization level (the GGUF
    file type, "Q4_1", or the safetensors dtype, "BF16"), from the weights served
    (``weight_facts``)."""
    arch = architecture(config)
    facts = weight_facts(config, _weights_path(config))
    return {"parent_model": "", "format": "gguf" if getattr(config, "gguf_file", None) else "safetensors",
            "family": arch, "families": [arch], "parameter_size": human_number(facts.params),
            "quantization_level": facts.level}


def _card(s: Any, name: str) -> dict[str, Any]:
    """The listing of the model served as ``name``, listed as Ollama lists names
    (``name:latest`` when it has no tag: served_names.ollama_listed_name)."""
    config = s.engine_client.model_config
    listed = ollama_listed_name(name)
    return {"name": listed, "model": listed, "modified_at": modified_at(config), "size": size_bytes(config),
            "digest": digest(config), "details": details(config)}


def _adapter_card(s: Any, name: str, lora_path: str, parent: str) -> dict[str, Any]:
    """A LoRA adapter's card: its base model's details with ``parent_model`` the base,
    the size and digest of the adapter's own files."""
    card = _card(s, name)
    return {**card, "size": _path_bytes(lora_path),
            "digest": hashlib.sha256(f"{lora_path}|{card['digest']}".encode()).hexdigest(),
            "details": {**card["details"], "parent_model": parent}}


def _cards(s: Any) -> list[dict[str, Any]]:
    """The cards of one engine's served names: the base model's, then each LoRA adapter's
    (``--lora-modules`` and run-time loads), which /api/chat and /api/generate serve too."""
    models = s.openai_serving_models
    cards = [_card(s, n) for n in models.model_names]
    for adapters in getattr(models, "lora", ()):
        cards += [_adapter_card(s, n, req.lora_path, adapters.parents[n]) for n, req in adapters.lora_requests.items()]
    return cards


def tags(state: Any) -> dict[str, Any]:
    """``GET /api/tags``: every served name, LoRA adapters included (an Ollama client
    offers only the models listed here), each as Ollama lists it, ``name:latest`` for a
    name served without a tag: langchain-ollama's ``validate_model_on_init`` looks for
    ``NAME:latest`` here. Every route takes that name for the served one (VS Code Copilot
    Chat sends it to ``/v1/chat/completions``: served_names.latest_match)."""
    return {"models": [card for s in model_states(state) for card in _cards(s)]}


def ps(state: Any) -> dict[str, Any]:
    """``GET /api/ps``: every served model, loaded for the server's life (``expires_at``
    in ~292 years: the module docstring)."""
    out = []
    expires = (datetime.now(timezone.utc) + FOREVER).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    for s in model_states(state):
        config = s.engine_client.model_config
        on_gpu = str(getattr(config, "device", "cpu")).startswith("cuda")
        for card in _cards(s):
            out.append({**card, "expires_at": expires, "size_vram": card["size"] if on_gpu else 0,
                        "context_length": config.max_model_len})
    return {"models": out}


def openai_route_takes_tools(s: Any) -> bool:
    """Whether ``/v1/chat/completions`` serves ``tools`` with the default (``auto``) tool
    choice: only with ``--enable-auto-tool-choice --tool-call-parser`` (vLLM's rule; it
    is a 400 otherwise)."""
    chat = getattr(s, "openai_serving_chat", None)
    return bool(getattr(chat, "enable_auto_tools", False)) and getattr(chat, "tool_parser_cls", None) is not None


def capabilities(s: Any, openai_client: bool = False) -> list[str]:
    """What the model does here, in Ollama's words: completion (and tools: a call is
    enforced or parsed on /api/chat, see serving.py), thinking (with
    ``--reasoning-parser``), insert (FIM tokens in the vocabulary), embedding (a pooling
    model). ``openai_client``: the asker sends its chats to ``/v1/chat/completions``
    (VS Code Copilot Chat, which turns on tool calling, agent mode, when "tools" is
    listed): "tools" only where that route takes them (:func:`openai_route_takes_tools`),
    so agent mode is not offered to fail with a 400 on its first request."""
    tasks = tuple(getattr(s.engine_client.model_config, "supported_tasks", ("generate",)))
    caps = []
    if "generate" in tasks:
        caps.append("completion")
        if not openai_client or openai_route_takes_tools(s):
            caps.append("tools")
        if getattr(s.openai_serving_chat, "reasoning_parser_cls", None) is not None:
            caps.append("thinking")
        vocab = s.engine_client.tokenizer.get_vocab()
        if any(m in vocab for m in FIM_MARKERS):
            caps.append("insert")
    if "embed" in tasks:
        caps.append("embedding")
    return caps


def model_info(config: Any) -> dict[str, Any]:
    """Ollama's ``model_info`` (GGUF metadata names): architecture, context length and
    the shapes the config gives."""
    arch, hf = architecture(config), config.hf_config
    info: dict[str, Any] = {"general.architecture": arch, "general.basename": os.path.basename(config.model),
                            f"{arch}.context_length": config.max_model_len}
    for key, attr in (("embedding_length", "hidden_size"), ("block_count", "num_hidden_layers"),
                      ("attention.head_count", "num_attention_heads"),
                      ("attention.head_count_kv", "num_key_value_heads"), ("vocab_size", "vocab_size")):
        value = getattr(hf, attr, None)
        if isinstance(value, int):
            info[f"{arch}.{key}"] = value
    return info


def parameters(s: Any) -> str:
    """The model's default sampling parameters as Modelfile ``PARAMETER`` lines."""
    defaults = getattr(s.openai_serving_chat, "default_sampling_params", None) or {}
    lines = [f"{PARAMETER_NAMES[k]:<30} {v}" for k, v in defaults.items() if k in PARAMETER_NAMES and v is not None]
    return "\n".join(lines)


def chat_template(s: Any) -> str:
    renderer = getattr(s.openai_serving_render, "renderer", None)
    template = getattr(renderer, "chat_template", None) or getattr(s.engine_client.tokenizer, "chat_template", None)
    return template if isinstance(template, str) else ""


def show(state: Any, model: str, copilot: bool = False) -> dict[str, Any]:
    """``POST /api/show``. ``copilot``: the asker is VS Code Copilot Chat, which names the
    model by model_info's ``general.basename`` (Ollama puts the requested name there for
    it, in place of the weights' file name) and chats through ``/v1/chat/completions``
    (``capabilities(openai_client=True)``). Raises ModelNotFoundError (404) for an
    unknown name."""
    name = served_name(state, model)
    s = state_of(state, name)
    config = s.engine_client.model_config
    template, params = chat_template(s), parameters(s)
    # A LoRA adapter shows as Ollama shows a model made with ADAPTER: the line after FROM,
    # and its base as parent_model (/api/tags' card says the same)
    models = getattr(s, "openai_serving_models", None)
    adapters = models.adapters_of(name) if models is not None else None
    adapter = f"ADAPTER {adapters.get(name).lora_path}\n" if adapters is not None else ""
    shown = details(config) if adapters is None else {**details(config), "parent_model": adapters.parents[name]}
    modelfile = f"# Modelfile of {name}, served by llmserve\nFROM {_weights_path(config)}\n{adapter}" + \
        (f'TEMPLATE """{template}"""\n' if template else "") + \
        "".join(f"PARAMETER {line}\n" for line in params.splitlines())
    facts = model_info(config)
    if copilot:
        facts["general.basename"] = model
    return {"modelfile": modelfile, "parameters": params, "template": template, "details": shown,
            "model_info": facts, "capabilities": capabilities(s, openai_client=copilot),
            "modified_at": modified_at(config)}
