"""Passkey retrieval in the Landmark-attention format (Mohtashami & Jaggi 2023, Sec. 4.2).

Landmark's run_test.py builds: task description, repeated filler ("The grass is green. ..."), the
line "The pass key is {key}. Remember it. {key} is the pass key.", more filler, and the question
"What is the pass key? The pass key is". The key has 5 digits here. The task description is the
prompt template's (kvcompress/datasets/tasks.py); `context` holds filler, key line and filler, one
part per line as Landmark joins them. The filler is cut at whole sentences: the largest count that
keeps the built prompt within `context_tokens` model tokens. The key line goes after
round(depth * sentences) filler sentences; `depth=None` draws the depth uniformly (Landmark draws
the prefix length uniformly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import DatasetConfig, check_depth, encode_prompt, fit_largest, metadata_json

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


def filler(count: int) -> str:
    return " ".join(FILLER[i % len(FILLER)] for i in range(count))


@dataclass(frozen=True)
class Passkey(DatasetConfig):
    """Landmark-attention passkey retrieval: a 5-digit key in repeated filler at a depth."""

    name: ClassVar[str] = "passkey"
    context_tokens: int = 1024
    depth: float | None = None
    num_samples: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_depth(self.depth)
        self.check_num_samples(allow_all=False)

    def sample(self, index: int, tokenizer) -> dict:
        rng = self.rng(index)
        key = str(rng.randint(10_000, 99_999))
        depth = rng.random() if self.depth is None else float(self.depth)
        line = KEY_LINE.format(key=key)

        def build(sentences: int) -> str:
            before = round(depth * sentences)
            parts = [filler(before), line, filler(sentences - before)]  # both restart the filler, as Landmark's
            return "\n".join(p for p in parts if p)

        def measure(sentences: int) -> int:
            return len(encode_prompt(tokenizer, "passkey", build(sentences), QUESTION))

        sentences = fit_largest(measure, self.context_tokens, upper=self.context_tokens)
        context = build(sentences)
        depth_label = "rand" if self.depth is None else f"{float(self.depth):g}"
        return {
            "id": f"passkey-{self.context_tokens}-d{depth_label}-s{self.seed}-{index}",
            "task": "passkey",
            "context": context,
            "question": QUESTION,
            "answers": [key],
            "context_tokens": len(encode_prompt(tokenizer, "passkey", context, QUESTION)),
            "metadata": metadata_json(
                passkey=key, depth=depth, key_char=context.index(line), filler_sentences=sentences,
                evidence_chars=[[context.index(line), context.index(line) + len(line)]],
                seed=self.seed, index=index,
            ),
        }
