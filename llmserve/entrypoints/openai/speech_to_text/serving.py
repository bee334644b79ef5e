"""Speech to text (vLLM's ``OpenAIServingTranscription`` / ``OpenAIServingTranslation``):
audio file -> 16 kHz samples -> <= 30 s chunks -> one Whisper request per chunk (run
together) -> text stitched in order, in the asked ``response_format``.

Decoder prompt per chunk (as vLLM's ``WhisperForConditionalGeneration.get_decoder_prompt``):
``[<|startofprev|> prompt]<|startoftranscript|><|lang|><|transcribe or translate|>`` then
``<|notimestamps|>``, except for ``verbose_json``/``srt``/``vtt``, which let the model write
its timestamp tokens and turn them into segments; a window whose output ends in two
timestamps is decoded again from the last one (``resume_point``, Whisper's seek), or the
speech after it would be lost. English-only checkpoints (``*.en``)
take no language or task token. Temperature 0 by default, as OpenAI. Without ``language`` a
multilingual model detects it first (Whisper's ``detect_language``: one decoder step after
``<|startoftranscript|>`` over the first chunk, the most likely language token).
"""
from __future__ import annotations

import asyncio
import functools
import math
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Optional

import numpy as np

from llmserve.beam_search import BeamSearchParams
from llmserve.entrypoints.openai.common.serving import SSE_DONE, BaseServing, sse, sse_error
from llmserve.entrypoints.openai.speech_to_text.protocol import (
    DeltaMessage, StreamUsage, TranscriptionRequest, TranscriptionResponse, TranscriptionResponseStreamChoice,
    TranscriptionResponseVerbose, TranscriptionSegment, TranscriptionStreamResponse, TranscriptionUsage,
    TranscriptTextDelta, TranscriptTextDone, TranscriptTokenUsage, uses_vllm_stream_format)
from llmserve.multimodal.audio import (SAMPLE_RATE, AudioDecodeError, decode_audio, probe_audio, split_audio,
                                        to_mono_16k)
from llmserve.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError

DEFAULT_MAX_AUDIO_FILE_BYTES = 25 * 1024 * 1024  # OpenAI's upload limit
_TIMESTAMP_STEP_S = 0.02
# Audio after a window's last closed segment shorter than this is not decoded again: too
# short for a word (espeak's shortest words last ~0.25 s), and a silent scrap invites
# Whisper's hallucinated "Thank you." on silence.
_MIN_TAIL_S = 0.5
# Re-decodes of one window (``resume_point``) at most: each is one more encoder pass over
# <= 30 s, so a crafted file costs at most (1 + this) times a plain one; the case clips
# (tests/data/audio/c69_*) need one at most.
_MAX_SEEKS = 3


@dataclass
class Transcript:
    """One chunk's result: text, output token ids, start offset (s) and duration (s)."""

    text: str
    token_ids: list[int]
    offset: float
    duration: float
    num_prompt_tokens: int


def _fmt_time(t: float, sep: str) -> str:
    ms = int(round(t * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def subtitles(segments: list[TranscriptionSegment], fmt: str) -> str:
    """Segments as SubRip (``srt``) or WebVTT (``vtt``) text."""
    if fmt == "srt":
        return "".join(f"{i + 1}\n{_fmt_time(s.start, ',')} --> {_fmt_time(s.end, ',')}\n{s.text.strip()}\n\n"
                       for i, s in enumerate(segments))
    return "WEBVTT\n\n" + "".join(f"{_fmt_time(s.start, '.')} --> {_fmt_time(s.end, '.')}\n{s.text.strip()}\n\n"
                                  for s in segments)


def timestamp_segments(token_ids: list[int], ts_begin: int, eot: int,
                       duration: float) -> list[tuple[float, float, list[int]]]:
    """One 30 s window's output tokens (decoded after a prompt ending ``<|0.00|>``) ->
    ``[(start s, end s, text token ids)]``, as OpenAI's ``transcribe()`` reads Whisper's
    timestamp tokens (id ``ts_begin + k`` is ``k * 0.02`` s): two consecutive timestamps
    close a segment and open the next; a segment runs from its first to its last
    timestamp; text after the last pair ends at a lone final timestamp, else at
    ``duration``. Whatever the model wrote, the times rise (each start >= the previous
    end, end >= start) and stay within ``[0, duration]``; segments without text are
    dropped."""
    toks = [ts_begin] + [t for t in token_ids if t != eot]
    is_ts = [t >= ts_begin for t in toks]
    cuts = [i for i in range(1, len(toks)) if is_ts[i - 1] and is_ts[i]] + [len(toks)]
    out: list[tuple[float, float, list[int]]] = []
    last_end, prev = 0.0, 0
    for cut in cuts:
        piece, piece_ts = toks[prev:cut], is_ts[prev:cut]
        prev = cut
        text = [t for t, ts in zip(piece, piece_ts) if not ts]
        if not text:
            continue
        start = (piece[0] - ts_begin) * _TIMESTAMP_STEP_S if piece_ts[0] else last_end
        closed = len(piece) > 1 and piece_ts[-1]
        end = (piece[-1] - ts_begin) * _TIMESTAMP_STEP_S if closed else duration
        start = min(max(start, last_end), duration)
        last_end = end = min(max(end, start), duration)
        out.append((start, end, text))
    return out


def resume_point(token_ids: list[int], ts_begin: int, eot: int, duration: float) -> Optional[float]:
    """Where to go on decoding a window of ``duration`` s, from its timestamp-mode output
    tokens, as OpenAI Whisper's ``transcribe()`` seeks: output ending in two timestamps
    ``<|t|><|t|>`` means the model closed its last segment at t and left the audio after
    it for the next window (it does so when the window's end cuts speech or leaves too
    little of it); any other ending (``<|t|>`` after text, or text) consumed the window.
    Returns t in seconds, or None when the window is done or less than ``_MIN_TAIL_S``
    (or nothing: t == 0) would be gained."""
    toks = [t for t in token_ids if t != eot]
    if len(toks) < 2 or toks[-1] < ts_begin or toks[-2] < ts_begin:
        return None
    t = (toks[-1] - ts_begin) * _TIMESTAMP_STEP_S
    return t if t > 0 and duration - t >= _MIN_TAIL_S else None


class OpenAIServingSpeechToText(BaseServing):
    """Handler of ``/v1/audio/transcriptions`` (``task="transcribe"``) and
    ``/v1/audio/translations`` (``task="translate"``; the output is English). Raises
    SamplingParamsError (400 naming the field): ``model`` when the model is not a speech
    model, ``file`` for audio that cannot be decoded or is larger than
    ``max_audio_file_bytes``, ``language`` for a language Whisper does not know (or any
    but English on an English-only checkpoint), ``timestamp_granularities`` for "word"."""

    supports_lora = False  # the Whisper runner has no LoRA layers

    request_id_prefix = "trsc"

    def __init__(self, engine_client: Any, models: Any, *, log_requests: bool = False,
                 max_audio_file_bytes: int = DEFAULT_MAX_AUDIO_FILE_BYTES):
        super().__init__(engine_client, models, log_requests=log_requests)
        self.tokenizer = engine_client.tokenizer
        self.max_audio_file_bytes = max_audio_file_bytes
        self.is_speech_model = bool(getattr(self.model_config, "is_encoder_decoder", False))
        self.multilingual = int(self.model_config.vocab_size) >= 51865  # *.en checkpoints have 51864
        tok = self.tokenizer
        self.eot = tok.convert_tokens_to_ids("<|endoftext|>") if self.is_speech_model else None
        # The first timestamp token follows <|notimestamps|> (Whisper's vocabulary layout;
        # some tokenizer.json files leave the timestamp tokens out).
        self.ts_begin = tok.convert_tokens_to_ids("<|notimestamps|>") + 1 if self.is_speech_model else None

    def new_request_id(self, base: Optional[str] = None) -> str:
        from llmserve.entrypoints.openai.common.protocol import random_uuid
        return f"{self.request_id_prefix}-{base or random_uuid()}"

    # ---- validation ----------------------------------------------------------
    def _language(self, request: TranscriptionRequest) -> Optional[str]:
        """The request's language code; None when omitted on a multilingual model (detect it)."""
        from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE
        if not (request.language or "").strip() and self.multilingual:
            return None
        lang = (request.language or "en").strip().lower()
        lang = TO_LANGUAGE_CODE.get(lang, lang)  # "english" -> "en"
        if lang not in LANGUAGES:
            raise SamplingParamsError(f"Unsupported language {request.language!r}: use an ISO-639-1 code Whisper "
                                      f"knows ({', '.join(sorted(LANGUAGES))})", "language")
        if not self.multilingual and lang != "en":
            raise SamplingParamsError(f"The model `{self.model_config.served_model_name[0]}` is English-only; "
                                      f"language {request.language!r} is not supported", "language")
        return lang

    def _check(self, request: TranscriptionRequest, data: bytes) -> tuple[str, Optional[str]]:
        name = self._check_model(request)
        if not self.is_speech_model:
            raise SamplingParamsError(f"The model `{name}` is not a speech-to-text model (Whisper); it cannot "
                                      "transcribe audio", "model")
        if "word" in request.timestamp_granularities:
            raise SamplingParamsError("timestamp_granularities 'word' is not supported; use 'segment'",
                                      "timestamp_granularities")
        if len(data) > self.max_audio_file_bytes:
            raise SamplingParamsError(f"The audio file is {len(data)} bytes; the limit is {self.max_audio_file_bytes} "
                                      "bytes (--max-audio-file-bytes)", "file")
        return name, self._language(request)

    def first_checks(self, request: TranscriptionRequest, data: bytes) -> None:
        """What :meth:`create` refuses before it decodes the audio (the model, the fields,
        the file's size, ``beam_size``), then the file's audio probed, not decoded
        (``probe_audio``: empty, no decoder opens it), with :meth:`create`'s 400 naming
        ``file``: admission's check of a request it would refuse (admission_precheck.py)."""
        self._check(request, data)
        check_beam_size(request)
        try:
            probe_audio(data)
        except AudioDecodeError as e:
            raise SamplingParamsError(f"Invalid or unsupported audio file: {e}", "file") from None

    # ---- prompts and parameters -------------------------------------------
    def _decoder_prompt(self, request: TranscriptionRequest, lang: str, task: str, timestamps: bool) -> str:
        prev = f"<|startofprev|> {request.prompt.strip()}" if request.prompt.strip() else ""
        head = f"<|startoftranscript|><|{lang}|><|{task}|>" if self.multilingual else "<|startoftranscript|>"
        return prev + head + ("" if timestamps else "<|notimestamps|>")

    def _params(self, request: TranscriptionRequest, prompt_len: int, kind: RequestOutputKind) -> SamplingParams:
        room = self.max_model_len - prompt_len
        max_tokens = min(room, request.max_completion_tokens) if request.max_completion_tokens else room
        extra = {k: v for k in ("top_p", "top_k", "min_p", "seed", "repetition_penalty", "frequency_penalty",
                                "presence_penalty") if (v := getattr(request, k)) is not None}
        try:
            return SamplingParams(temperature=request.temperature, max_tokens=max(1, max_tokens),
                                  output_kind=kind, **extra)
        except ValueError as e:
            raise SamplingParamsError(str(e), getattr(e, "param", None)) from None

    @staticmethod
    async def _chunks(data: bytes) -> tuple[list[np.ndarray], float]:
        """Decode + resample + split in a worker thread (FFmpeg and soxr release the GIL)."""
        def work():
            try:
                samples, sr = decode_audio(data)
                x = to_mono_16k(samples, sr)
            except (AudioDecodeError, ValueError) as e:
                raise SamplingParamsError(f"Invalid or unsupported audio file: {e}", "file") from None
            return split_audio(x), x.size / SAMPLE_RATE
        return await asyncio.to_thread(work)

    # ---- entry point ---------------------------------------------------------
    async def create(self, request: TranscriptionRequest, data: bytes, task: str,
                     request_id: Optional[str] = None) -> Any:
        """A pydantic response (json / verbose_json), a ``str`` (text / srt / vtt) or,
        with ``stream``, an async generator of SSE events."""
        name, lang = self._check(request, data)
        check_beam_size(request)
        timestamps = request.response_format in ("verbose_json", "srt", "vtt") and not request.stream
        chunks, duration = await self._chunks(data)
        rid = self.new_request_id(request_id)
        if lang is None:
            lang = await self._detect_language(f"{rid}-lang", chunks[0])
        prompt = self.tokenizer.encode(self._decoder_prompt(request, lang, task, timestamps), add_special_tokens=False)
        if timestamps:  # start in timestamp mode at <|0.00|>, as Whisper's timestamp rules force
            prompt.append(self.ts_begin)
        n_prompt = len(prompt)
        if request.stream:
            params = self._params(request, n_prompt, RequestOutputKind.DELTA)
            stream = self._stream if uses_vllm_stream_format(request) else self._openai_stream
            gen = stream(request, name, rid, prompt, params, chunks)
            first = await gen.__anext__()  # a rejected request is a 400 before the stream starts
            return _prepend(first, gen)
        params = self._params(request, n_prompt, RequestOutputKind.FINAL_ONLY)
        beam = beam_params_of(request, params)
        windows = await asyncio.gather(*(self._run_window(f"{rid}-{i}", prompt, params, c, beam, timestamps)
                                         for i, c in enumerate(chunks)))
        results, offset = [], 0.0
        for pieces, c in zip(windows, chunks):
            for r in pieces:
                r.offset += offset
            results += pieces
            offset += c.size / SAMPLE_RATE
        text = "".join(r.text for r in results).strip()
        fmt = request.response_format
        if fmt == "json":
            return TranscriptionResponse(text=text, usage=TranscriptionUsage(seconds=math.ceil(duration)))
        if fmt == "text":
            return text + "\n"
        segments = self._segments(results, request.temperature)
        if fmt in ("srt", "vtt"):
            return subtitles(segments, fmt)
        from transformers.models.whisper.tokenization_whisper import LANGUAGES
        return TranscriptionResponseVerbose(task=task, language=LANGUAGES[lang], duration=round(duration, 3),
                                            text=text, segments=segments)

    @functools.cached_property
    def _language_token_ids(self) -> dict[int, str]:
        """{token id: language code} of the language tokens this tokenizer has."""
        from transformers.models.whisper.tokenization_whisper import LANGUAGES
        tok = self.tokenizer
        ids = {tok.convert_tokens_to_ids(f"<|{code}|>"): code for code in LANGUAGES}
        ids.pop(tok.unk_token_id, None)
        ids.pop(None, None)
        return ids

    async def _detect_language(self, rid: str, chunk: np.ndarray) -> str:
        """Whisper's ``detect_language``: the argmax over the language tokens of the
        decoder's first step after ``<|startoftranscript|>`` on this audio (one engine
        request of one token, batched like any other)."""
        ids = self._language_token_ids
        params = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=list(ids),
                                output_kind=RequestOutputKind.FINAL_ONLY)
        sot = self.tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
        final = None
        async for out in self.engine_client.generate(
                {"prompt_token_ids": [sot], "multi_modal_data": {"audio": (chunk, SAMPLE_RATE)}}, params, rid):
            final = out
        return ids[final.outputs[0].token_ids[0]]

    async def _run_chunk(self, rid: str, prompt: list[int], params: SamplingParams, chunk: np.ndarray,
                         beam: Optional[BeamSearchParams] = None) -> Transcript:
        """One engine request over ``chunk`` (<= 30 s of 16 kHz samples); offset 0."""
        final = None
        async for out in _generate(self.engine_client, prompt, params, chunk, rid, beam):
            final = out
        o = final.outputs[0]
        return Transcript(o.text, list(o.token_ids), 0.0, chunk.size / SAMPLE_RATE,
                          len(final.prompt_token_ids or ()))

    async def _run_window(self, rid: str, prompt: list[int], params: SamplingParams, chunk: np.ndarray,
                          beam: Optional[BeamSearchParams], timestamps: bool) -> list[Transcript]:
        """One chunk's transcripts in order, offsets (s) from the chunk's start. With
        timestamps, a window the model left early (``resume_point``) is decoded again from
        its last timestamp, as ``transcribe()`` seeks: without that, the speech after it was
        lost (a 49 s file of eight sentences, cut at 29.65 s, lost its fifth sentence,
        26.0-29.6 s, from verbose_json, srt and vtt, while json had it). Without timestamps
        the model writes all it hears (one request). At most ``_MAX_SEEKS`` re-decodes."""
        pieces: list[Transcript] = []
        start = 0  # samples into the chunk
        for seek in range(_MAX_SEEKS + 1):
            r = await self._run_chunk(f"{rid}-{seek}" if seek else rid, prompt, params, chunk[start:], beam)
            r.offset = start / SAMPLE_RATE
            pieces.append(r)
            resume = resume_point(r.token_ids, self.ts_begin, self.eot, r.duration) if timestamps else None
            if resume is None:
                break
            start += int(round(resume * SAMPLE_RATE))
        return pieces

    def _segments(self, results: list[Transcript], temperature: float) -> list[TranscriptionSegment]:
        segs: list[TranscriptionSegment] = []
        for r in results:
            for start, end, toks in timestamp_segments(r.token_ids, self.ts_begin, self.eot, r.duration):
                text = self.tokenizer.decode(toks, skip_special_tokens=True)
                if text.strip():
                    segs.append(TranscriptionSegment(
                        id=len(segs), seek=int(r.offset * 100), start=round(r.offset + start, 2),
                        end=round(r.offset + end, 2), text=text, tokens=toks, temperature=temperature))
        return segs

    async def _openai_stream(self, request: TranscriptionRequest, name: str, rid: str, prompt: list[int],
                             params: SamplingParams, chunks: list[np.ndarray]) -> AsyncGenerator[str, None]:
        """OpenAI's transcription stream (what the official SDKs parse): one
        ``transcript.text.delta`` event per text delta, then ``transcript.text.done`` with
        the whole text and the token usage. An error after the first event is an error
        event (``{"error": ...}``, which the SDKs raise)."""
        n_prompt = n_out = 0
        parts: list[str] = []
        started = False
        try:
            async for out, _last in _chunk_outputs(self.engine_client, rid, prompt, params, chunks,
                                                    beam_params_of(request, params)):
                o = out.outputs[0]
                n_out += len(o.token_ids)
                if out.finished:
                    n_prompt += len(out.prompt_token_ids or ())
                if not o.text:
                    continue
                parts.append(o.text)
                started = True
                yield sse(TranscriptTextDelta(delta=o.text).model_dump_json())
            usage = TranscriptTokenUsage(input_tokens=n_prompt, output_tokens=n_out, total_tokens=n_prompt + n_out)
            yield sse(TranscriptTextDone(text="".join(parts), usage=usage).model_dump_json())
        except Exception as e:
            if not started:  # before the first event: the handler answers 400 / 500
                raise
            yield sse_error(e)
        yield SSE_DONE

    async def _stream(self, request: TranscriptionRequest, name: str, rid: str, prompt: list[int],
                      params: SamplingParams, chunks: list[np.ndarray]) -> AsyncGenerator[str, None]:
        """vLLM's transcription stream: one ``transcription.chunk`` event per text delta,
        the chunks in order, ``finish_reason`` on the last, usage when asked, ``[DONE]``."""
        n_prompt = n_out = 0
        finish, stop = None, None
        started = False
        try:
            async for out, last in _chunk_outputs(self.engine_client, rid, prompt, params, chunks,
                                                    beam_params_of(request, params)):
                o = out.outputs[0]
                n_out += len(o.token_ids)
                if out.finished:
                    n_prompt += len(out.prompt_token_ids or ())
                    finish, stop = o.finish_reason, o.stop_reason
                if not o.text and not last:
                    continue
                usage = (StreamUsage(prompt_tokens=n_prompt, completion_tokens=n_out,
                                     total_tokens=n_prompt + n_out)
                         if request.stream_continuous_usage_stats else None)
                started = True
                yield sse(TranscriptionStreamResponse(
                    id=rid, model=name, usage=usage, choices=[TranscriptionResponseStreamChoice(
                        delta=DeltaMessage(content=o.text), finish_reason=finish if last else None,
                        stop_reason=stop if last else None)]).model_dump_json(exclude_none=True))
            if request.stream_include_usage:
                yield sse(TranscriptionStreamResponse(id=rid, model=name, choices=[], usage=StreamUsage(
                    prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out)).model_dump_json())
        except Exception as e:
            if not started:  # before the first event: the handler answers 400 / 500
                raise
            yield sse_error(e)  # after the stream started: an error event, as vLLM
        yield SSE_DONE


def check_beam_size(request: TranscriptionRequest) -> None:
    """A 400 naming ``beam_size`` for beams at temperature > 0 (checked before the audio)."""
    if request.beam_size > 1 and request.temperature > 0:
        raise SamplingParamsError("beam_size > 1 needs temperature 0 (beam search is deterministic).", "beam_size")


def beam_params_of(request: TranscriptionRequest, params: SamplingParams) -> Optional[BeamSearchParams]:
    """``beam_size`` > 1: the engine's beam search with Whisper's stopping rule (OpenAI
    Whisper's and faster-whisper's, patience 1: done once beam_size hypotheses have ended,
    i.e. transformers' ``early_stopping=True``; with ``early_stopping=False`` clip00 of
    tests/data/audio reads "dumps" where both read "jumps"), hypotheses ranked by
    ``cum_logprob / length ** length_penalty``; a 400 naming ``beam_size`` with
    temperature > 0 (faster-whisper searches beams at temperature 0 only)."""
    check_beam_size(request)
    if request.beam_size <= 1:
        return None
    return BeamSearchParams(beam_width=request.beam_size, max_tokens=params.max_tokens,
                            length_penalty=request.length_penalty, early_stopping=True)


def _generate(engine_client: Any, prompt: list[int], params: SamplingParams, chunk: np.ndarray, rid: str,
              beam: Optional[BeamSearchParams]) -> AsyncGenerator[Any, None]:
    """One audio chunk's engine request: greedy/sampled, or the beam search (its best
    beam first: one final output)."""
    inputs = {"prompt_token_ids": prompt, "multi_modal_data": {"audio": (chunk, SAMPLE_RATE)}}
    if beam is None:
        return engine_client.generate(inputs, params, rid)
    return engine_client.beam_search(inputs, rid, beam, sampling_params=params)


async def _chunk_outputs(engine_client: Any, rid: str, prompt: list[int], params: SamplingParams,
                         chunks: list[np.ndarray], beam: Optional[BeamSearchParams] = None,
                         ) -> AsyncGenerator[tuple[Any, bool], None]:
    """Each engine output of each audio chunk in order, with whether it is the very last."""
    for i, chunk in enumerate(chunks):
        gen = _generate(engine_client, prompt, params, chunk, f"{rid}-{i}", beam)
        async for out in gen:
            yield out, out.finished and i == len(chunks) - 1


async def _prepend(first: str, rest: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    yield first
    async for item in rest:
        yield item
