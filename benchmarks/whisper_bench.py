"""Speech to text: llmserve vs faster-whisper (CTranslate2) on the same Whisper weights.

On the 20 espeak-ng clips of tests/data/audio (scripts/make_test_audio.py):
- word error rate of each against the known sentences;
- how many clips get identical text from both at temperature 0 (exact, after strip);
- throughput, side by side in one run, rounds alternating: llmserve serving
  ``--concurrency`` uploads at once through ``/v1/audio/transcriptions`` vs faster-whisper
  transcribing the clips one after another; medians over ``--rounds``, with the load average.

faster-whisper settings (stated, since its defaults differ): ``beam_size`` as ``--beam-size``
on both sides (default 1: llmserve decodes greedily unless asked, as vLLM; 5 is
faster-whisper's default, llmserve's engine beam search then), ``temperature=0.0`` alone (no fallback),
``without_timestamps=True`` (llmserve's json format prompts ``<|notimestamps|>``),
``language="en"``, ``condition_on_previous_text=False``, no VAD; its default
``suppress_tokens=[-1]`` / ``suppress_blank=True`` are kept (llmserve suppresses nothing,
as vLLM; on these clips that changes no token).

Both feed the encoder OpenAI Whisper's log-mel: the clip's frames, then zeros in log-mel
space up to 3000 frames (``whisper.transcribe``'s ``pad_or_trim`` of the mel segment), not
transformers' extractor's log-mel of padded silence (which made 3 of 20 clips differ).

Run: ``PYTHONPATH=$PWD python benchmarks/whisper_bench.py [--model whisper-base] [--rounds 3]``
(needs ``pip install --no-deps ctranslate2 faster-whisper``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
AUDIO = os.path.join(HERE, "..", "tests", "data", "audio")


def wer(ref: str, hyp: str) -> tuple[int, int]:
    """(word edits, reference words) after lower-casing and dropping punctuation."""
    norm = lambda s: re.sub(r"[^a-z0-9' ]", " ", s.lower()).split()  # noqa: E731
    r, h = norm(ref), norm(hyp)
    d = list(range(len(h) + 1))
    for i in range(1, len(r) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(h) + 1):
            cur = min(d[j] + 1, d[j - 1] + 1, prev + (r[i - 1] != h[j - 1]))
            prev, d[j] = d[j], cur
    return d[len(h)], len(r)


def ct2_dir(model: str, tmp: str) -> str:
    """A directory faster-whisper can load: the model's CTranslate2 files, with a split
    model.bin joined into one file."""
    from llmserve.model_loader import resolve_model
    from llmserve.model_loader.ct2_loader import manifest_parts

    view = resolve_model(model).path
    with open(os.path.join(view, "ct2_weights.json")) as f:
        source = json.load(f)["source"]
    parts = manifest_parts(view)
    out = os.path.join(tmp, "ct2")
    os.makedirs(out)
    for name in ("config.json", "tokenizer.json", "vocabulary.txt", "preprocessor_config.json"):
        if os.path.isfile(os.path.join(source, name)):
            os.symlink(os.path.join(source, name), os.path.join(out, name))
    if len(parts) == 1:
        os.symlink(parts[0], os.path.join(out, "model.bin"))
    else:
        with open(os.path.join(out, "model.bin"), "wb") as dst:
            for p in parts:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, dst)
    return out


def faster_whisper_round(fw, files: list[str], beam_size: int = 1) -> tuple[list[str], float]:
    t0 = time.perf_counter()
    texts = []
    for f in files:
        segs, _ = fw.transcribe(f, language="en", beam_size=beam_size, temperature=0.0, without_timestamps=True,
                                condition_on_previous_text=False, vad_filter=False)
        texts.append("".join(s.text for s in segs).strip())
    return texts, time.perf_counter() - t0


async def llmserve_round(port: int, model: str, files: list[str], concurrency: int,
                         beam_size: int = 1) -> tuple[list[str], float]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=3600) as client:
        async def one(f: str) -> str:
            async with sem:
                with open(f, "rb") as fh:
                    r = await client.post("/v1/audio/transcriptions",
                                          data={"model": model, "language": "en", "beam_size": str(beam_size)},
                                          files={"file": (os.path.basename(f), fh.read())})
                r.raise_for_status()
                return r.json()["text"]
        t0 = time.perf_counter()
        texts = await asyncio.gather(*(one(f) for f in files))
    return list(texts), time.perf_counter() - t0


def start_server(model: str, port: int, threads: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--kv-cache-memory", "256MiB",
           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import httpx
    for _ in range(1200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("the llmserve server exited during start-up")
        time.sleep(1)
    raise RuntimeError("the llmserve server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="whisper-base")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--clips", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="faster-whisper cpu_threads (0: all)")
    ap.add_argument("--beam-size", type=int, default=1,
                    help="both sides' beam_size (5: faster-whisper's and OpenAI Whisper's default)")
    args = ap.parse_args()
    with open(os.path.join(AUDIO, "sentences.json")) as f:
        meta = json.load(f)[:args.clips]
    files = [os.path.join(AUDIO, m["file"]) for m in meta]
    from faster_whisper import WhisperModel

    with tempfile.TemporaryDirectory() as tmp:
        fw = WhisperModel(ct2_dir(args.model, tmp), device="cpu", compute_type="float32", cpu_threads=args.threads)
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        proc = start_server(args.model, port, args.threads)
        try:
            asyncio.run(llmserve_round(port, args.model, files[:2], 2))  # warm-up
            faster_whisper_round(fw, files[:2])
            ours_t, fw_t, ours_texts, fw_texts = [], [], [], []
            for r in range(args.rounds):
                load = os.getloadavg()[0]
                ours_texts, dt = asyncio.run(llmserve_round(port, args.model, files, args.concurrency,
                                                            args.beam_size))
                ours_t.append(dt)
                fw_texts, dt2 = faster_whisper_round(fw, files, args.beam_size)
                fw_t.append(dt2)
                print(flush=True, *[f"round {r}: llmserve {len(files) / dt:.3f} clips/s ({args.concurrency} concurrent), "
                      f"faster-whisper {len(files) / dt2:.3f} clips/s (sequential), load avg {load:.1f}"])
        finally:
            proc.terminate()
            proc.wait(30)
    edits = [wer(m["text"], t) for m, t in zip(meta, ours_texts)]
    fw_edits = [wer(m["text"], t) for m, t in zip(meta, fw_texts)]
    same = sum(a.strip() == b.strip() for a, b in zip(ours_texts, fw_texts))
    for m, a, b in zip(meta, ours_texts, fw_texts):
        print(f"{m['file']}: {'=' if a.strip() == b.strip() else '!'} ours={a!r} fw={b!r}")
    ours_rate = len(files) / statistics.median(ours_t)
    fw_rate = len(files) / statistics.median(fw_t)
    print(json.dumps({
        "model": args.model, "clips": len(files), "rounds": args.rounds, "beam_size": args.beam_size,
        "wer_llmserve": round(sum(e for e, _ in edits) / sum(n for _, n in edits), 4),
        "wer_faster_whisper": round(sum(e for e, _ in fw_edits) / sum(n for _, n in fw_edits), 4),
        "identical_text": f"{same}/{len(files)}",
        "llmserve_clips_per_s": round(ours_rate, 3), "faster_whisper_clips_per_s": round(fw_rate, 3),
        "ratio": round(ours_rate / fw_rate, 3), "load_avg_1m_end": round(os.getloadavg()[0], 1)}))


if __name__ == "__main__":
    main()
