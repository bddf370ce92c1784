"""Samples made by RULER's own generator (NVIDIA/RULER `scripts/data/prepare.py`), in our schema.

RULER writes one JSON line per sample: `input` (the task template filled in, after any solved
example), `outputs` (the expected values), `answer_prefix` and `length` (its prompt tokens plus the
answer budget). `from_ruler_row` splits `input` back into our template's parts (few-shot example,
context, question) and refuses a row whose text our template does not rebuild exactly, so a sample
fed through `sample_prompt` gives the model RULER's text, token for token, on our prompt path. That
is how our generator is checked against RULER's on the same model (`benchmarks/ruler_parity.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from .base import encode_prompt, metadata_json
from .tasks import TASKS


def from_ruler_row(task: str, row: dict, tokenizer, index: int = 0) -> dict:
    """One RULER jsonl row of `task` as a sample in our schema (see the module docstring)."""
    template = TASKS[task].template
    head = template[:template.index("{context}")]
    text = row["input"]
    # vt and cwe put a solved example (itself a filled template) first: the last template is the task
    start = text.rfind(head)
    if start < 0:
        raise ConfigError(f"{task}: RULER's input does not contain our template's start {head[:40]!r}")
    few_shot = text[:start]
    if few_shot:
        if not few_shot.endswith("\n"):
            raise ConfigError(f"{task}: RULER's solved example does not end with a newline")
        few_shot = few_shot[:-1]  # render_prompt joins the example and the task with one newline
    body = text[start + len(head):]
    context, question = body.rsplit("\n", 1)  # every RULER template ends "{context}\n{query part}"
    if template.format(context=context, question=question) != text[start:]:
        raise ConfigError(f"{task}: our template does not rebuild RULER's input")
    answer_prefix = row["answer_prefix"]
    prompt = encode_prompt(tokenizer, task, context, question, answer_prefix, few_shot)
    return {
        "id": f"ruler-reference-{task}-{index}",
        "task": task,
        "context": context,
        "question": question,
        "answers": [str(a) for a in row["outputs"]],
        "context_tokens": len(prompt),
        "metadata": metadata_json(answer_prefix=answer_prefix, few_shot=few_shot, ruler_length=row["length"],
                                  index=index),
    }


def load_ruler_samples(task: str, path: str | Path, tokenizer) -> list[dict]:
    """Every row of a RULER jsonl file (`validation.jsonl` of `task`) as samples in our schema."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [from_ruler_row(task, json.loads(line), tokenizer, i) for i, line in enumerate(lines) if line.strip()]
