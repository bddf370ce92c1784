"""Long-text language modelling on the Paul Graham essays: teacher-forced NLL over a continuation.

A sample is a window of essay text starting at a seeded sentence: `context` is the largest whole
number of words within `context_tokens` model tokens (fed raw, no chat template) and `answers[0]`
the words that follow, within `continuation_tokens` tokens, with its leading space. Both are cut at
spaces, where a byte-level BPE pre-tokenizer splits anyway, so the context's tokens followed by the
continuation's tokens are the tokens of the whole text: the runner's targets are the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import check, is_int
from . import essays
from .base import DatasetConfig, _ids, fit_largest, metadata_json

MAX_CONTINUATION_TOKENS = 4096


@dataclass(frozen=True)
class LanguageModelling(DatasetConfig):
    """Essay text of `context_tokens` tokens; the score is the NLL of the next `continuation_tokens`."""

    name: ClassVar[str] = "lm"
    context_tokens: int = 1024
    continuation_tokens: int = 64
    num_samples: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check(is_int(self.continuation_tokens) and 2 <= self.continuation_tokens <= MAX_CONTINUATION_TOKENS,
              "continuation_tokens", f"an int in [2, {MAX_CONTINUATION_TOKENS}]", self.continuation_tokens)
        self.check_num_samples(allow_all=False)

    def sample(self, index: int, tokenizer) -> dict:
        start = self.rng(index).choice(essays.sentence_starts())

        def context_length(words: int) -> int:
            return len(_ids(tokenizer.encode(essays.window(start, words))))

        def continuation_length(words: int) -> int:
            return len(_ids(tokenizer.encode(" " + essays.window(start + context_words, words),
                                             add_special_tokens=False)))

        context_words = fit_largest(context_length, self.context_tokens,
                                    upper=min(self.context_tokens, len(essays.words()) // 2))
        continuation_words = fit_largest(continuation_length, self.continuation_tokens, upper=self.continuation_tokens)
        context = essays.window(start, context_words)
        continuation = " " + essays.window(start + context_words, continuation_words)
        return {
            "id": f"lm-{self.context_tokens}-s{self.seed}-{index}",
            "task": "lm",
            "context": context,
            "question": "",
            "answers": [continuation],
            "context_tokens": context_length(context_words),
            "metadata": metadata_json(
                start_word=start, context_words=context_words, continuation_words=continuation_words,
                continuation_tokens=continuation_length(continuation_words), seed=self.seed, index=index,
            ),
        }
