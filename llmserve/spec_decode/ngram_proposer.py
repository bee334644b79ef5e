"""Prompt-lookup drafting (vLLM's ``NgramProposer``; Saxena 2023, "prompt lookup decoding").

For a request whose tokens are ``t[0..L)``, find the latest earlier occurrence of its last
``n`` tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose the
``k`` tokens that followed it. Plain Python, no torch (it runs in the scheduler).

Cost: an index per request maps each n-gram (a tuple of n token ids) to the position just
after its latest occurrence, kept up to date as tokens are appended, so a lookup is
``max - min + 1`` dict probes instead of a scan of the whole sequence (a scan in Python
took ~1 ms per 2k-token request per step; the index costs ``max - min + 1`` dict writes
per new token).
"""
from __future__ import annotations

from typing import Sequence


class NgramIndex:
    """n-gram -> end position (exclusive) of its latest occurrence in one token sequence.

    Only occurrences that end before the sequence's last token are indexed at lookup time,
    so the suffix never matches itself. The sequence must only grow; ``propose`` rebuilds
    the index when it got shorter (a new prompt from streaming input)."""

    __slots__ = ("n_min", "n_max", "table", "indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.table: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions < indexed are in the table

    def _extend(self, tokens: Sequence[int], upto: int) -> None:
        """Index the n-grams that end at positions [indexed, upto) (exclusive ends)."""
        table, lo, hi = self.table, self.n_min, self.n_max
        for end in range(max(self.indexed, lo), upto + 1):
            for n in range(lo, min(hi, end) + 1):
                table[tuple(tokens[end - n:end])] = end
        self.indexed = upto + 1

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft token ids continuing ``tokens`` (empty: no match)."""
        L = len(tokens)
        if k <= 0 or L <= self.n_min:
            return []
        if self.indexed > L:
            self.table.clear()
            self.indexed = 0
        self._extend(tokens, L - 1)  # ends up to L - 1: every n-gram but the suffix itself
        table = self.table
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            end = table.get(tuple(tokens[L - n:]))
            if end is not None:
                return _continuation(tokens, end, k)
        return []


def _continuation(tokens: Sequence[int], end: int, k: int) -> list[int]:
    """The ``k`` tokens after position ``end``, where the ones past the sequence's end are
    the draft's own earlier tokens (an LZ77-style overlapping copy): a match ``p`` tokens
    before the end means the text repeats with period ``p``, so a loop of 1 token still
    drafts ``k``."""
    L = len(tokens)
    out = list(tokens[end:min(end + k, L)])
    while len(out) < k:
        out.append(out[len(out) - (L - end)])
    return out
