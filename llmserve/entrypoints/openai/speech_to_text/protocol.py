"""Request and response bodies of ``/v1/audio/transcriptions`` and
``/v1/audio/translations`` (OpenAI's audio API, with vLLM's extra sampling fields and its
stream events ``transcription.chunk``).

The request is multipart form data: ``file`` plus text fields; ``parse_form`` turns the
fields into a ``TranscriptionRequest`` (a 400 naming the field for a bad value).
"""
from __future__ import annotations

import time
from typing import Any, Literal, Optional

from pydantic import BaseModel, Field, ValidationError

from llmserve.entrypoints.openai.common.protocol import _warn_ignored_field, random_uuid
from llmserve.sampling_params import SamplingParamsError

ResponseFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]
#: The formats a stream (``stream=true``) can carry: its events hold text deltas and the
#: whole text, never segments or cue timings (OpenAI streams json/text transcriptions only).
STREAMED_FORMATS = ("json", "text")


class TranscriptionRequest(BaseModel):
    """The form fields (``file`` comes apart). ``timestamp_granularities`` is OpenAI's
    ``timestamp_granularities[]``; only "segment" is supported ("word" is a 400)."""

    model: Optional[str] = None
    language: Optional[str] = None
    prompt: str = ""
    response_format: ResponseFormat = "json"
    temperature: float = Field(0.0, ge=0.0, le=1.0)
    timestamp_granularities: list[Literal["segment", "word"]] = []
    stream: bool = False
    stream_include_usage: bool = False
    stream_continuous_usage_stats: bool = False
    # The stream's event shape: "openai" (transcript.text.delta / transcript.text.done, what
    # the official SDKs read) or "vllm" (transcription.chunk objects). Unset: vLLM's when a
    # vLLM-only stream field above is set (such a client expects vLLM's shape), else OpenAI's.
    stream_format: Optional[Literal["openai", "vllm"]] = None
    # vLLM's extra sampling fields
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    max_completion_tokens: Optional[int] = None
    to_language: Optional[str] = None
    # Beam search in the engine (core/beam_search.py): faster-whisper's / OpenAI Whisper's
    # beam_size; default 1 (greedy, as vLLM decodes); > 1 needs temperature 0.
    beam_size: int = Field(1, ge=1)
    length_penalty: float = 1.0


_LIST_FIELDS = {"timestamp_granularities[]": "timestamp_granularities",
                "timestamp_granularities": "timestamp_granularities"}


# OpenAI audio fields this server cannot honour and whose absence would change the answer
# (README "Request fields"): a 400 naming them. Any other unknown field is ignored with a
# warning, as on every endpoint.
REFUSED_FIELDS = {
    "include": "Token logprobs of transcriptions (`include[]=logprobs`) are not supported by this server.",
    "known_speaker_names": "Speaker diarization is not supported by this server.",
    "known_speaker_references": "Speaker diarization is not supported by this server.",
}


def _unknown_field(key: str, value: Any) -> None:
    """A form field TranscriptionRequest lacks: a 400 naming it when it is in
    REFUSED_FIELDS (or ``chunking_strategy`` other than "auto": this server's windows
    are its own), else ignored with a warning logged once per name."""
    name = key[:-2] if key.endswith("[]") else key
    if name in REFUSED_FIELDS:
        raise SamplingParamsError(f"`{name}`: {REFUSED_FIELDS[name]}", name)
    if name == "chunking_strategy" and value != "auto":
        raise SamplingParamsError("`chunking_strategy`: only \"auto\" is supported (this server cuts the audio into "
                                  "its own 30-second windows).", name)
    if name != "chunking_strategy":
        _warn_ignored_field("TranscriptionRequest", name[:64])


def parse_form(items: list[tuple[str, Any]]) -> tuple[TranscriptionRequest, Any]:
    """(form field, value) pairs -> (request, the ``file`` upload). Raises
    SamplingParamsError naming the field for a missing file, a refused field
    (REFUSED_FIELDS), a bad value or a stream in a format it cannot carry
    (``check_stream_format``); other unknown fields are ignored with a warning."""
    data: dict[str, Any] = {}
    upload = None
    known = set(TranscriptionRequest.model_fields)
    for key, value in items:
        if key == "file":
            upload = value
        elif key in _LIST_FIELDS:
            data.setdefault(_LIST_FIELDS[key], []).append(value)
        elif key in known:
            if not isinstance(value, str):
                raise SamplingParamsError(f"`{key}` must be a text field", key)
            data[key] = value
        else:
            _unknown_field(key, value)
    if upload is None or isinstance(upload, str):
        raise SamplingParamsError("`file` is required: the audio file to transcribe (multipart upload)", "file")
    for key in ("language", "to_language", "prompt"):  # empty means "not given" (curl -F language=)
        if data.get(key) == "":
            data.pop(key)
    try:
        request = TranscriptionRequest.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err.get("loc") else None
        raise SamplingParamsError(f"`{field}`: {err['msg']}", field) from None
    check_stream_format(request)
    return request, upload


def check_stream_format(request: TranscriptionRequest) -> None:
    """A 400 naming ``stream`` for a stream in a format it cannot carry (srt, vtt,
    verbose_json: their cue and segment timings are not in the text deltas). Answering
    such a request with plain text events (as this server did) hands a subtitle
    pipeline text it then parses as SRT; vLLM and LiteLLM users saw the refusal."""
    if request.stream and request.response_format not in STREAMED_FORMATS:
        raise SamplingParamsError(
            f"`stream`: response_format {request.response_format!r} cannot be streamed (a stream carries "
            f"text only); use response_format {' or '.join(STREAMED_FORMATS)} to stream, or stream=false "
            f"for {request.response_format}.", "stream")


class TranscriptionUsage(BaseModel):
    type: Literal["duration"] = "duration"
    seconds: int


class TranscriptionResponse(BaseModel):
    text: str
    usage: Optional[TranscriptionUsage] = None


class TranscriptionSegment(BaseModel):
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float = 0.0
    compression_ratio: float = 1.0
    no_speech_prob: float = 0.0


class TranscriptionResponseVerbose(BaseModel):
    task: Literal["transcribe", "translate"] = "transcribe"
    language: str
    duration: float
    text: str
    segments: list[TranscriptionSegment] = []
    words: Optional[list[Any]] = None


class DeltaMessage(BaseModel):
    content: Optional[str] = None


class TranscriptionResponseStreamChoice(BaseModel):
    delta: DeltaMessage
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None


class StreamUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TranscriptTextDelta(BaseModel):
    """OpenAI's stream event ``transcript.text.delta``: the next piece of the text."""

    type: Literal["transcript.text.delta"] = "transcript.text.delta"
    delta: str


class TranscriptTokenUsage(BaseModel):
    """OpenAI's token usage of a streamed transcription (``type`` "tokens"): input tokens
    are the decoder prompt's (the audio itself is the encoder's input)."""

    type: Literal["tokens"] = "tokens"
    input_tokens: int
    output_tokens: int
    total_tokens: int


class TranscriptTextDone(BaseModel):
    """OpenAI's last stream event ``transcript.text.done``: the whole text and the usage."""

    type: Literal["transcript.text.done"] = "transcript.text.done"
    text: str
    usage: Optional[TranscriptTokenUsage] = None


def uses_vllm_stream_format(request: "TranscriptionRequest") -> bool:
    """Whether a streamed transcription answers in vLLM's ``transcription.chunk`` shape
    (see ``TranscriptionRequest.stream_format``) rather than OpenAI's events."""
    if request.stream_format is not None:
        return request.stream_format == "vllm"
    return request.stream_include_usage or request.stream_continuous_usage_stats


class TranscriptionStreamResponse(BaseModel):
    """vLLM's stream event (``object`` "transcription.chunk"; translations use the same)."""

    id: str = Field(default_factory=lambda: f"trsc-{random_uuid()}")
    object: Literal["transcription.chunk"] = "transcription.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[TranscriptionResponseStreamChoice]
    usage: Optional[StreamUsage] = None
