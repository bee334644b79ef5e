"""``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations``: multipart form
-> ``TranscriptionRequest`` + file bytes -> OpenAIServingSpeechToText."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import PlainTextResponse, Response

from llmserve.entrypoints.openai.server_utils import request_id_of, result_response, with_cancellation
from llmserve.entrypoints.openai.speech_to_text.protocol import parse_form
from llmserve.sampling_params import SamplingParamsError

router = APIRouter()


async def _handle(raw_request: Request, task: str) -> Response:
    handler = raw_request.app.state.openai_serving_transcription
    ctype = raw_request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        raise SamplingParamsError("Send the audio as multipart/form-data with a `file` field", "file")
    # Starlette caps each form part at 1 MiB by default; the audio limit is ours.
    limit = getattr(raw_request.app.state, "max_audio_file_bytes", None) or 25 * 1024 * 1024
    try:
        form = await raw_request.form(max_files=1, max_fields=64, max_part_size=limit + 1)
    except Exception as e:  # a malformed body, too many parts, a part over the limit
        raise SamplingParamsError(f"Cannot read the multipart form: {e}", "file") from None
    request, upload = parse_form(list(form.multi_items()))
    data = await upload.read()
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
