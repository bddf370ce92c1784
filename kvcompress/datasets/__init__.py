"""Datasets in one schema, sized in model tokens, with their prompts and scorers.

Every dataset is a `datasets.Dataset` with columns id, task, context, question, answers (list of
str), context_tokens (model tokens of `prompt_tokens(sample)`), metadata (JSON). Names:

- "niah"      RULER needle-in-a-haystack on the Paul Graham essays (variant single / multikey /
              multivalue / multiquery), embedded and seeded;
- "ruler"     the RULER synthetic suite (`task=` one name or a list: niah_single_1/2/3,
              niah_multikey_1/2/3, niah_multivalue, niah_multiquery, vt, cwe, fwe), embedded and seeded;
- "passkey"   Landmark-attention passkey retrieval, embedded and seeded;
- "lm"        language modelling on the essays (teacher-forced NLL of a continuation);
- "longbench" LongBench v1 English subsets (hub Parquet conversion, or local `data_files`);
- "hf"        any Hugging Face dataset through a column mapping.

`validate(name, params)` checks parameters without building anything; `load_dataset` builds.
`tokenizer=None` everywhere means the embedded model's tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import ConfigError, build
from .base import DatasetConfig, Prompt, encode_prompt, prompt_tokens, sample_prompt
from .hf import DatasetUnavailable, HFDataset
from .lm import LanguageModelling
from .longbench import LongBench
from .niah import Niah
from .passkey import Passkey
from .ruler import OFFLINE_TASKS as RULER_TASKS
from .ruler import Ruler
from .tasks import LONGBENCH_SUBSETS, TASKS, Task, score, task_of

DEFAULT_CONTINUATION_TOKENS = LanguageModelling.continuation_tokens

DATASETS: dict[str, type[DatasetConfig]] = {
    cls.name: cls for cls in (Niah, Ruler, Passkey, LanguageModelling, LongBench, HFDataset)
}


def dataset_config(name: str, params: dict[str, Any]) -> DatasetConfig:
    """The validated config of dataset `name` (a ConfigError names the bad field)."""
    return build("dataset", DATASETS, name, params)


def dataset_params(name: str) -> dict[str, Any]:
    """Parameters of dataset `name` with their defaults."""
    if name not in DATASETS:
        raise ConfigError(f"dataset: expected one of {sorted(DATASETS)}, got {name!r}")
    return DATASETS[name].defaults()


def validate(name: str, params: dict[str, Any]) -> None:
    """Raise ConfigError for a bad name or parameter; builds nothing. `tokenizer` is not checked."""
    dataset_config(name, {k: v for k, v in params.items() if k != "tokenizer"})


def load_dataset(name: str, tokenizer=None, **params: Any):
    """Build dataset `name` as a `datasets.Dataset` (see the module docstring for the schema)."""
    return dataset_config(name, params).load(tokenizer)


def reference_tokens(sample: dict, tokenizer) -> list[int] | None:
    """Language modelling: the continuation's tokens (the teacher-forced targets). QA tasks: None."""
    if sample["task"] != "lm":
        return None
    return [int(t) for t in tokenizer.encode(sample["answers"][0], add_special_tokens=False)]


def max_answer_tokens(sample: dict) -> int:
    """Tokens generated free-running for the answer (LM: the continuation length)."""
    task = task_of(sample)
    if task.name == "lm":
        return int(json.loads(sample["metadata"] or "{}").get("continuation_tokens", DEFAULT_CONTINUATION_TOKENS))
    return task.max_answer_tokens


__all__ = [
    "DATASETS", "LONGBENCH_SUBSETS", "RULER_TASKS", "Prompt", "sample_prompt", "TASKS", "DatasetConfig", "DatasetUnavailable", "Task", "dataset_config",
    "dataset_params", "encode_prompt", "load_dataset", "max_answer_tokens", "prompt_tokens", "reference_tokens",
    "score", "validate",
]
