"""Audio for speech-to-text models: decode, resample to 16 kHz, split, log-mel features.

Decoding: ``soundfile`` (libsndfile: wav, flac, ogg/vorbis/opus...) and PyAV (FFmpeg: mp3,
webm, m4a, anything else), both from PyPI wheels. Resampling: ``soxr`` (the resampler
librosa uses by default). Features: OpenAI Whisper's log-mel (80 or 128 bins, 10 ms hop,
30 s windows) with its padding, which faster-whisper reproduces (see ``whisper_features``).
Long audio is cut into <= 30 s chunks at the quietest 0.1 s near each boundary, as vLLM's ``_split_audio`` does.
"""
from __future__ import annotations

import functools
import io
from typing import Any

import numpy as np

SAMPLE_RATE = 16000
CHUNK_SECONDS = 30
# vLLM (SpeechToTextConfig): look for the split point in the last second before the
# chunk limit, in windows of 1600 samples (0.1 s), and cut at the one with least energy.
_OVERLAP_SECONDS = 1
_ENERGY_WINDOW = 1600


class AudioDecodeError(ValueError):
    """The bytes are not audio any decoder here can read."""


def decode_audio(data: bytes) -> tuple[np.ndarray, int]:
    """Encoded audio (wav, flac, ogg, mp3, webm, m4a...) -> (mono float32 samples in
    [-1, 1], sample rate). Raises AudioDecodeError when nothing can decode it or it holds
    no samples."""
    if not data:
        raise AudioDecodeError("the audio file is empty")
    try:
        import soundfile as sf
        samples, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
        samples = samples.mean(axis=1)
    except Exception:  # not a libsndfile format: try FFmpeg
        samples, sr = _decode_av(data)
    if samples.size == 0:
        raise AudioDecodeError("the audio file holds no samples")
    return np.ascontiguousarray(samples, dtype=np.float32), int(sr)


def probe_audio(data: bytes) -> None:
    """Raise the AudioDecodeError :func:`decode_audio` raises for ``data`` when it shows
    without decoding: empty, or no decoder opens it (libsndfile reads the header, FFmpeg
    probes the container), or it has no audio stream. Audio that opens and then fails to
    decode passes. It reads headers only, where decoding reads every frame: admission's
    check of a request it would refuse (admission_precheck.py)."""
    if not data:
        raise AudioDecodeError("the audio file is empty")
    try:
        import soundfile as sf
        sf.info(io.BytesIO(data))
        return
    except Exception:  # not a libsndfile format: FFmpeg's probe, as decode_audio falls back
        pass
    try:
        import av
        with av.open(io.BytesIO(data), mode="r") as container:
            if not any(s.type == "audio" for s in container.streams):
                raise AudioDecodeError("the file has no audio stream")
    except AudioDecodeError:
        raise
    except Exception as e:
        raise AudioDecodeError(f"cannot decode the audio file: {e}") from None


def _decode_av(data: bytes) -> tuple[np.ndarray, int]:
    try:
        import av
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None:
                raise AudioDecodeError("the file has no audio stream")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            chunks = []
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except AudioDecodeError:
        raise
    except Exception as e:
        raise AudioDecodeError(f"cannot decode the audio file: {e}") from None
    return (np.concatenate(chunks) if chunks else np.zeros(0, np.float32)), SAMPLE_RATE


def to_mono_16k(samples: Any, sample_rate: int) -> np.ndarray:
    """Samples (``[n]`` or ``[n, channels]``, any numeric dtype) at ``sample_rate`` ->
    mono float32 at 16 kHz (soxr, high quality). Raises ValueError for a bad rate or
    non-finite samples."""
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim == 2:
        x = x.mean(axis=1)
    if x.ndim != 1:
        raise ValueError(f"audio must be 1-D samples (or [samples, channels]), got shape {x.shape}")
    if not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
        raise ValueError(f"audio sample rate must be a positive integer, got {sample_rate!r}")
    if not np.isfinite(x).all():
        raise ValueError("audio samples must be finite")
    if sample_rate != SAMPLE_RATE and x.size:
        import soxr
        x = soxr.resample(x, int(sample_rate), SAMPLE_RATE, quality="HQ").astype(np.float32)
    return x


def split_audio(x: np.ndarray, chunk_seconds: int = CHUNK_SECONDS) -> list[np.ndarray]:
    """16 kHz samples -> chunks of at most ``chunk_seconds``, each cut (after the first)
    at the quietest 0.1 s window of the last second before the limit (vLLM)."""
    limit = chunk_seconds * SAMPLE_RATE
    chunks, start = [], 0
    while x.size - start > limit:
        lo = start + limit - _OVERLAP_SECONDS * SAMPLE_RATE
        seg = x[lo:start + limit]
        n = seg.size // _ENERGY_WINDOW
        energy = (seg[:n * _ENERGY_WINDOW].reshape(n, _ENERGY_WINDOW) ** 2).mean(axis=1)
        cut = lo + int(np.argmin(energy)) * _ENERGY_WINDOW + _ENERGY_WINDOW // 2
        chunks.append(x[start:cut])
        start = cut
    chunks.append(x[start:])
    return chunks


N_FFT = 400
HOP_LENGTH = 160
N_FRAMES = CHUNK_SECONDS * SAMPLE_RATE // HOP_LENGTH  # 3000 log-mel frames per 30 s window


@functools.lru_cache(maxsize=4)
def _mel_filters(num_mel_bins: int):
    """Slaney mel filters ``[num_mel_bins, N_FFT // 2 + 1]`` float32 (librosa's, as
    OpenAI's ``mel_filters.npz`` and transformers' WhisperFeatureExtractor)."""
    import torch
    from transformers.audio_utils import mel_filter_bank
    fb = mel_filter_bank(num_frequency_bins=N_FFT // 2 + 1, num_mel_filters=num_mel_bins, min_frequency=0.0,
                         max_frequency=SAMPLE_RATE / 2, sampling_rate=SAMPLE_RATE, norm="slaney",
                         mel_scale="slaney")
    return torch.from_numpy(np.ascontiguousarray(fb.T, dtype=np.float32))


def whisper_features(x: np.ndarray, num_mel_bins: int = 80) -> np.ndarray:
    """<= 30 s of 16 kHz samples -> log-mel ``[num_mel_bins, 3000]`` float32, as OpenAI
    Whisper's ``transcribe()`` (and faster-whisper) feed the encoder: the audio padded with
    30 s of zeros, STFT (400-point Hann, hop 160), log10 mel power clamped to max - 8,
    ``(x + 4) / 4``; the clip's own frames (``len(x) // 160``) kept and the rest of the
    3000 frames zero *in log-mel space* (``pad_or_trim`` of the mel segment).

    transformers' WhisperFeatureExtractor (vLLM) pads the audio instead, which gives the
    log-mel of silence after the clip; the model was trained on OpenAI's padding, and on
    short clips the two decode differently (3 of the 20 test clips with whisper-base).
    Raises ValueError past 30 s."""
    import torch
    if x.size > CHUNK_SECONDS * SAMPLE_RATE:
        raise ValueError(f"audio of {x.size / SAMPLE_RATE:.1f} s is longer than Whisper's "
                         f"{CHUNK_SECONDS} s window; split it first")
    audio = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    audio = torch.nn.functional.pad(audio, (0, CHUNK_SECONDS * SAMPLE_RATE))
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=torch.hann_window(N_FFT), return_complex=True)
    mel = _mel_filters(num_mel_bins) @ (stft[..., :-1].abs() ** 2)
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    log_spec = (log_spec + 4.0) / 4.0
    content = x.size // HOP_LENGTH
    out = np.zeros((num_mel_bins, N_FRAMES), dtype=np.float32)
    out[:, :content] = log_spec[:, :content].numpy()
    return out
