"""Audio for speech-to-text models: decode, resample to 16 kHz, split, log-mel features.

Decoding: ``soundfile`` (libsndfile: wav, flac, ogg/vorbis/opus...) and PyAV (FFmpeg: mp3,
webm, m4a, anything else), both from PyPI wheels. Resampling: ``soxr`` (the resampler
librosa uses by default). Features: transformers' ``WhisperFeatureExtractor`` (80 or 128
log-mel bins over 30 s windows, 10 ms hop), the path vLLM uses. Long audio is cut into
<= 30 s chunks at the quietest 0.1 s near each boundary, as vLLM's ``_split_audio`` does.
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


@functools.lru_cache(maxsize=4)
def _feature_extractor(num_mel_bins: int):
    from transformers import WhisperFeatureExtractor
    return WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=SAMPLE_RATE)


def whisper_features(x: np.ndarray, num_mel_bins: int = 80) -> np.ndarray:
    """<= 30 s of 16 kHz samples -> log-mel ``[num_mel_bins, 3000]`` float32 (padded with
    silence to 30 s, as Whisper was trained). Raises ValueError past 30 s."""
    if x.size > CHUNK_SECONDS * SAMPLE_RATE:
        raise ValueError(f"audio of {x.size / SAMPLE_RATE:.1f} s is longer than Whisper's "
                         f"{CHUNK_SECONDS} s window; split it first")
    feats = _feature_extractor(num_mel_bins)(x, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features
    return np.ascontiguousarray(feats[0], dtype=np.float32)
