"""Regenerate tests/data/audio/: 20 known English sentences spoken by Debian's espeak-ng,
converted by sox to 16 kHz mono FLAC (a few tens of KB each), plus sentences.json; and the
clips of the behaviour cases, made as /work/shared/cases.md says (``espeak-ng -v en -s 150``,
``sox`` to 16 kHz mono 16-bit, joined with silence): ``CASE_CLIPS``.

Needs ``apt-get install -y espeak-ng sox`` (only to regenerate; tests use the committed
files). Run: ``python scripts/make_test_audio.py [out_dir]``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "The weather today is sunny with a light breeze from the west.",
    "I would like a cup of coffee and a slice of apple pie.",
    "The train to London leaves at half past nine in the morning.",
    "She sells sea shells by the sea shore.",
    "Our meeting has been moved to Thursday afternoon.",
    "The children played football in the park until it got dark.",
    "Turn left at the next corner and walk straight ahead.",
    "My favourite colour is blue and my favourite food is pasta.",
    "The library is closed on Sundays and public holidays.",
    "He opened the window to let some fresh air into the room.",
    "We need to buy milk, eggs, bread and butter.",
    "The museum has a large collection of ancient paintings.",
    "Can you help me find my keys before we leave?",
    "The doctor said that I should drink more water every day.",
    "A small boat sailed slowly across the calm lake.",
    "The computer restarted after the software update finished.",
    "They planted tomatoes and beans in the garden last spring.",
    "Thank you very much for your kind and generous help.",
]


#: Case clips: file -> what it holds, in order: a sentence (spoken), or seconds of silence.
CASE_CLIPS: dict[str, list] = {
    # C67 (speech/response-formats): clip A
    "c67_fox.flac": ["The quick brown fox jumps over the lazy dog."],
    # C69 (speech/long-audio): clip L, eight sentences 2.5 s apart (49.3 s; the case asks 45-80 s)
    "c69_sentences.flac": [x for pair in zip([
        "Sentence one: the red apple.",
        "Sentence two: the orange carrot grows slowly in the garden soil.",
        "Sentence three: the yellow banana is ripe and ready to eat today.",
        "Sentence four: the green pear fell from the tall tree last night.",
        "Sentence five: the blue berries were picked early in the morning.",
        "Sentence six: the white onion made everyone in the kitchen cry.",
        "Sentence seven: the brown potato was boiled for twenty minutes.",
        "Sentence eight: the purple plum."], [2.5] * 7 + [None]) for x in pair if x is not None],
    # C69: clip Z, two sentences 40 s apart (43.8 s)
    "c69_gap.flac": ["The first word is lantern.", 40, "The final word is zebra."],
}


def make_case_clip(parts: list, path: str, tmp: str) -> None:
    """Speak each sentence (espeak-ng -v en -s 150, sox to 16 kHz mono 16-bit), make each
    silence (sox -n ... trim 0 s), join them with sox into ``path``."""
    pieces = []
    for i, part in enumerate(parts):
        out = os.path.join(tmp, f"part{i}.wav")
        if isinstance(part, str):
            raw = os.path.join(tmp, "raw.wav")
            subprocess.run(["espeak-ng", "-v", "en", "-s", "150", "-w", raw, part], check=True)
            subprocess.run(["sox", raw, "-r", "16000", "-c", "1", "-b", "16", out], check=True)
        else:
            subprocess.run(["sox", "-n", "-r", "16000", "-c", "1", "-b", "16", out, "trim", "0", str(part)],
                           check=True)
        pieces.append(out)
    subprocess.run(["sox", *pieces, path] if len(pieces) > 1 else ["sox", pieces[0], path], check=True)


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    meta = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(SENTENCES):
            wav = os.path.join(tmp, f"{i}.wav")
            name = f"clip{i:02d}.flac"
            subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", wav, text], check=True)
            subprocess.run(["sox", wav, "-r", "16000", "-c", "1", "-b", "16",
                            os.path.join(out_dir, name)], check=True)
            meta.append({"file": name, "text": text})
        for name, parts in CASE_CLIPS.items():
            make_case_clip(parts, os.path.join(out_dir, name), tmp)
    with open(os.path.join(out_dir, "sentences.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "data", "audio"))
