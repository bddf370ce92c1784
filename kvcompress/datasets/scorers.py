"""Task scorers: prediction text -> score in [0, 1].

- RULER (Hsieh et al. 2024, "RULER: What's the real context size of your long-context language
  models?"), `scripts/eval/synthetic/constants.py`: `string_match_all`, the fraction of reference
  strings contained in the prediction, case-insensitively; `string_match_part` (qa): 1 when any is.
- Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"): exact match of the key, read as
  the first integer of the prediction.
- LongBench (Bai et al. 2023), `metrics.py`: `qa_f1` (SQuAD token F1 after LongBench's
  normalisation), `rouge_l`, `classification`, `retrieval`, `count`, `code_sim`. LongBench reports
  100x these; here they stay in [0, 1]. A sample's score is the maximum over its reference answers.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter

_PUNCTUATION = set(string.punctuation)


def string_match_all(prediction: str, answers: list[str]) -> float:
    """RULER's string_match_all: fraction of `answers` that occur in `prediction` (case-insensitive)."""
    if not answers:
        return 0.0
    found = prediction.lower()
    return sum(answer.lower() in found for answer in answers) / len(answers)


def string_match_part(prediction: str, answers: list[str]) -> float:
    """RULER's string_match_part (qa tasks): 1.0 when any of `answers` occurs in `prediction`
    (case-insensitive), else 0.0."""
    found = prediction.lower()
    return float(any(answer.lower() in found for answer in answers))


def passkey_match(prediction: str, passkey: str) -> float:
    """1.0 when the first integer in the prediction is the pass key, else 0.0."""
    numbers = re.findall(r"\d+", prediction)
    return float(bool(numbers) and numbers[0] == passkey)


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD normalisation: lower case, drop punctuation, articles and extra whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: list[str], reference: list[str]) -> float:
    """Harmonic mean of bag-of-tokens precision and recall."""
    same = sum((Counter(prediction) & Counter(reference)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str) -> float:
    """LongBench `qa_f1_score`: token F1 of the normalised prediction against one reference."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence (dynamic programme over one row)."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0  # row[j - 1] of the previous row
        for j, y in enumerate(b, start=1):
            above = row[j]
            row[j] = diagonal + 1 if x == y else max(row[j], row[j - 1])
            diagonal = above
    return row[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (Lin 2004, Eq. 2-4 with beta = 1): LCS over word tokens.

    Tokenised as the `rouge` package LongBench calls does it (periods split sentences and are
    dropped, whitespace splits words, case kept); the LCS runs over the whole text (sentence-level
    ROUGE-L) rather than that package's summary-level union of per-sentence LCSs. Empty text
    scores 0, as LongBench's `rouge_score` does when the package raises.
    """
    pred, ref = prediction.replace(".", " ").split(), reference.replace(".", " ").split()
    if not pred or not ref:
        return 0.0
    common = lcs_length(pred, ref)
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def classification(prediction: str, reference: str, all_classes: list[str]) -> float:
    """LongBench `classification_score`: 1/k when the reference is among the k class names found.

    A class name that is a strict substring of the reference is not counted against it. The loop
    removes from the list it iterates, as LongBench's does, so scores match the published ones.
    """
    matches = [name for name in all_classes if name in prediction]
    for name in matches:
        if name in reference and name != reference:
            matches.remove(name)
    return 1.0 / len(matches) if reference in matches else 0.0


def _fraction_equal(numbers: list[str], target: str) -> float:
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, reference: str) -> float:
    """LongBench `retrieval_score`: share of the prediction's numbers equal to "Paragraph N"'s N."""
    target = re.findall(r"Paragraph (\d+)", reference)[0]
    return _fraction_equal(re.findall(r"\d+", prediction), target)


def count(prediction: str, reference: str) -> float:
    """LongBench `count_score`: share of the prediction's numbers equal to the reference count."""
    return _fraction_equal(re.findall(r"\d+", prediction), str(reference))


def code_sim(prediction: str, reference: str) -> float:
    """LongBench `code_sim_score`: edit similarity of the first code line to the reference line.

    The first line without a backtick, '#' or '//' is the prediction (LongBench skips markdown
    fences and comments); similarity is fuzzywuzzy's `ratio` (difflib's SequenceMatcher ratio,
    rounded to a whole percent).
    """
    line = next(
        (ln for ln in prediction.lstrip("\n").split("\n") if "`" not in ln and "#" not in ln and "//" not in ln),
        "",
    )
    return round(100 * difflib.SequenceMatcher(None, line, reference).ratio()) / 100
