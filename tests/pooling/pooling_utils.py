"""Helpers of the pooling tests."""
from __future__ import annotations

import random

WORDS = ("the quick brown fox jumps over a lazy dog while engineers measure embeddings of "
         "sentences about rivers mountains cities music science history coffee trains rain "
         "Paris Tokyo 42 3.14 don't can't e-mail naïve café résumé GPU CPU kernel batch").split()


def make_sentences(n: int, lo: int = 3, hi: int = 120, seed: int = 0) -> list[str]:
    """``n`` sentences of lo..hi words drawn from a fixed vocabulary (deterministic)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."
            for _ in range(n)]
