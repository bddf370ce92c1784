"""What every dataset shares: the schema, the config base, prompts in model tokens, sizing.

Every dataset is a frozen dataclass config (as methods are) that validates itself in
`__post_init__` without doing any work, and builds its `datasets.Dataset` in `load(tokenizer)`.
Sizes are in model tokens of the prompt the runner feeds (`prompt_tokens`), so a dataset built
for one tokenizer is sized for that model only.
"""

from __future__ import annotations

import json
import random
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, ClassVar

from ..methods.base import ConfigError, check
from .tasks import task_of

MIN_CONTEXT_TOKENS = 256  # NIAH multiquery's chat template, instruction, question and needles take ~175
MAX_CONTEXT_TOKENS = 131072


def features():
    import datasets

    return datasets.Features({
        "id": datasets.Value("string"),
        "task": datasets.Value("string"),
        "context": datasets.Value("string"),
        "question": datasets.Value("string"),
        "answers": datasets.List(datasets.Value("string")),
        "context_tokens": datasets.Value("int64"),  # model tokens of prompt_tokens(sample)
        "metadata": datasets.Value("string"),  # JSON
    })


def to_dataset(rows: list[dict]):
    import datasets

    return datasets.Dataset.from_list(rows, features=features())


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class DatasetConfig:
    """Base config: subclasses set `name` and declare `context_tokens`, `num_samples`, `seed`."""

    name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check(
            is_int(self.context_tokens) and MIN_CONTEXT_TOKENS <= self.context_tokens <= MAX_CONTEXT_TOKENS,
            "context_tokens", f"an int in [{MIN_CONTEXT_TOKENS}, {MAX_CONTEXT_TOKENS}]", self.context_tokens,
        )
        check(is_int(self.seed), "seed", "an int", self.seed)

    def check_num_samples(self, allow_all: bool) -> None:
        ok = (is_int(self.num_samples) and self.num_samples >= 1) or (allow_all and self.num_samples is None)
        check(ok, "num_samples", "an int >= 1" + (" or None (all rows)" if allow_all else ""), self.num_samples)

    def load(self, tokenizer):
        raise NotImplementedError

    def rng(self, index: int) -> random.Random:
        """Sample `index`'s own generator: sample i is the same whatever num_samples is."""
        return random.Random(f"{self.name}:{self.seed}:{index}")

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(cls)}


def check_depth(depth: Any) -> None:
    ok = depth is None or (isinstance(depth, (int, float)) and not isinstance(depth, bool) and 0.0 <= depth <= 1.0)
    check(ok, "depth", "a float in [0, 1] or None (seeded random depths)", depth)


def resolve_tokenizer(tokenizer):
    """None means the embedded model's tokenizer."""
    if tokenizer is None:
        from ..model import load_tokenizer

        return load_tokenizer()
    return tokenizer


def _ids(encoded) -> list[int]:
    """apply_chat_template returns a list, or a BatchEncoding in some transformers versions."""
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    encoded = list(encoded)
    if encoded and isinstance(encoded[0], list):
        encoded = encoded[0]
    return [int(t) for t in encoded]


def encode_prompt(tokenizer, task_name: str, context: str, question: str) -> list[int]:
    """Model tokens of a task's prompt: the filled template, in the chat template where it applies."""
    task = task_of({"task": task_name})
    text = task.template.format(context=context, question=question)
    if task.chat and getattr(tokenizer, "chat_template", None):
        return _ids(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    return _ids(tokenizer.encode(text))


def prompt_tokens(sample: dict, tokenizer) -> list[int]:
    """The exact prompt the runner feeds the model for `sample`."""
    return encode_prompt(tokenizer, sample["task"], sample["context"], sample["question"])


def fit_largest(measure: Callable[[int], int], target: int, upper: int) -> int:
    """Largest n in [0, upper] with measure(n) <= target, for a (nearly) nondecreasing measure.

    Raises a ConfigError when even n = 0 (the prompt without filler) is over the target.
    """
    if measure(0) > target:
        raise ConfigError(f"context_tokens: expected at least {measure(0)} for this prompt and tokenizer "
                          f"(its fixed parts alone take that many tokens), got {target}")
    low, high = 0, upper
    while low < high:
        mid = (low + high + 1) // 2
        if measure(mid) <= target:
            low = mid
        else:
            high = mid - 1
    return low


def truncate_middle(tokenizer, text: str, keep_tokens: int) -> str:
    """Keep the first and last keep_tokens/2 tokens of `text` (LongBench pred.py's truncation)."""
    ids = _ids(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) <= keep_tokens:
        return text
    half = keep_tokens // 2
    return tokenizer.decode(ids[:half]) + tokenizer.decode(ids[len(ids) - (keep_tokens - half):])


def fit_context(tokenizer, task_name: str, context: str, question: str, target: int) -> tuple[str, int]:
    """(context, prompt tokens): the context cut in the middle until the whole prompt fits `target`.

    Decoding and re-encoding the two halves can shift a few tokens, so the cut is repeated with the
    overshoot taken off until the built prompt is within the target.
    """
    length = len(encode_prompt(tokenizer, task_name, context, question))
    if length <= target:
        return context, length
    overhead = length - len(_ids(tokenizer.encode(context, add_special_tokens=False)))
    keep = max(target - overhead, 0)
    while True:
        cut = truncate_middle(tokenizer, context, keep)
        length = len(encode_prompt(tokenizer, task_name, cut, question))
        if length <= target or keep == 0:
            return cut, length
        keep = max(keep - (length - target), 0)


def metadata_json(**values: Any) -> str:
    return json.dumps(values, sort_keys=True)


def unknown_params(cls: type[DatasetConfig], params: dict[str, Any]) -> None:
    allowed = [f.name for f in fields(cls)]
    for key in params:
        if key not in allowed:
            raise ConfigError(f"{key}: not a parameter of dataset {cls.name!r}; expected one of {allowed}")
