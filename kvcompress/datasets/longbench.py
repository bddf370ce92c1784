"""LongBench v1 (Bai et al. 2023, "LongBench: A Bilingual, Multitask Benchmark for Long Context
Understanding"), English subsets, with LongBench's prompts, answer lengths and metrics.

On the hub `THUDM/LongBench` is a loading-script dataset, which `datasets` >= 4 no longer runs.
Its `refs/convert/parquet` branch holds the hub's Parquet conversion (`{subset}/test/0000.parquet`),
which plain `load_dataset` reads; that is the default source. `data_files` points at local copies
instead: LongBench's released JSONL (`data.zip` -> `data/{subset}.jsonl`) or that Parquet, with
LongBench's fields (input, context, answers, length, dataset, language, all_classes, _id).

Contexts longer than the budget are cut in the middle as LongBench's pred.py does (first and last
halves kept); here the cut is on the context alone, so the instruction and question stay whole and
the built prompt is within `context_tokens` model tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import check
from .base import DatasetConfig, fit_context, metadata_json, resolve_tokenizer, to_dataset
from .hf import as_answers, check_source, load_rows, select_rows
from .tasks import LONGBENCH_SUBSETS

HUB_PATH = "THUDM/LongBench"
PARQUET_REVISION = "refs/convert/parquet"


@dataclass(frozen=True)
class LongBench(DatasetConfig):
    """A LongBench v1 subset; hub Parquet conversion by default, or local `data_files`."""

    name: ClassVar[str] = "longbench"
    subset: str = "narrativeqa"
    context_tokens: int = 2048
    num_samples: int | None = None
    seed: int = 0
    path: str = HUB_PATH
    revision: str | None = PARQUET_REVISION
    data_files: Any = None

    def __post_init__(self) -> None:
        check(self.subset in LONGBENCH_SUBSETS, "subset", f"one of {list(LONGBENCH_SUBSETS)}", self.subset)
        check_source(self.path, self.data_files, self.revision)
        super().__post_init__()
        self.check_num_samples(allow_all=True)

    def rows(self):
        if self.data_files is not None:
            files = self.data_files if isinstance(self.data_files, (list, tuple)) else [self.data_files]
            builder = "parquet" if all(str(f).endswith(".parquet") for f in files) else "json"
            return load_rows(builder, data_files=self.data_files, split="train")
        return load_rows(self.path, data_files=f"{self.subset}/test/*.parquet", split="train",
                         revision=self.revision)

    def load(self, tokenizer=None):
        tokenizer = resolve_tokenizer(tokenizer)
        rows = self.rows()
        samples = []
        for i in select_rows(len(rows), self.num_samples, self.seed, f"{self.name}:{self.subset}"):
            row = rows[i]
            context, length = fit_context(tokenizer, self.subset, row["context"], row["input"] or "",
                                          self.context_tokens)
            samples.append({
                "id": f"longbench-{self.subset}-{row.get('_id') or i}",
                "task": self.subset,
                "context": context,
                "question": row["input"] or "",
                "answers": as_answers(row["answers"]),
                "context_tokens": length,
                "metadata": metadata_json(
                    subset=self.subset, _id=row.get("_id"), length=row.get("length"),
                    language=row.get("language"), all_classes=row.get("all_classes"), row=i,
                    truncated=context != row["context"],
                ),
            })
        return to_dataset(samples)
