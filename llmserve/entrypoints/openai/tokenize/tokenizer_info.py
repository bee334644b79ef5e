"""``GET /tokenizer_info`` behind ``--enable-tokenizer-info-endpoint`` (vLLM's
``TokenizerInfo``): the tokenizer's init kwargs (file paths dropped; AddedToken objects
as their text), its class name, the special tokens and the chat template in use. Not
mounted (404) when the flag is off: it may expose the chat template.
"""
from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import JSONResponse

router = APIRouter()


def _json_safe(obj: Any) -> Any:
    if hasattr(obj, "content"):  # tokenizers.AddedToken
        return obj.content
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def tokenizer_info(tokenizer: Any, chat_template: Optional[str]) -> dict[str, Any]:
    """The body of ``/tokenizer_info`` (vLLM's ``TokenizerInfo.to_dict``, plus the special
    tokens and ids, which vLLM users read off ``init_kwargs``)."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    for key in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
        config.pop(key, None)  # file paths of the server's disk
    config = _json_safe(config)
    config["tokenizer_class"] = type(tokenizer).__name__
    config["vocab_size"] = len(tokenizer)
    config["special_tokens"] = _json_safe(getattr(tokenizer, "special_tokens_map", {}) or {})
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        config[name] = getattr(tokenizer, name, None)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


@router.get("/tokenizer_info")
async def get_tokenizer_info(raw_request: Request) -> JSONResponse:
    state = raw_request.app.state
    renderer = getattr(state.openai_serving_render, "renderer", None)
    return JSONResponse(tokenizer_info(state.engine_client.tokenizer, getattr(renderer, "chat_template", None)))


def register_tokenizer_info_api_router(app: FastAPI) -> None:
    """Mount ``/tokenizer_info`` (only when ``--enable-tokenizer-info-endpoint``)."""
    app.include_router(router)
