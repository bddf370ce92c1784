"""The RULER synthetic suite (Hsieh et al. 2024, "RULER: What's the real context size of your
long-context language models?"), generated offline in model tokens.

Tasks, as RULER's scripts/synthetic.yaml configures them:

- niah_single_1/2/3: one needle in repeated noise / the essays / the essays with UUID values;
- niah_multikey_1/2/3: the needle among 3 distractor needles / among a haystack made of needles
  (numbers) / among a haystack of needles with UUID keys and values;
- niah_multivalue: one key with 4 values; niah_multiquery: 4 keys asked at once;
- vt: variable tracking, one chain of 4 hops in noise, with one in-context example;
- cwe: common words extraction (10 common words x6 among words seen once; one example);
- fwe: frequent words extraction (coded words drawn from a zeta(2) distribution);
- qa_1 / qa_2: SQuAD v2.0 / HotpotQA (distractor) questions with their gold paragraphs among
  distractor documents ("Document i:"), loaded through `datasets.load_dataset` from the hub, or
  from local files in the hub's schema (`qa_files`); scored with `string_match_part`. Not in the
  default task list (they need the hub or files).

Every prompt is the RULER task template (constants.py) as one chat user turn, then the chat
template's generation prompt, then RULER's answer prefix; the whole prompt plus the task's answer
budget (`tokens_to_generate`) fits `context_tokens`, as RULER sizes it (binary search on the
haystack). Scores: `string_match_all`. Each sample records the character spans of its evidence
(needles, chain assignments) in `metadata.evidence_chars`, turned into prompt token spans by
`build_prompt`. Departures from RULER's generator are listed in `docs/datasets.md`.
"""

from __future__ import annotations

import functools
import random
import string
import uuid
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from ..errors import ConfigError, check, is_int
from . import essays
from .base import DatasetConfig, encode_prompt, fit_largest, metadata_json, resolve_tokenizer, to_dataset
from .hf import _is_files, load_rows
from .niah import DEPTHS, KEYS, niah_question
from .tasks import TASKS

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# task -> (haystack, key type, value type, keys, values per key, keys asked)
NIAH: dict[str, tuple[str, str, str, int, int, int]] = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
}
OFFLINE_TASKS = (*NIAH, "vt", "cwe", "fwe")
# qa_1 / qa_2: RULER's SQuAD (v2.0 dev) and HotpotQA (distractor dev) through the hub loader:
# (hub path, config, split). `qa_files` points at local JSON/JSONL/Parquet files in the same schema.
QA_SOURCES = {"qa_1": ("rajpurkar/squad_v2", None, "validation"), "qa_2": ("hotpotqa/hotpot_qa", "distractor", "validation")}
TASK_NAMES = (*OFFLINE_TASKS, *QA_SOURCES)
DOCUMENT = "Document {i}:\n{document}"

VT_HOPS = 4
VT_EXAMPLE_TOKENS = 500  # RULER builds its in-context example with max_seq_length=500
CWE_COMMON, CWE_REPEATS, CWE_EXAMPLE_WORDS = 10, 6, 20  # RULER's values below 4096 tokens
FWE_ALPHA, FWE_WORD_LEN = 2.0, 6


def answer_budget(task: str) -> int:
    return TASKS[task].max_answer_tokens


def random_value(rng: random.Random, kind: str) -> str:
    """RULER's needle keys and values: adjective-noun words, 7-digit numbers or UUID4 strings."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return rng.choice(KEYS)


def join_tracked(pieces: list[tuple[str, bool]], sep: str) -> tuple[str, list[list[int]]]:
    """(text, [start, end) character span of each evidence piece) of pieces joined by `sep`."""
    spans, position = [], 0
    for text, evidence in pieces:
        if evidence:
            spans.append([position, position + len(text)])
        position += len(text) + len(sep)
    return sep.join(text for text, _ in pieces), spans


def insert_at_fractions(lines: list[tuple[str, bool]], needles: list[str], fractions: list[float]) -> None:
    """Insert needles between `lines` at seeded fractions of their count (RULER draws the indices
    uniformly; drawing fractions once keeps a sample's layout the same while the haystack is sized)."""
    count = len(lines)
    for index, needle in sorted(zip((int(f * count) for f in fractions), needles), key=lambda p: -p[0]):
        lines.insert(index, (needle, True))


@dataclass
class Built:
    """One sample at one haystack size: what `build_prompt` needs, plus metadata."""

    context: str
    question: str
    answers: list[str]
    answer_prefix: str
    evidence_chars: list[list[int]]
    few_shot: str = ""
    info: dict[str, Any] | None = None
    # further questions about the same context: (question, answers, answer prefix, evidence spans)
    more: list[tuple[str, list[str], str, list[list[int]]]] | None = None

    def rows(self) -> list["Built"]:
        """One Built per question, all on this context."""
        first = Built(self.context, self.question, self.answers, self.answer_prefix, self.evidence_chars,
                      self.few_shot, self.info)
        return [first] + [Built(self.context, q, a, p, e, self.few_shot, self.info) for q, a, p, e in self.more or []]


def niah(task: str, rng: random.Random, tag: str, questions: int = 1) -> tuple[Callable[[int], Built], int]:
    """RULER niah.py: needles "One of the special magic {numbers|uuids} for KEY is: VALUE." in a
    haystack of noise sentences, essay sentences or distractor needles.

    `questions` > 1 asks that many questions about one haystack, each about its own key(s); the
    haystack then holds at least questions x (keys asked) keys, so each needle is another
    question's distractor."""
    haystack, key_kind, value_kind, num_keys, values_per_key, num_asked = NIAH[task]
    num_keys = max(num_keys, questions * num_asked)
    keys: list[str] = []
    while len(keys) < num_keys:
        key = random_value(rng, key_kind)
        keys += [key] if key not in keys else []
    values = [[random_value(rng, value_kind) for _ in range(values_per_key)] for _ in keys]
    needles = [f"One of the special magic {value_kind} for {key} is: {value}."
               for key, vs in zip(keys, values) for value in vs]
    rng.shuffle(needles)
    drawn = rng.sample(range(num_keys), num_asked * questions)
    asked_sets = [drawn[j * num_asked:(j + 1) * num_asked] for j in range(questions)]

    def ask(asked: list[int]) -> tuple[str, list[str], str, list[str]]:
        names = [keys[k] for k in asked]
        query = ", ".join(names[:-1]) + ", and " + names[-1] if len(names) > 1 else names[0]
        question, answer_prefix = niah_question(query, one=num_asked * values_per_key == 1, kind=value_kind)
        return question, [value for k in asked for value in values[k]], answer_prefix, names

    asks = [ask(a) for a in asked_sets]
    if haystack == "essay":
        depths = rng.sample(DEPTHS, len(needles))
        start = rng.choice(essays.sentence_starts())
    else:
        fractions = [rng.random() for _ in needles]

    def distractor(i: int) -> str:
        line_rng = random.Random(f"{tag}:distractor:{i}")
        key = random_value(line_rng, key_kind)
        while key in keys:  # a distractor never carries an asked key (RULER does not check)
            key = random_value(line_rng, key_kind)
        return f"One of the special magic {value_kind} for {key} is: {random_value(line_rng, value_kind)}."

    def build(size: int) -> Built:
        if haystack == "essay":  # size = words of the essay window; needles between sentences
            sents = essays.sentences(essays.window(start, size))
            slots = sorted(int(len(sents) * d) for d in depths)  # RULER: int(len(sents) * depth)
            pieces, cursor = [], 0
            for slot, needle in zip(slots, needles):
                pieces += [(s, False) for s in sents[cursor:slot]] + [(needle, True)]
                cursor = slot
            pieces += [(s, False) for s in sents[cursor:]]
            context, spans = join_tracked(pieces, " ")
        else:  # size = haystack lines, joined by newlines
            lines = [(NOISE if haystack == "noise" else distractor(i), False) for i in range(size)]
            insert_at_fractions(lines, needles, fractions)
            context, spans = join_tracked(lines, "\n")
        # a question's evidence: the needles of the keys it asks (the others are its distractors)
        texts = sorted(needles, key=context.index)
        rows = [(q, a, p, [span for span, text in zip(spans, texts) if any(f" for {n} is: " in text for n in names)])
                for q, a, p, names in asks]
        (question, answers, answer_prefix, evidence), more = rows[0], rows[1:]
        return Built(context, question, answers, answer_prefix, evidence,
                     info={"keys": keys, "asked": asks[0][3], "needles": needles, "haystack": haystack}, more=more)

    return build, 10**9


def vt_chain(rng: random.Random) -> tuple[list[str], str, list[str]]:
    """(variable names, value, assignment lines) of one chain (RULER variable_tracking.py)."""
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        names += [name] if name not in names else []
    value = str(rng.randint(10000, 99999))
    lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(VT_HOPS)]
    return names, value, lines


def vt_text(names, value, lines, fractions, size) -> tuple[str, str, str, list[list[int]]]:
    """(context, question, answer prefix, evidence spans): the chain in `size` noise lines."""
    noise = [(NOISE, False) for _ in range(size)]
    for j, index in enumerate(sorted(int(f * size) for f in fractions)):
        noise.insert(index + j, (lines[j], True))  # RULER inserts at sorted positions + j
    context, spans = join_tracked(noise, "\n")
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    prefix = (f" Answer: According to the chain(s) of variable assignment in the text above, {VT_HOPS + 1} "
              f"variables are assigned the value {value}, they are: ")
    return context, question, prefix, spans


def vt(task: str, rng: random.Random, tag: str, tokenizer) -> tuple[Callable[[int], Built], int]:
    """RULER variable_tracking.py: one 4-hop chain in noise, after one solved example of ~500 tokens."""
    example_chain = vt_chain(rng)
    example_fractions = [rng.random() for _ in range(VT_HOPS + 1)]
    names, value, lines = vt_chain(rng)
    fractions = [rng.random() for _ in range(VT_HOPS + 1)]
    template = TASKS["vt"].template

    def example(size: int) -> str:
        context, question, prefix, _ = vt_text(*example_chain, example_fractions, size)
        return template.format(context=context, question=question) + prefix + " " + " ".join(example_chain[0]) + "\n"

    def example_tokens(size: int) -> int:
        return len(tokenizer.encode(example(size), add_special_tokens=False))

    few_shot = example(fit_largest(example_tokens, VT_EXAMPLE_TOKENS, upper=VT_EXAMPLE_TOKENS))

    def build(size: int) -> Built:
        context, question, prefix, spans = vt_text(names, value, lines, fractions, size)
        return Built(context, question, list(names), prefix, spans, few_shot, info={"chain": lines})

    return build, 10**9


@functools.lru_cache(maxsize=1)
def essay_vocabulary() -> tuple[str, ...]:
    """Distinct lower-case alphabetic words of the essays (3-12 letters, punctuation around them
    stripped): the word pool of cwe (RULER draws from wonderwords' noun, adjective and verb lists)."""
    stripped = (x.strip(".,;:!?\"'()[]") for x in essays.words())
    return tuple(sorted({w for w in stripped if w.isalpha() and w.islower() and w.isascii() and 3 <= len(w) <= 12}))


def cwe_list(words: list[str], repeats: int, shuffle_seed: str) -> tuple[str, list[str]]:
    """(numbered list "1. w 2. w ...", common words): the first 10 words `repeats` times, the rest once."""
    common, rare = words[:CWE_COMMON], words[CWE_COMMON:]
    items = common * repeats + rare
    random.Random(shuffle_seed).shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), common


def cwe(task: str, rng: random.Random, tag: str) -> tuple[Callable[[int], Built], int]:
    """RULER common_words_extraction.py below 4096 tokens: one example of 20 words (10 common x3),
    then the list with 10 common words x6 and every other word once."""
    pool = essay_vocabulary()
    order = rng.sample(pool, len(pool))
    example_words = rng.sample(pool, CWE_EXAMPLE_WORDS)
    template = TASKS["cwe"].template
    question = "Question: What are the 10 most common words in the above list?"
    prefix = " Answer: The top 10 words that appear most often in the list are:"
    example_context, example_common = cwe_list(example_words, 3, f"{tag}:example")
    few_shot = (template.format(context=example_context, question=question) + prefix + " "
                + " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_common)))

    def build(size: int) -> Built:
        context, common = cwe_list(order[:CWE_COMMON + size], CWE_REPEATS, f"{tag}:list")
        return Built(context, question, common, prefix, [], few_shot)

    return build, len(pool) - CWE_COMMON


def zeta(alpha: float) -> float:
    """Riemann zeta for alpha > 1: partial sum plus the Euler-Maclaurin tail."""
    n = 10_000
    return sum(k ** -alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1) + 0.5 * n ** -alpha


def fwe(task: str, rng: random.Random, tag: str, context_tokens: int) -> tuple[Callable[[int], Built], int]:
    """RULER freq_words_extraction.py: coded 6-letter words with zeta(2) counts; the most frequent
    is replaced by '...' (noise), the next three are the answer."""
    vocab_size = (context_tokens - answer_budget("fwe")) // 50
    vocab: list[str] = []
    while len(vocab) < vocab_size:
        word = "".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LEN))
        vocab += [word] if word not in vocab else []
    vocab.sort()
    rng.shuffle(vocab)
    vocab[0] = "..."
    question = ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")
    prefix = " Answer: According to the coded text above, the three most frequently appeared words are:"
    z = zeta(FWE_ALPHA)

    def build(size: int) -> Built:
        words = [w for k, w in enumerate(vocab, start=1) for _ in range(int(size * k ** -FWE_ALPHA / z))]
        random.Random(f"{tag}:shuffle").shuffle(words)
        return Built(" ".join(words), question, vocab[1:4], prefix, [])

    return build, 10**9


@functools.lru_cache(maxsize=4)
def load_qa(task: str, files: str | tuple[str, ...] | None) -> tuple[list[dict], list[str]]:
    """RULER qa.py's reading of SQuAD / HotpotQA: every answerable question with the indices of its
    gold documents (and, for SQuAD, the other paragraphs of its article), and the sorted documents."""
    path, config, split = QA_SOURCES[task]
    if files is None:
        rows = load_rows(path, config=config, split=split)
    else:
        listed = [files] if isinstance(files, str) else list(files)
        builder = "parquet" if all(f.endswith(".parquet") for f in listed) else "json"
        rows = load_rows(builder, data_files=listed, split="train")
    rows = rows.to_list()
    if task == "qa_1":  # SQuAD v2: id, title, context, question, answers {text, answer_start}
        docs = sorted({r["context"] for r in rows})
        index = {d: i for i, d in enumerate(docs)}
        article: dict[str, list[int]] = {}
        for r in rows:
            article.setdefault(r["title"], [])
            if index[r["context"]] not in article[r["title"]]:
                article[r["title"]].append(index[r["context"]])
        questions = [{"query": r["question"], "outputs": list(r["answers"]["text"]), "context": [index[r["context"]]],
                      "more": [i for i in article[r["title"]] if i != index[r["context"]]]}
                     for r in rows if r["answers"]["text"]]  # RULER skips the unanswerable ones
    else:  # HotpotQA distractor: question, answer, context {title: [...], sentences: [[...], ...]}
        def documents(r):
            return [f"{t}\n{''.join(ss)}" for t, ss in zip(r["context"]["title"], r["context"]["sentences"])]

        docs = sorted({d for r in rows for d in documents(r)})
        index = {d: i for i, d in enumerate(docs)}
        questions = [{"query": r["question"], "outputs": [r["answer"]], "context": [index[d] for d in documents(r)],
                      "more": []} for r in rows]
    return questions, docs


def qa(task: str, rng: random.Random, source: tuple[list[dict], list[str]]):
    """RULER qa.py: the question's gold documents among distractors (first the other paragraphs of
    its article, then random ones), shuffled and numbered; the size is the document count."""
    questions, docs = source
    if not questions:
        raise ConfigError(f"task: {task} has no answerable questions in its source")
    item = questions[rng.randrange(len(questions))]  # RULER takes them in file order
    more = rng.sample(item["more"], len(item["more"]))
    others = [i for i in range(len(docs)) if i not in item["context"] and i not in item["more"]]
    extra = rng.sample(others, min(len(others), 4096))
    order_seed = rng.random()

    def build(size: int) -> Built:
        count = max(size, len(item["context"]))
        chosen = item["context"] + (more + extra)[:count - len(item["context"])]
        random.Random(order_seed).shuffle(chosen)
        pieces = [(DOCUMENT.format(i=i + 1, document=docs[d]), d in item["context"]) for i, d in enumerate(chosen)]
        context, spans = join_tracked(pieces, "\n\n")
        return Built(context, f"Question: {item['query']}", item["outputs"], " Answer:", spans,
                     info={"gold_documents": len(item["context"])})

    return build, len(item["context"]) + len(item["more"]) + len(extra)


@dataclass(frozen=True)
class Ruler(DatasetConfig):
    """RULER synthetic tasks (one name or a list; default all offline ones), sized in model tokens."""

    name: ClassVar[str] = "ruler"
    task: str | list[str] | tuple[str, ...] = OFFLINE_TASKS
    context_tokens: int = 1024
    num_samples: int = 4  # contexts per task
    seed: int = 0
    questions: int = 1  # questions per context (niah tasks): one row each, consecutive rows share a context
    qa_files: dict | None = None  # {"qa_1": path(s), "qa_2": path(s)}: local files in the hub schema

    def __post_init__(self) -> None:
        names = [self.task] if isinstance(self.task, str) else self.task
        ok = isinstance(names, (list, tuple)) and len(names) > 0 and all(n in TASK_NAMES for n in names)
        check(ok, "task", f"one of {list(TASK_NAMES)} or a non-empty list of them", self.task)
        files_ok = self.qa_files is None or (isinstance(self.qa_files, dict) and set(self.qa_files) <= set(QA_SOURCES)
                                             and all(_is_files(v) for v in self.qa_files.values()))
        check(files_ok, "qa_files", f"None or a dict from {list(QA_SOURCES)} to local file path(s)", self.qa_files)
        super().__post_init__()
        self.check_num_samples(allow_all=False)
        ok = is_int(self.questions) and 1 <= self.questions <= 16
        check(ok, "questions", "an int in [1, 16]", self.questions)
        if self.questions > 1:
            check(isinstance(names, (list, tuple)) and all(n in NIAH for n in names), "task",
                  f"niah tasks only when questions > 1 (one of {list(NIAH)})", self.task)
        if "vt" in names:  # its in-context example alone takes ~500 tokens
            check(self.context_tokens >= 1024, "context_tokens", "at least 1024 when task includes 'vt'",
                  self.context_tokens)

    @property
    def tasks(self) -> tuple[str, ...]:
        return (self.task,) if isinstance(self.task, str) else tuple(self.task)

    def row_count(self) -> int:
        return self.num_samples * len(self.tasks) * self.questions

    @property
    def rows_per_context(self) -> int:
        return self.questions

    def qa_rows(self, task: str) -> tuple[list[dict], list[str]]:
        """(questions, documents) of qa_1 / qa_2, from the hub or `qa_files` (cached per config)."""
        files = (self.qa_files or {}).get(task)
        return load_qa(task, files if isinstance(files, str) else tuple(files) if files else None)

    def load(self, tokenizer=None):
        tokenizer = resolve_tokenizer(tokenizer)
        return to_dataset([row for task in self.tasks for i in range(self.num_samples)
                           for row in self.samples(task, i, tokenizer)])

    def sample(self, task: str, index: int, tokenizer) -> dict:
        """The first (with questions=1, the only) row of context `index` of `task`."""
        return self.samples(task, index, tokenizer)[0]

    def samples(self, task: str, index: int, tokenizer) -> list[dict]:
        """The rows of context `index` of `task`: one per question, all on the same context."""
        tag = f"ruler:{task}:{self.seed}:{index}"
        rng = random.Random(tag)
        if task in NIAH:
            build, upper = niah(task, rng, tag, self.questions)
        elif task in QA_SOURCES:
            build, upper = qa(task, rng, self.qa_rows(task))
        elif task == "vt":
            build, upper = vt(task, rng, tag, tokenizer)
        elif task == "cwe":
            build, upper = cwe(task, rng, tag)
        else:
            build, upper = fwe(task, rng, tag, self.context_tokens)
        budget = answer_budget(task)

        def measure(size: int) -> int:  # RULER: prompt + tokens_to_generate <= max_seq_length (every question)
            return max(len(encode_prompt(tokenizer, task, b.context, b.question, b.answer_prefix, b.few_shot))
                       for b in build(size).rows()) + budget

        if NIAH.get(task, ("",))[0] == "essay":
            upper = len(essays.words())
        size = fit_largest(measure, self.context_tokens, upper=min(upper, self.context_tokens))
        context_id = f"{task}-{self.context_tokens}-s{self.seed}-{index}"
        return [{
            "id": context_id if self.questions == 1 else f"{context_id}-q{j}",
            "task": task,
            "context": b.context,
            "question": b.question,
            "answers": b.answers,
            "context_tokens": len(encode_prompt(tokenizer, task, b.context, b.question, b.answer_prefix, b.few_shot)),
            "metadata": metadata_json(
                answer_prefix=b.answer_prefix, few_shot=b.few_shot, evidence_chars=b.evidence_chars,
                haystack_size=size, answer_budget=budget, seed=self.seed, index=index, context_id=context_id,
                question_index=j, **(b.info or {}),
            ),
        } for j, b in enumerate(build(size).rows())]
