"""Sweep grid spec: parse, validate every cell up front, expand into shards.

A spec (YAML file, built-in name or dict):

    name: default
    model: smollm2-135m
    decode_steps: 16              # optional cap on the reference answer (default: EOS or the task's budget)
    protocol: [query_aware, query_agnostic]
    datasets:
      - name: niah
        params: {variant: single}
        context_tokens: [1024]
        num_samples: 2
        seed: 0
    methods:
      - name: full
      - name: keyformer
        params: {recent: 0.3}
        grid:
          budget: [0.25, 0.5]
          tau: [{tau_init: 1.0, tau_end: 2.0}, {tau_init: 1.0, tau_end: 1.0}]

Axes are per method, so a tau schedule multiplies keyformer cells only and bits multiply
quantizer cells only. An axis whose values are mappings sets several parameters together (a tau
schedule), except on an axis named after a parameter whose values are mappings: `quantize: [null,
{name: kivi, bits: 4}]` gives an eviction method's cells without and with a quantizer (methods/composed.py),
`scorer: [snapkv, {name: expected_attention, epsilon: 0.0}]` a delegating method's cells over two
configured scorers (methods/delegating.py).
A shard is one dataset sample with every method cell: one prefill serves them all.

The spec is a pydantic model: the structure (keys, types) is checked when it is parsed, with
errors naming the field (`datasets[0].seed: expected a valid integer, got 'x'`), and
`SweepSpec.model_json_schema()` is the grid's JSON Schema for editors (`kvcompress grid-schema`).
Values are then checked by the configs they build (`methods[1] (kivi {'bits': 3}): kivi.bits:
expected one of (2, 4), got 3`), every invalid cell at once, when the spec is planned. A spec is
planned once (`SweepSpec.plan`, cached): the validated method configs and the shards that carry
them as objects. JSON appears only at the Prefect edge (`Shard.to_dict` / `from_dict`, for a shard
sent to another worker) and in the results' `config` column.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal, Mapping

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from . import datasets
from .errors import ConfigError, shown
from .methods import method_config
from .methods.base import Method
from .model import check_model, context_window, refuse_custom_code
from .results import validate_sweep_id
from .runner import PROTOCOLS
from .shapes import DTYPES, SHAPES, model_classes, shape_config
from .speed import SpeedModel, measurement_config

GRIDS_DIR = Path(__file__).parent / "grids"
# Parameters whose value may itself be a mapping (an eviction method's quantizer, a delegating method's
# scorer with its parameters): an axis named after one takes its mappings as values, not as several
# parameters set together
MAPPING_PARAMS = ("quantize", "scorer")

# Runs (samples x method cells x protocols; a speed grid's measurements) a grid may expand to unless its
# `max_runs` (or --max-runs) says more: ~10x the largest grid run here, far below what exhausts memory
MAX_RUNS = 100_000

# Rough CPU throughput of the embedded model (PLATFORM.md), for `--dry-run` cost estimates only.
PREFILL_TOK_S = 150.0
DECODE_TOK_S = 12.0


class SweepError(ConfigError):
    """Every invalid cell of a sweep, reported at once."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        if len(errors) == 1:  # one line, as every other error of the CLI
            super().__init__(f"{errors[0]} (nothing was run)")
        else:
            super().__init__(f"{len(errors)} invalid settings; nothing was run:\n  " + "\n  ".join(errors))


def _as_list(value: Any) -> Any:
    """A scalar axis value means a one-value axis (`context_tokens: 1024` is `[1024]`)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _list_of(item: Any) -> Any:
    """A list of `item`, also written as one scalar in the YAML."""
    return Annotated[list[item], BeforeValidator(_as_list, json_schema_input_type=item | list[item])]


class _Strict(BaseModel):
    """Unknown keys are errors and values keep their YAML types (no "2" -> 2, no true -> 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class DatasetAxis(_Strict):
    """One dataset of the grid, at one or more context lengths."""

    name: str = Field(description="dataset name (see kvcompress.datasets)")
    params: dict[str, Any] = Field(default_factory=dict, description="the dataset's own parameters")
    context_tokens: _list_of(int) = Field(default=[1024], description="prompt + answer budget, model tokens")
    num_samples: int | None = Field(default=1, description="samples (contexts) per context length")
    seed: int = 0

    def loader_params(self, context_tokens: int) -> dict[str, Any]:
        return {**self.params, "context_tokens": context_tokens, "num_samples": self.num_samples, "seed": self.seed}


class MethodAxis(_Strict):
    """One method of the grid: fixed `params`, and `grid` axes that multiply this method's cells only."""

    name: str = Field(description="method name (`kvcompress methods`)")
    params: dict[str, Any] = Field(default_factory=dict, description="parameters every cell of this method has")
    grid: dict[str, _list_of(Any)] = Field(
        default_factory=dict,
        description="axis name -> values; a mapping value sets several parameters together (a tau schedule), "
                    "except on the quantize and scorer axes, whose values are quantizer / scorer configs")

    def cells(self) -> list[dict[str, Any]]:
        """Parameter dicts of every cell: fixed params updated by one value of each axis."""
        axes = [[v if isinstance(v, dict) and key not in MAPPING_PARAMS else {key: v} for v in values]
                for key, values in self.grid.items()]
        return [
            {**self.params, **{k: v for choice in combo for k, v in choice.items()}}
            for combo in itertools.product(*axes)
        ]


@dataclass(frozen=True)
class Shard:
    """One dataset (at one context length) context: its rows sample_index .. sample_index + rows - 1
    (several questions about one context, or one sample), with every method cell (validated
    configs) and protocol."""

    dataset: str
    dataset_params: Mapping[str, Any]
    sample_index: int
    methods: tuple[Method, ...]
    protocols: tuple[str, ...] = ("query_aware",)
    rows: int = 1

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON form, for the Prefect edge only (a shard sent to another worker's flow run)."""
        return {
            "dataset": self.dataset,
            "dataset_params": dict(self.dataset_params),
            "sample_index": self.sample_index,
            "methods": [m.to_dict() for m in self.methods],
            "protocols": list(self.protocols),
            "rows": self.rows,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Shard":
        """The shard `to_dict` wrote (its method configs validated again: they crossed a process)."""
        methods = tuple(method_config(**m) for m in data["methods"])
        return cls(data["dataset"], MappingProxyType(dict(data["dataset_params"])), data["sample_index"], methods,
                   tuple(data.get("protocols") or ("query_aware",)), data.get("rows", 1))


@dataclass(frozen=True)
class Plan:
    """A validated, expanded spec: what a sweep runs."""

    name: str
    model: str
    decode_steps: int | None
    run_timeout_s: float | None
    protocols: tuple[str, ...]
    methods: tuple[Method, ...]
    shards: tuple[Shard, ...]

    @property
    def runs(self) -> int:
        return sum(s.rows for s in self.shards) * len(self.methods) * len(self.protocols)

    def estimate(self) -> dict[str, Any]:
        """Cells, shards and a rough CPU time for `--dry-run`."""
        prefill_tokens = sum(s.dataset_params["context_tokens"] for s in self.shards)
        # reference decode + per method and protocol a teacher-forced and a free-running decode
        # (answers end at EOS, usually well before the budget: 32 tokens each is a rough guess)
        steps = self.decode_steps or 32
        rows = sum(s.rows for s in self.shards)
        decode_tokens = rows * steps * (1 + 2 * len(self.methods) * len(self.protocols))
        seconds = prefill_tokens / PREFILL_TOK_S + decode_tokens / DECODE_TOK_S
        return {"runs": self.runs, "shards": len(self.shards), "methods": len(self.methods),
                "prefill_tokens": prefill_tokens, "decode_tokens": decode_tokens, "estimated_cpu_s": round(seconds)}


class SweepSpec(_Strict):
    """A sweep grid (YAML). `kvcompress grid-schema` prints its JSON Schema."""

    kind: Literal["quality"] = Field(default="quality", description="quality (this grid) or speed (SpeedSpec)")
    name: str = Field(default="sweep", description="the sweep id unless --sweep-id / sweep_id is given")
    model: str = "smollm2-135m"
    decode_steps: int | None = Field(
        default=None, description="cap on the reference answer; null: EOS or the task's answer budget")
    protocol: _list_of(str) = Field(default=["query_aware"], description=f"any of {list(PROTOCOLS)}")
    run_timeout_s: float | None = Field(default=1800.0, description="per method run; a slower run is recorded as timeout")
    allow_beyond_window: bool = Field(default=False, description="run contexts longer than the model's window (marked)")
    max_runs: int = Field(default=MAX_RUNS, description="refuse a grid of more runs (samples x method cells x "
                          "protocols) before expanding it; raise it to run a bigger grid (also: --max-runs)")
    datasets: list[DatasetAxis] = Field(default_factory=list)
    methods: list[MethodAxis] = Field(default_factory=list)

    def plan(self) -> Plan:
        """Validate every cell (a SweepError lists all invalid ones) and expand; once per spec."""
        return self._plan

    def method_configs(self) -> list[Method]:
        """Every method cell as a validated config; raises SweepError listing all invalid cells."""
        return list(self.plan().methods)

    def shards(self) -> list[Shard]:
        return list(self.plan().shards)

    def estimate(self) -> dict[str, Any]:
        return self.plan().estimate()

    @cached_property
    def _plan(self) -> Plan:
        configs = self._validate()
        shards = []
        for axis in self.datasets:
            for length in axis.context_tokens:
                params = MappingProxyType(axis.loader_params(length))
                config = datasets.dataset_config(axis.name, dict(params))
                per_context = config.rows_per_context
                shards += [Shard(axis.name, params, index, configs, tuple(self.protocol), per_context)
                           for index in range(0, config.row_count(), per_context)]
        return Plan(self.name, self.model, self.decode_steps, self.run_timeout_s, tuple(self.protocol), configs,
                    tuple(shards))

    def _validate(self) -> tuple[Method, ...]:
        size = self._size_errors()
        if size:  # before anything is expanded
            raise SweepError(size)
        errors: list[str] = []
        try:
            validate_sweep_id(self.name, "name")
        except ConfigError as exc:
            errors.append(str(exc))
        try:
            check_model(self.model)  # names `model:`; a .gguf path must be a file
        except ConfigError as exc:
            errors.append(str(exc))
        try:
            refuse_custom_code(Path(self.model).expanduser())  # before the flow: Prefect never retries it
        except ConfigError as exc:
            errors.append(f"model: {exc}")
        window = self.context_window()
        if self.decode_steps is not None and not 1 <= self.decode_steps <= 4096:
            errors.append(f"decode_steps: expected an int in [1, 4096] or null (no cap), got {self.decode_steps!r}")
        if not self.protocol or any(p not in PROTOCOLS for p in self.protocol) or len(set(self.protocol)) < len(self.protocol):
            errors.append(f"protocol: expected a non-empty list of distinct values from {list(PROTOCOLS)}, "
                          f"got {list(self.protocol)!r}")
        if self.run_timeout_s is not None and not self.run_timeout_s > 0:
            errors.append(f"run_timeout_s: expected a number of seconds > 0 or null, got {self.run_timeout_s!r}")
        if not self.datasets:
            errors.append("datasets: expected at least one dataset")
        for i, axis in enumerate(self.datasets):
            for length in axis.context_tokens:
                try:
                    datasets.validate(axis.name, axis.loader_params(length))
                except ConfigError as exc:
                    errors.append(f"datasets[{i}] ({axis.name}): {exc}")
                if window and length > window and not self.allow_beyond_window:
                    errors.append(f"datasets[{i}] ({axis.name}).context_tokens: expected at most {window} (the "
                                  f"context window of {self.model}), got {length}; set `allow_beyond_window: true` "
                                  f"to run it anyway (its runs are marked)")
        configs = _method_cells(self.methods, errors)
        errors += _budgets_fit(configs, {length for axis in self.datasets for length in axis.context_tokens})
        if errors:
            raise SweepError(errors)
        return tuple(configs)

    def _size_errors(self) -> list[str]:
        """The grid's runs counted from its axes' lengths (nothing built): over `max_runs`, an error."""
        rows = 0
        for axis in self.datasets:
            for length in axis.context_tokens:
                try:
                    rows += datasets.dataset_config(axis.name, axis.loader_params(length)).row_count() or 1
                except (ConfigError, TypeError):
                    rows += 1  # its own error comes with the others
        return _too_big(rows * _cell_count(self.methods) * len(self.protocol), "runs", self.max_runs)

    def context_window(self) -> int | None:
        """The model's context window (None when unknown offline or for a bad model name: check_model's error)."""
        try:
            return context_window(self.model)
        except ConfigError:
            return None

class RandomModel(_Strict):
    """Random weights of an mlx-lm shape: a decode step's time does not depend on the weights' values."""

    shape: str = Field(description=f"one of {sorted(SHAPES)}, or a config.json path (or its directory)")
    dtype: str = Field(default="float16", description=f"one of {list(DTYPES)}")
    layers: int | None = Field(default=None, description="keep the first N layers (smoke runs); null: all")


@dataclass(frozen=True)
class SpeedGroup:
    """The caches measured together, taking turns: one context length at one batch or KV budget."""

    context_tokens: int
    batch: int | None  # the batch every cache runs at, or None: each cache's largest under the budget
    kv_budget_bytes: int | None

    def describe(self) -> str:
        setting = f"batch {self.batch}" if self.batch is not None else f"KV budget {self.kv_budget_bytes / 2**30:g} GiB"
        return f"{self.context_tokens} tokens, {setting}"


@dataclass(frozen=True)
class SpeedPlan:
    """A validated speed grid: what a speed sweep measures."""

    name: str
    model: SpeedModel
    steps: int
    rounds: int
    warmup: int
    prefill_rounds: int
    max_batch: int | None
    methods: tuple[Method, ...]
    groups: tuple[SpeedGroup, ...]
    device_memory_bytes: int | None = None  # what each group's peak is checked against; None: the device's

    @property
    def runs(self) -> int:
        return len(self.groups) * len(self.methods)

    def measurement_config(self, group: SpeedGroup, method: Method) -> dict[str, Any]:
        return measurement_config(self.model, method, group.context_tokens, group.batch, group.kv_budget_bytes,
                                  self.steps, self.rounds, self.warmup, self.prefill_rounds)

    def estimate(self) -> dict[str, Any]:
        """Measurements and groups for `--dry-run` (a time estimate would need the device's speed)."""
        return {"kind": "speed", "measurements": self.runs, "groups": len(self.groups), "methods": len(self.methods),
                "decode_steps_per_measurement": self.warmup + 2 * self.steps * self.rounds}


class SpeedSpec(_Strict):
    """A speed grid (`kind: speed`): decode throughput of caches x context lengths x batches or KV
    budgets (docs/speed.md)."""

    kind: Literal["speed"] = Field(description="speed: this grid kind")
    name: str = Field(default="speed", description="the sweep id unless --sweep-id / sweep_id is given")
    model: str | RandomModel = Field(
        default="smollm2-135m", description="a model name or path (as a quality grid's), or {shape, dtype, layers}")
    context_tokens: _list_of(int) = Field(default=[1024], description="tokens of each prompt")
    batch: _list_of(int) | None = Field(default=None, description="sequences decoded together (or kv_budget_gib)")
    kv_budget_gib: _list_of(float) | None = Field(
        default=None, description="KV memory per group: each cache runs the largest batch whose KV fits (or batch)")
    max_batch: int | None = Field(default=64, description="the largest batch a budget may give; null: no cap")
    steps: int = Field(default=8, description="decode steps per cache and round, each way (sync, pipelined)")
    rounds: int = Field(default=3, description="rounds in which every cache takes its turn")
    warmup: int = Field(default=4, description="untimed decode steps after the prefill")
    prefill_rounds: int = Field(default=1, description="timed prefills per cache, taking turns")
    device_memory_gib: float | None = Field(
        default=None, description="memory each group's estimated peak must fit; null: the device's (CPU: RAM)")
    allow_beyond_window: bool = Field(default=False, description="run contexts longer than the model's window")
    max_runs: int = Field(default=MAX_RUNS, description="refuse a grid of more measurements before expanding it "
                          "(also: --max-runs)")
    methods: list[MethodAxis] = Field(default_factory=list)

    def plan(self) -> SpeedPlan:
        """Validate every field and cell (a SweepError lists all invalid ones) and expand; once per spec."""
        return self._plan

    @cached_property
    def _plan(self) -> SpeedPlan:
        model, configs = self._validate()
        if self.batch is not None:
            groups = [SpeedGroup(t, b, None) for t in self.context_tokens for b in self.batch]
        else:
            groups = [SpeedGroup(t, None, round(g * 2**30)) for t in self.context_tokens for g in self.kv_budget_gib]
        return SpeedPlan(self.name, model, self.steps, self.rounds, self.warmup, self.prefill_rounds, self.max_batch,
                         configs, tuple(groups),
                         None if self.device_memory_gib is None else round(self.device_memory_gib * 2**30))

    def speed_model(self) -> SpeedModel:
        if isinstance(self.model, RandomModel):
            return SpeedModel(shape=self.model.shape, dtype=self.model.dtype, layers=self.model.layers)
        return SpeedModel(name=self.model)

    def _validate(self) -> tuple[SpeedModel, tuple[Method, ...]]:
        settings = len(self.batch if self.batch is not None else self.kv_budget_gib or ())
        size = _too_big(len(self.context_tokens) * max(settings, 1) * _cell_count(self.methods), "measurements",
                        self.max_runs)
        if size:  # before anything is expanded
            raise SweepError(size)
        errors: list[str] = []
        try:
            validate_sweep_id(self.name, "name")
        except ConfigError as exc:
            errors.append(str(exc))
        model, window = self.speed_model(), None
        try:
            if model.shape is not None:
                if model.dtype not in DTYPES:
                    errors.append(f"model.dtype: expected one of {list(DTYPES)}, got {model.dtype!r}")
                if model.layers is not None and model.layers < 1:
                    errors.append(f"model.layers: expected an int >= 1 or null, got {model.layers!r}")
            if model.shape is None:
                check_model(model.name)
            window = model.context_window()
            if model.shape is not None:
                model_classes(shape_config(model.shape))  # a model_type mlx-lm does not know
        except ConfigError as exc:  # an unknown shape or model
            errors.append(str(exc))
        if (self.batch is None) == (self.kv_budget_gib is None):
            errors.append(f"batch, kv_budget_gib: expected exactly one of them (explicit batches, or KV budgets "
                          f"each cache's batch is fitted to), got {'both' if self.batch is not None else 'neither'}")
        for key, values in (("batch", self.batch), ("context_tokens", self.context_tokens)):
            if values is not None and (not values or any(v < 1 for v in values)):
                errors.append(f"{key}: expected a non-empty list of ints >= 1, got {list(values)!r}")
        if self.kv_budget_gib is not None and (not self.kv_budget_gib or any(g <= 0 for g in self.kv_budget_gib)):
            errors.append(f"kv_budget_gib: expected a non-empty list of GiB > 0, got {list(self.kv_budget_gib)!r}")
        if self.device_memory_gib is not None and self.device_memory_gib <= 0:
            errors.append(f"device_memory_gib: expected GiB > 0 or null, got {self.device_memory_gib!r}")
        for key, low in (("steps", 1), ("rounds", 1), ("warmup", 0), ("prefill_rounds", 1), ("max_batch", 1)):
            value = getattr(self, key)
            if value is not None and value < low:
                errors.append(f"{key}: expected an int >= {low}{' or null' if key == 'max_batch' else ''}, got {value!r}")
        for length in self.context_tokens:
            if window and length > window and not self.allow_beyond_window:
                errors.append(f"context_tokens: expected at most {window} (the context window of {model.label()}), "
                              f"got {length}; set `allow_beyond_window: true` to run it anyway")
        configs = _method_cells(self.methods, errors)
        if configs and not any(c.name == "full" for c in configs):
            errors.append("methods: expected a `full` cell (every x full is against it), got "
                          f"{[c.label() for c in configs]}")
        if errors:
            raise SweepError(errors)
        return model, tuple(configs)


def _method_cells(axes: list[MethodAxis], errors: list[str]) -> list[Method]:
    """Every method cell as a validated config; invalid and duplicate cells appended to `errors`."""
    if not axes:
        errors.append("methods: expected at least one method")
    configs: list[Method] = []
    for i, axis in enumerate(axes):
        for params in axis.cells():
            try:
                configs.append(method_config(axis.name, **params))
            except (ConfigError, TypeError) as exc:
                errors.append(f"methods[{i}] ({axis.name} {shown(params)}): {exc}")
    counts = Counter(c.to_json() for c in configs)  # linear: 10k cells check in well under a second
    duplicates = {c.label() for c in configs if counts[c.to_json()] > 1}
    errors += [f"methods: duplicate cell {d}" for d in sorted(duplicates)]
    return configs


def _cell_count(axes: list[MethodAxis]) -> int:
    """Method cells the axes expand to, counted without expanding them."""
    return sum(math.prod(len(values) for values in axis.grid.values()) for axis in axes)


def _too_big(runs: int, what: str, max_runs: int) -> list[str]:
    """The error of a grid over its `max_runs`, found before anything is expanded (a 600-byte grid can
    ask for 10^7 samples or 10^6 method cells: minutes of planning and gigabytes before the first run)."""
    if runs <= max_runs:
        return []
    return [f"max_runs: this grid expands to {runs:,} {what}, more than max_runs={max_runs:,}; nothing was "
            f"expanded. Shrink the grid, or raise the limit (grid key `max_runs: N`, or --max-runs N)"]


def _budgets_fit(configs: list[Method], lengths: set[int]) -> list[str]:
    """A fractional budget too small for a method's protected tokens at a grid context (down to 1/32
    of a 1k prompt is 32 tokens: SnapKV's window alone) would hold more than its budget in every run
    (the cache keeps the window and one scored token, `Eviction.resolve`), so the cell would not be
    the point it is labelled: say so before any. The context (prompt + answer budget) bounds the
    prompt, so what falls short here falls short there."""
    errors = []
    for config in configs:
        if not isinstance(getattr(config, "budget", None), float) or not hasattr(config, "window_shortfall"):
            continue
        for length in sorted(lengths):
            if shortfall := config.window_shortfall(length):
                errors.append(f"methods ({config.label()}) at context_tokens {length}: {shortfall}")
                break
    return errors


def _where(loc: tuple) -> str:
    """A pydantic error location as the grid writes it: ("datasets", 0, "seed") -> datasets[0].seed."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _allowed_keys(loc: tuple, root: type[BaseModel] = None) -> list[str]:
    """The keys allowed where `loc` points (the model found by walking the spec's fields)."""
    model: type[BaseModel] = root or SweepSpec
    for part in loc:
        if isinstance(part, str) and part in model.model_fields:
            inner = model.model_fields[part].annotation
            args = getattr(inner, "__args__", ())
            model = next((a for a in (inner, *args) if isinstance(a, type) and issubclass(a, BaseModel)), model)
    return sorted(model.model_fields)


def _messages(exc: ValidationError, root: type[BaseModel]) -> list[str]:
    """One line per pydantic error, naming the field and what it allows."""
    lines = []
    for error in exc.errors():
        loc, kind = error["loc"], error["type"]
        if root is SpeedSpec and loc[:1] == ("model",) and len(loc) > 1 and loc[1] in ("str", "RandomModel"):
            loc = loc[:1] + loc[2:]  # the union's member names are pydantic's, not the grid's
            if loc == ("model",):
                continue  # "a valid string" when a mapping was meant: the mapping's own errors say more
        if kind == "extra_forbidden":
            where = _where(loc[:-1]) or "sweep"
            lines.append(f"{where}.{loc[-1]}: unknown key; allowed: {_allowed_keys(loc[:-1], root)}")
        elif kind == "missing":
            lines.append(f"{_where(loc)}: required")
        else:
            message = error["msg"].removeprefix("Input should be ").removeprefix("an ")
            lines.append(f"{_where(loc) or 'sweep'}: expected {message}, got {shown(error.get('input'))}")
    return lines


KINDS = {"quality": SweepSpec, "speed": SpeedSpec}
# Values a grid may hold, counted as written out: YAML aliases share one object, so a 600-byte file of
# nested aliases is a small object here and 10^9 values to everything that walks it (validation, a repr)
MAX_GRID_VALUES = 1_000_000


def _check_size(data: Any) -> None:
    """Refuse a grid of more than MAX_GRID_VALUES values as written out, counting at most that many."""
    pending, seen = [data], 0
    while pending:
        value = pending.pop()
        seen += 1
        if seen > MAX_GRID_VALUES:
            raise SweepError([f"grid: expected at most {MAX_GRID_VALUES:,} values written out, got more (YAML "
                              "aliases that expand each other?): write the grid out, or split it"])
        if isinstance(value, dict):
            pending += value.keys()
            pending += value.values()
        elif isinstance(value, (list, tuple)):
            pending += value


def parse_spec(data: Any) -> SweepSpec | SpeedSpec:
    """Build a spec from a mapping (`kind: speed` a SpeedSpec, else a SweepSpec); a SweepError lists
    every structural error (unknown keys with the allowed names, missing names, wrong types)."""
    if not isinstance(data, dict):
        raise SweepError([f"sweep: expected a mapping, got {shown(data)}"])
    _check_size(data)
    kind = data.get("kind", "quality")
    if kind not in KINDS:
        raise SweepError([f"kind: expected one of {list(KINDS)}, got {shown(kind)}"])
    try:
        return KINDS[kind].model_validate(data)
    except ValidationError as exc:
        raise SweepError(_messages(exc, KINDS[kind])) from None


def grid_schema(kind: str = "quality") -> dict[str, Any]:
    """The JSON Schema of a grid file of `kind` (for editors: yaml-language-server, VS Code, ...)."""
    if kind not in KINDS:
        raise ConfigError(f"--kind: expected one of {list(KINDS)}, got {kind!r}")
    schema = KINDS[kind].model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "kvcompress sweep grid" if kind == "quality" else "kvcompress speed grid"
    return schema


def grid_path(source: str) -> Path | None:
    """The file a grid name or path names: the path (a relative one from this directory, then from
    KVCOMPRESS_HOME, the checkout a deployment's worker runs), else a built-in grid; None when none exists."""
    path = Path(source)
    home = os.environ.get("KVCOMPRESS_HOME")
    candidates = [path] if path.is_absolute() or not home else [path, Path(home) / path]
    return next((p for p in [*candidates, GRIDS_DIR / f"{source}.yaml"] if p.is_file()), None)


def load_spec(source: str | dict[str, Any] | SweepSpec | SpeedSpec) -> SweepSpec | SpeedSpec:
    """A spec from a parsed spec, a dict, a YAML path, or a built-in grid name (kvcompress/grids/NAME.yaml)."""
    if isinstance(source, (SweepSpec, SpeedSpec)):
        return source
    if isinstance(source, dict):
        return parse_spec(source)
    path = grid_path(source)
    if path is None:
        builtin = sorted(p.stem for p in GRIDS_DIR.glob("*.yaml"))
        where = ""
        if not Path(source).is_absolute() and source.endswith((".yaml", ".yml", ".json")):
            # a deployment's flow runs in the worker's directory, not where `prefect deployment run` was typed
            home = os.environ.get("KVCOMPRESS_HOME")
            where = (f" (a relative path is read from the directory of the process that runs the flow, "
                     f"{os.getcwd()}{f', then KVCOMPRESS_HOME={home}' if home else ''}: pass an absolute path)")
        raise SweepError([f"grid: expected a YAML file or one of {builtin}, got {source!r}{where}"])
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SweepError([f"grid: malformed YAML at {where}: {problem}"]) from None
    return parse_spec(data)
