"""Tasks: how a sample becomes a prompt, how long its answer may be, and how the answer is scored.

A sample's `task` column names one entry of `TASKS`. Templates hold `{context}` and `{question}`.
`chat=True` wraps the filled template in the model's chat template as one user message (RULER and
LongBench's `build_chat`); `chat=False` feeds it raw, as LongBench does for its few-shot and code
subsets (trec, triviaqa, samsum, lcc, repobench-p) and as language modelling needs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable

from . import scorers

Scorer = Callable[[str, list[str], dict], float]  # (prediction, answers, metadata) -> [0, 1]


@dataclass(frozen=True)
class Task:
    name: str
    template: str
    scorer: Scorer | None  # None: scored by the runner (language modelling)
    max_answer_tokens: int
    chat: bool = True
    first_line_only: bool = False  # LongBench keeps only the first line for trec/triviaqa/samsum


def _best_of(metric: Callable[[str, str], float]) -> Scorer:
    """LongBench scores a prediction against every reference answer and keeps the best."""
    return lambda prediction, answers, metadata: max((metric(prediction, a) for a in answers), default=0.0)


def _ruler(prediction: str, answers: list[str], metadata: dict) -> float:
    return scorers.string_match_all(prediction, answers)


def _ruler_part(prediction: str, answers: list[str], metadata: dict) -> float:
    return scorers.string_match_part(prediction, answers)


def _passkey(prediction: str, answers: list[str], metadata: dict) -> float:
    return scorers.passkey_match(prediction, answers[0])


def _classification(prediction: str, answers: list[str], metadata: dict) -> float:
    classes = metadata.get("all_classes") or []
    return max((scorers.classification(prediction, a, classes) for a in answers), default=0.0)


# RULER's niah template (scripts/data/synthetic/constants.py) with its one-needle rewrite
# ("Some ... are" -> "A ... is", "numbers" -> "number") applied where one value is asked for.
_NIAH_ONE = (
    "A special magic number is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the number afterwards.\n{context}\n{question}"
)
_NIAH_MANY = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n{context}\n{question}"
)
# RULER's task templates (scripts/data/synthetic/constants.py) with {query} moved into {question}:
# the question part is what a query-agnostic protocol feeds after compressing the context.
_NIAH_UUID_ONE = _NIAH_ONE.replace("number", "uuid")
_RULER: dict[str, tuple[str, int]] = {
    "niah_single_1": (_NIAH_ONE, 128),
    "niah_single_2": (_NIAH_ONE, 128),
    "niah_single_3": (_NIAH_UUID_ONE, 128),
    "niah_multikey_1": (_NIAH_ONE, 128),
    "niah_multikey_2": (_NIAH_ONE, 128),
    "niah_multikey_3": (_NIAH_UUID_ONE, 128),
    "niah_multivalue": (_NIAH_MANY, 128),
    "niah_multiquery": (_NIAH_MANY, 128),
    "vt": ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
           "{question}", 30),
    "cwe": ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n{context}\n{question}", 120),
    "fwe": ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\n{question}", 50),
}
_RULER_QA = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
    "documents. Only give me the answer and do not output any other words.\n\n{question}"
)

# Landmark attention's passkey prompt (run_test.py): task description, filler with the key, question.
_PASSKEY = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there.\n{context}\n{question}"
)

# LongBench config/dataset2prompt.json ({input} renamed {question}) and dataset2maxlen.json.
_LONGBENCH: dict[str, tuple[str, Scorer, int]] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\n"
        "Story: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single "
        "phrase if possible. Do not provide any explanation.\n\nQuestion: {question}\n\nAnswer:",
        _best_of(scorers.qa_f1), 128),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, using a "
        "single phrase or sentence if possible. If the question cannot be answered based on the information in the "
        "article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or "
        "\"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on "
        "the above article as concisely as you can, using a single phrase or sentence if possible. If the question "
        "cannot be answered based on the information in the article, write \"unanswerable\". If the question is a "
        "yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\n"
        "Question: {question}\n\nAnswer:",
        _best_of(scorers.qa_f1), 128),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
        "the above text, only give me the answer and do not output any other words.\n\nQuestion: {question}\n"
        "Answer:",
        _best_of(scorers.qa_f1), 64),
    **{
        name: (
            "Answer the question based on the given passages. Only give me the answer and do not output any other "
            "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
            "passages. Only give me the answer and do not output any other words.\n\nQuestion: {question}\nAnswer:",
            _best_of(scorers.qa_f1), 32)
        for name in ("hotpotqa", "2wikimqa", "musique")
    },
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
        _best_of(scorers.rouge_l), 512),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {question}\nAnswer:",
        _best_of(scorers.rouge_l), 512),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:",
        _best_of(scorers.rouge_l), 512),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n"
        "{question}",
        _classification, 64),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. "
        "The following are some examples.\n\n{context}\n\n{question}",
        _best_of(scorers.qa_f1), 32),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n"
        "{question}",
        _best_of(scorers.rouge_l), 128),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
        "count of unique paragraphs after removing duplicates. The output format should only contain the number, "
        "such as 1, 2, 3, and so on.\n\nThe final answer is: ",
        _best_of(scorers.count), 32),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{question}\n\nPlease enter the number "
        "of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph "
        "2\", etc.\n\nThe answer is: ",
        _best_of(scorers.retrieval), 32),
    "lcc": ("Please complete the code given below. \n{context}Next line of code:\n", _best_of(scorers.code_sim), 64),
    "repobench-p": (
        "Please complete the code given below. \n{context}{question}Next line of code:\n",
        _best_of(scorers.code_sim), 64),
}
LONGBENCH_SUBSETS = tuple(_LONGBENCH)
_LONGBENCH_RAW = {"trec", "triviaqa", "samsum", "lcc", "repobench-p"}  # pred.py: no build_chat
_LONGBENCH_FIRST_LINE = {"trec", "triviaqa", "samsum"}  # eval.py: prediction.split("\n")[0]

TASKS: dict[str, Task] = {
    # RULER's niah budget (tokens_to_generate 128); the answer prefix puts the value first
    **{name: Task(name, _NIAH_ONE if name in ("niah_single", "niah_multikey") else _NIAH_MANY, _ruler, 128)
       for name in ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")},
    # The RULER synthetic suite (scripts/synthetic.yaml), budgets from its constants.py
    **{name: Task(name, template, _ruler, budget) for name, (template, budget) in _RULER.items()},
    "qa_1": Task("qa_1", _RULER_QA, _ruler_part, 32),
    "qa_2": Task("qa_2", _RULER_QA, _ruler_part, 32),
    "passkey": Task("passkey", _PASSKEY, _passkey, 8, chat=False),
    "lm": Task("lm", "{context}", None, 0, chat=False),
    # generic tasks for `hf` datasets mapped by column
    "qa": Task(
        "qa",
        "Answer the question based on the given documents. Only give me the answer and do not output any other "
        "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
        "documents. Only give me the answer and do not output any other words.\n\nQuestion: {question}\nAnswer:",
        _best_of(scorers.qa_f1), 32),
    "summarization": Task("summarization", "{context}\n\n{question}", _best_of(scorers.rouge_l), 256),
    "string_match": Task("string_match", "{context}\n\n{question}", _ruler, 64),
    **{
        name: Task(name, template, scorer, max_tokens, chat=name not in _LONGBENCH_RAW,
                   first_line_only=name in _LONGBENCH_FIRST_LINE)
        for name, (template, scorer, max_tokens) in _LONGBENCH.items()
    },
}


def task_of(sample: dict) -> Task:
    from ..errors import ConfigError

    if sample["task"] not in TASKS:
        raise ConfigError(f"task: expected one of {sorted(TASKS)}, got {sample['task']!r}")
    return TASKS[sample["task"]]


def score(sample: dict, prediction: str) -> float:
    """The sample's task score of `prediction`, in [0, 1]; NaN for language modelling (the runner
    scores it from teacher-forced NLL)."""
    task = task_of(sample)
    if task.scorer is None:
        return math.nan
    if task.first_line_only:
        prediction = prediction.lstrip("\n").split("\n")[0]
    return float(task.scorer(prediction, list(sample["answers"]), json.loads(sample["metadata"] or "{}")))
