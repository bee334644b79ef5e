"""Multimodal inputs (audio for Whisper): decoding, resampling, features."""
