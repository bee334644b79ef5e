"""``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations``: multipart form
-> ``TranscriptionRequest`` + file bytes -> OpenAIServingSpeechToText."""
from __future__ import annotations

import contextvars
from typing import Any, Optional

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import PlainTextResponse, Response

from llmserve.entrypoints.openai.admission_precheck import route_handler
from llmserve.entrypoints.openai.server_utils import request_id_of, result_response, with_cancellation
from llmserve.entrypoints.openai.speech_to_text.protocol import TranscriptionRequest, parse_form
from llmserve.sampling_params import SamplingParamsError

router = APIRouter()


async def read_form(raw_request: Request, state: Any) -> tuple[TranscriptionRequest, bytes]:
    """The request and the audio bytes of a multipart speech-to-text body; ``state``: the
    app's (``max_audio_file_bytes``). Raises SamplingParamsError naming the field (a body
    that is not multipart, a form it cannot read, a missing ``file``, a bad field)."""
    ctype = raw_request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        raise SamplingParamsError("Send the audio as multipart/form-data with a `file` field", "file")
    # Starlette caps each form part at 1 MiB by default; the audio limit is ours.
    limit = getattr(state, "max_audio_file_bytes", None) or 25 * 1024 * 1024
    try:
        form = await raw_request.form(max_files=1, max_fields=64, max_part_size=limit + 1)
    except Exception as e:  # a malformed body, too many parts, a part over the limit
        raise SamplingParamsError(f"Cannot read the multipart form: {e}", "file") from None
    try:
        request, upload = parse_form(list(form.multi_items()))
        return request, await upload.read()
    finally:
        await form.close()  # the bytes are read: the spooled upload file is not needed


async def _check_form(state: Any, body: bytes, content_type: Optional[str]) -> None:
    """Admission's check of a speech-to-text request it would refuse (admission_precheck.py):
    the form as the route reads it, then the handler's first checks (the model, the
    fields, the file probed, not decoded)."""
    scope = {"type": "http", "method": "POST", "headers": [(b"content-type", (content_type or "").encode("latin-1"))]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}
    request, data = await read_form(Request(scope, receive), state)
    handler = route_handler(state, "openai_serving_transcription", request)
    if handler is not None:
        contextvars.copy_context().run(handler.first_checks, request, data)  # its LoRA choice stays there


# Path -> the check admission runs on a request it would refuse (admission_precheck.Prechecks.by_path)
SPEECH_TO_TEXT_BODY_CHECKS = {"/v1/audio/transcriptions": _check_form, "/v1/audio/translations": _check_form}


async def _handle(raw_request: Request, task: str) -> Response:
    handler = raw_request.app.state.openai_serving_transcription
    request, data = await read_form(raw_request, raw_request.app.state)
    result = await with_cancellation(raw_request, handler.create(request, data, task, request_id_of(raw_request)))
    if isinstance(result, str):
        media = "text/vtt" if request.response_format == "vtt" else "text/plain"
        return PlainTextResponse(result, media_type=media)
    return result_response(result)


@router.post("/v1/audio/transcriptions")
async def create_transcription(raw_request: Request) -> Response:
    return await _handle(raw_request, "transcribe")


@router.post("/v1/audio/translations")
async def create_translation(raw_request: Request) -> Response:
    return await _handle(raw_request, "translate")


def register_speech_to_text_api_routers(app: FastAPI) -> None:
    """Mount /v1/audio/transcriptions and /v1/audio/translations."""
    app.include_router(router)
