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

from ..errors import ConfigError, check, is_int
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

    def load(self, tokenizer=None):
        """The dataset: one `sample(i, tokenizer)` per row (hub-backed datasets override this)."""
        tokenizer = resolve_tokenizer(tokenizer)
        return to_dataset([self.sample(i, tokenizer) for i in range(self.num_samples)])

    def sample(self, index: int, tokenizer) -> dict:
        """Row `index` in the shared schema (generated datasets implement this)."""
        raise NotImplementedError

    def row_count(self) -> int:
        """Rows `load` builds (None: all rows of a hub or local source)."""
        return self.num_samples

    @property
    def rows_per_context(self) -> int:
        """Consecutive rows that share one context (a sweep makes one shard per context)."""
        return 1

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


@dataclass(frozen=True)
class Prompt:
    """A sample's prompt in model tokens, split where the question part starts.

    `tokens[:question_start]` is the instruction and context (what a query-agnostic protocol
    compresses before any question is seen); `tokens[question_start:]` is the question, the chat
    template's generation prompt and the answer prefix. The two parts are encoded separately and
    concatenated, so both protocols feed exactly the same tokens. `evidence` holds [start, end)
    token spans of the sample's evidence (needles, chain assignments, the pass key line).
    """

    tokens: list[int]
    question_start: int
    evidence: list[tuple[int, int]]


def _hf(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's TokenizerWrapper (or the tokenizer itself)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def render_prompt(tokenizer, task_name: str, context: str, question: str, answer_prefix: str = "",
                  few_shot: str = "") -> tuple[str, int, int]:
    """(prompt text, character where `context` starts, character where the question part starts).

    The user text is `few_shot` + newline (when given) + the task template filled in; chat tasks
    wrap it in the chat template with its generation prompt; `answer_prefix` follows last, as
    RULER appends it after the model template.
    """
    task = task_of({"task": task_name})
    user = task.template.format(context=context, question=question)
    before_context = task.template[:task.template.index("{context}")].format(question=question)
    if few_shot:
        user, before_context = few_shot + "\n" + user, few_shot + "\n" + before_context
    text = user
    if task.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                             tokenize=False)
    offset = text.index(user)
    context_start = offset + len(before_context)
    return text + answer_prefix, context_start, context_start + len(context)


def build_prompt(tokenizer, task_name: str, context: str, question: str, answer_prefix: str = "",
                 few_shot: str = "", evidence_chars: list | None = None) -> Prompt:
    """Model tokens of a task's prompt, its question split and evidence spans (characters of
    `context` -> prompt tokens)."""
    task = task_of({"task": task_name})
    text, context_start, split = render_prompt(tokenizer, task_name, context, question, answer_prefix, few_shot)
    hf = _hf(tokenizer)
    raw = not (task.chat and getattr(tokenizer, "chat_template", None))  # raw text gets the tokenizer's BOS, if any
    head = hf(text[:split], add_special_tokens=raw, return_offsets_mapping=bool(evidence_chars))
    tail = _ids(hf.encode(text[split:], add_special_tokens=False)) if split < len(text) else []
    head_ids = _ids(head["input_ids"])
    spans = []
    for start, end in evidence_chars or []:
        first, last = context_start + start, context_start + end
        covered = [i for i, (a, b) in enumerate(head["offset_mapping"]) if b > first and a < last and b > a]
        spans.append((covered[0], covered[-1] + 1))
    return Prompt(head_ids + tail, len(head_ids), spans)


def encode_prompt(tokenizer, task_name: str, context: str, question: str, answer_prefix: str = "",
                  few_shot: str = "") -> list[int]:
    """Model tokens of a task's prompt (see `build_prompt`)."""
    return build_prompt(tokenizer, task_name, context, question, answer_prefix, few_shot).tokens


def sample_prompt(sample: dict, tokenizer) -> Prompt:
    """The exact prompt the runner feeds the model for `sample`, with its split and evidence."""
    meta = json.loads(sample.get("metadata") or "{}")
    return build_prompt(tokenizer, sample["task"], sample["context"], sample["question"],
                        meta.get("answer_prefix", ""), meta.get("few_shot", ""), meta.get("evidence_chars"))


def prompt_tokens(sample: dict, tokenizer) -> list[int]:
    """The exact prompt the runner feeds the model for `sample`."""
    return sample_prompt(sample, tokenizer).tokens


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
