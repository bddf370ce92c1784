"""Any Hugging Face dataset through a column mapping, loaded with `datasets.load_dataset`.

`columns` maps this schema's fields to the source's columns ({"context": ..., "question": ...,
"answers": ..., "id": ...}; a field left out reads the column of its own name, "question" and "id"
may be absent from the source). Answers may be a string, a list, or SQuAD's {"text": [...]}.
`task` picks the prompt template, answer length and scorer (kvcompress/datasets/tasks.py). Long
contexts are cut in the middle to `context_tokens` prompt tokens, as LongBench cuts them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import ConfigError, check
from .base import DatasetConfig, fit_context, metadata_json, resolve_tokenizer, to_dataset

FIELDS = ("context", "question", "answers", "id")
REQUIRED = ("context", "answers")


class DatasetUnavailable(RuntimeError):
    """The source could not be loaded (offline, missing files, no such dataset)."""


def _is_files(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if isinstance(value, (list, tuple)):
        return bool(value) and all(isinstance(v, str) for v in value)
    if isinstance(value, dict):
        return bool(value) and all(isinstance(k, str) and _is_files(v) for k, v in value.items())
    return False


def check_source(path: Any, data_files: Any, revision: Any) -> None:
    check(isinstance(path, str) and path != "", "path", "a hub dataset id, a builder name or a local path", path)
    check(data_files is None or _is_files(data_files), "data_files",
          "None, a path or glob, a list of them, or a {split: paths} dict", data_files)
    check(revision is None or isinstance(revision, str), "revision", "None or a git revision string", revision)


def load_rows(path: str, *, config: str | None = None, split: str | None = None,
              data_files: Any = None, revision: str | None = None):
    """`datasets.load_dataset(...)` as one split, with an error that says what to do when it fails."""
    import datasets

    try:
        loaded = datasets.load_dataset(path, config, split=split, data_files=data_files, revision=revision)
    except Exception as exc:  # offline mode, no network, missing files or repo: all end the same way
        offline = datasets.config.HF_HUB_OFFLINE or type(exc).__name__ == "OfflineModeIsEnabled"
        hint = (" Hub access is off (HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1)." if offline else "")
        raise DatasetUnavailable(
            f"could not load dataset path={path!r} config={config!r} split={split!r} data_files={data_files!r} "
            f"revision={revision!r}: {type(exc).__name__}: {exc}.{hint} Pass data_files= pointing at local "
            f"JSONL/Parquet files in the same schema to run without the hub."
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if len(splits) == 1:
            return loaded[splits[0]]
        if "test" in loaded:
            return loaded["test"]
        raise ConfigError(f"split: expected one of {splits}, got None")
    return loaded


def select_rows(count: int, num_samples: int | None, seed: int, name: str) -> list[int]:
    """All rows, or a seeded subset of `num_samples` of them in their original order."""
    if num_samples is None or num_samples >= count:
        return list(range(count))
    return sorted(random.Random(f"{name}:{seed}").sample(range(count), num_samples))


def as_answers(value: Any) -> list[str]:
    if isinstance(value, dict) and "text" in value:  # SQuAD-style {"text": [...], "answer_start": [...]}
        value = value["text"]
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [str(value)]


@dataclass(frozen=True)
class HFDataset(DatasetConfig):
    """Any HF dataset: `path` (hub id, builder such as "json", or local path), config, split,
    data_files, revision, `columns` mapping, `task` (a name in kvcompress.datasets.TASKS)."""

    name: ClassVar[str] = "hf"
    path: str | None = None
    config: str | None = None
    split: str | None = None
    data_files: Any = None
    revision: str | None = None
    columns: dict[str, str] = field(default_factory=dict)
    task: str = "qa"
    context_tokens: int = 2048
    num_samples: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        from .tasks import TASKS

        check_source(self.path, self.data_files, self.revision)
        check(self.config is None or isinstance(self.config, str), "config", "None or a config name", self.config)
        check(self.split is None or isinstance(self.split, str), "split", "None or a split name", self.split)
        check(isinstance(self.columns, dict) and set(self.columns) <= set(FIELDS)
              and all(isinstance(v, str) for v in self.columns.values()),
              "columns", f"a dict from {list(FIELDS)} to source column names", self.columns)
        check(self.task in TASKS, "task", f"one of {sorted(TASKS)}", self.task)
        super().__post_init__()
        self.check_num_samples(allow_all=True)

    def column(self, field_name: str) -> str:
        return self.columns.get(field_name, field_name)

    def load(self, tokenizer=None):
        tokenizer = resolve_tokenizer(tokenizer)
        rows = load_rows(self.path, config=self.config, split=self.split, data_files=self.data_files,
                         revision=self.revision)
        for f in REQUIRED:
            check(self.column(f) in rows.column_names, f"columns[{f!r}]",
                  f"a column of the source, one of {rows.column_names}", self.column(f))
        samples = []
        for i in select_rows(len(rows), self.num_samples, self.seed, self.name):
            row = rows[i]
            question = str(row.get(self.column("question")) or "")
            context, length = fit_context(tokenizer, self.task, str(row[self.column("context")]), question,
                                          self.context_tokens)
            samples.append({
                "id": str(row.get(self.column("id"), i)),
                "task": self.task,
                "context": context,
                "question": question,
                "answers": as_answers(row[self.column("answers")]),
                "context_tokens": length,
                "metadata": metadata_json(path=self.path, config=self.config, row=i,
                                          all_classes=row.get("all_classes"),  # LongBench-style classification
                                          truncated=context != str(row[self.column("context")])),
            })
        return to_dataset(samples)
