"""RULER needle-in-a-haystack on the Paul Graham essays (Hsieh et al. 2024, "RULER", Sec. 3.1).

Needles read "One of the special magic numbers for {key} is: {value}." with adjective-noun keys and
7-digit values, put between sentences of an essay window (scripts/data/synthetic/niah.py):

- single     (niah_single_2):   one key, one value, asked for that key;
- multikey   (niah_multikey_1): four keys, one value each; one key is asked, three are distractors;
- multivalue (niah_multivalue): one key with four values; all four are the answer;
- multiquery (niah_multiquery): four keys, one value each; all four keys are asked.

As in RULER, needles are shuffled and their depths drawn without replacement from 40 evenly spaced
depths (0 ... 1). `depth` pins the first needle of the first asked key to that depth (the others
keep their drawn depths). The prompt ends with RULER's answer prefix ("The special magic number for
KEY mentioned in the provided text is") after the chat template's generation prompt. Two departures from RULER: a needle at depth d goes to the sentence
boundary nearest to a fraction d of the haystack's characters (RULER's int(d * sentences) drifts
from d when sentence lengths vary; the original needle test also measures depth along the text),
and each sample's window starts at a seeded sentence (RULER starts every sample at the first
essay), so samples differ in haystack as well as needles. The window is the largest whole number of words that
keeps the built prompt within `context_tokens` model tokens (RULER's binary search).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from ..errors import check
from . import essays
from .base import DatasetConfig, check_depth, encode_prompt, fit_largest, metadata_json

# (keys, values per key, keys asked)
VARIANTS: dict[str, tuple[int, int, int]] = {
    "single": (1, 1, 1),
    "multikey": (4, 1, 1),
    "multivalue": (1, 4, 1),
    "multiquery": (4, 1, 4),
}
DEPTHS = tuple(round(100 * i / 39) / 100 for i in range(40))  # np.round(np.linspace(0, 100, 40)) / 100
NEEDLE = "One of the special magic numbers for {key} is: {value}."

# Keys are adjective-noun pairs, as RULER's `words` keys (drawn there from wonderwords' lists).
_ADJECTIVES = (
    "abundant adorable agreeable ancient angry bashful bitter brave bright broad calm careful cheerful "
    "clever clumsy crooked curious damp dazzling delightful eager elegant empty faithful fancy fierce "
    "fragile gentle gigantic glamorous grumpy handsome helpful hollow humble icy jolly kind lazy lively "
    "lucky magnificent mellow misty modern narrow nervous noisy obedient odd orange polite proud quaint "
    "quiet rapid rustic scary shiny silent silly sleepy smooth sparkling spicy steady stormy sturdy swift "
    "tame tender thankful tidy tiny uneven upset vast victorious wandering wide witty zealous"
).split()
_NOUNS = (
    "anchor apple badge balloon banjo basket beacon bicycle blanket bottle bridge bucket cabin camera "
    "candle canyon carpet castle cellar chimney cloud compass cottage crayon crystal desk diamond dragon "
    "drum engine feather fiddle forest fountain garden glacier guitar hammer harbor helmet island jacket "
    "kettle kitten ladder lantern lemon magnet meadow mirror mountain needle orchard otter parrot pebble "
    "pencil piano pillow planet pocket puzzle quilt rabbit ribbon river rocket saddle scarf shovel "
    "spider statue teapot thunder tiger tower trumpet tulip umbrella valley violin wagon walnut whistle"
).split()
KEYS = tuple(sorted({f"{a}-{n}" for a in _ADJECTIVES for n in _NOUNS}))


def niah_question(query: str, one: bool, kind: str = "numbers") -> tuple[str, str]:
    """(question, answer prefix) of RULER's niah template (scripts/data/synthetic/constants.py),
    with its one-value rewrite ("are all" -> "is", "numbers" -> "number") where one value is asked."""
    if one:
        kind = kind[:-1]
        return (f"What is the special magic {kind} for {query} mentioned in the provided text?",
                f" The special magic {kind} for {query} mentioned in the provided text is")
    return (f"What are all the special magic {kind} for {query} mentioned in the provided text?",
            f" The special magic {kind} for {query} mentioned in the provided text are")


@dataclass(frozen=True)
class Niah(DatasetConfig):
    """RULER needle-in-a-haystack: variant, prompt length in model tokens, needle depth."""

    name: ClassVar[str] = "niah"
    variant: str = "single"
    context_tokens: int = 1024
    depth: float | None = None
    num_samples: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        check(self.variant in VARIANTS, "variant", f"one of {sorted(VARIANTS)}", self.variant)
        super().__post_init__()
        check_depth(self.depth)
        self.check_num_samples(allow_all=False)

    @property
    def task(self) -> str:
        return f"niah_{self.variant}"

    def rng(self, index: int):
        # variants draw independently: the same seed does not give multikey the single variant's keys
        return random.Random(f"{self.task}:{self.seed}:{index}")

    def sample(self, index: int, tokenizer) -> dict:
        rng = self.rng(index)
        num_keys, values_per_key, num_asked = VARIANTS[self.variant]
        keys = rng.sample(KEYS, num_keys)
        drawn = iter(rng.sample(range(10**6, 10**7), num_keys * values_per_key))  # distinct 7-digit values
        values = [[str(next(drawn)) for _ in range(values_per_key)] for _ in keys]
        needles = [(k, value) for k in range(num_keys) for value in values[k]]
        rng.shuffle(needles)
        depths = rng.sample(DEPTHS, len(needles))
        asked = rng.sample(range(num_keys), num_asked)
        if self.depth is not None:
            pinned = next(i for i, (k, _) in enumerate(needles) if k == asked[0])
            depths[pinned] = float(self.depth)
        start = rng.choice(essays.sentence_starts())

        texts = [NEEDLE.format(key=keys[k], value=value) for k, value in needles]
        names = [keys[k] for k in asked]
        query = ", ".join(names[:-1]) + ", and " + names[-1] if len(names) > 1 else names[0]
        question, answer_prefix = niah_question(query, one=num_asked * values_per_key == 1)

        def build(num_words: int) -> tuple[str, list[int]]:
            """(context, character offset of each needle) for a window of num_words words."""
            sents = essays.sentences(essays.window(start, num_words))
            slots = [essays.nearest_boundary(sents, d) for d in depths]
            pieces: list[tuple[str, int | None]] = []  # (text, needle index or None)
            cursor = 0
            for j in sorted(range(len(texts)), key=lambda j: (slots[j], j)):
                pieces += [(s, None) for s in sents[cursor:slots[j]]]
                pieces.append((texts[j], j))
                cursor = slots[j]
            pieces += [(s, None) for s in sents[cursor:]]
            offsets, position = [0] * len(texts), 0
            for text, j in pieces:
                if j is not None:
                    offsets[j] = position
                position += len(text) + 1  # the joining space
            return " ".join(text for text, _ in pieces), offsets

        def measure(num_words: int) -> int:
            return len(encode_prompt(tokenizer, self.task, build(num_words)[0], question, answer_prefix))

        num_words = fit_largest(measure, self.context_tokens, upper=min(self.context_tokens, len(essays.words())))
        context, offsets = build(num_words)
        prompt_length = len(encode_prompt(tokenizer, self.task, context, question, answer_prefix))
        placed = sorted(range(len(texts)), key=lambda j: offsets[j])
        depth_label = "rand" if self.depth is None else f"{float(self.depth):g}"
        return {
            "id": f"{self.task}-{self.context_tokens}-d{depth_label}-s{self.seed}-{index}",
            "task": self.task,
            "context": context,
            "question": question,
            "answers": [value for k in asked for value in values[k]],
            "context_tokens": prompt_length,
            "metadata": metadata_json(
                variant=self.variant,
                keys=keys,
                asked=[keys[k] for k in asked],
                needles=[texts[j] for j in placed],
                needle_depths=[depths[j] for j in placed],
                needle_chars=[offsets[j] for j in placed],
                evidence_chars=[[offsets[j], offsets[j] + len(texts[j])] for j in placed],
                answer_prefix=answer_prefix,
                haystack_words=num_words,
                start_word=start,
                seed=self.seed,
                index=index,
            ),
        }
