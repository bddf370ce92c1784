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
schedule). A shard is one dataset sample with every method cell: one prefill serves them all.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import datasets
from .errors import ConfigError
from .methods import method_config
from .methods.base import Method
from .model import context_window
from .results import validate_sweep_id
from .runner import PROTOCOLS

GRIDS_DIR = Path(__file__).parent / "grids"

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


@dataclass(frozen=True)
class DatasetAxis:
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    context_tokens: tuple[int, ...] = (1024,)
    num_samples: int = 1
    seed: int = 0

    def loader_params(self, context_tokens: int) -> dict[str, Any]:
        return {**self.params, "context_tokens": context_tokens, "num_samples": self.num_samples, "seed": self.seed}


@dataclass(frozen=True)
class MethodAxis:
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list] = field(default_factory=dict)

    def cells(self) -> list[dict[str, Any]]:
        """Parameter dicts of every cell: fixed params updated by one value of each axis."""
        axes = [[v if isinstance(v, dict) else {key: v} for v in values] for key, values in self.grid.items()]
        return [
            {**self.params, **{k: v for choice in combo for k, v in choice.items()}}
            for combo in itertools.product(*axes)
        ]


@dataclass(frozen=True)
class Shard:
    """One dataset (at one context length) context: its rows sample_index .. sample_index + rows - 1
    (several questions about one context, or one sample), with every method cell and protocol."""

    dataset: str
    dataset_params: dict[str, Any]
    sample_index: int
    methods: tuple[Method, ...]
    protocols: tuple[str, ...] = ("query_aware",)
    rows: int = 1

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON form (what Prefect tasks take and `kvcompress.execute` reads)."""
        return {
            "dataset": self.dataset,
            "dataset_params": json.dumps(self.dataset_params, sort_keys=True),
            "sample_index": self.sample_index,
            "methods": [m.to_json() for m in self.methods],
            "protocols": list(self.protocols),
            "rows": self.rows,
        }


@dataclass(frozen=True)
class SweepSpec:
    name: str
    model: str = "smollm2-135m"
    decode_steps: int | None = None  # cap on the reference answer; None: EOS or the task's answer budget
    protocol: tuple[str, ...] = ("query_aware",)
    run_timeout_s: float | None = 1800.0  # per method run; a slower run is recorded as "timeout"
    allow_beyond_window: bool = False  # run contexts longer than the model was trained on (marked)
    datasets: tuple[DatasetAxis, ...] = ()
    methods: tuple[MethodAxis, ...] = ()

    def method_configs(self) -> list[Method]:
        """Every method cell as a validated config; raises SweepError listing all invalid cells."""
        return self._expand()

    def shards(self) -> list[Shard]:
        methods = self._expand()
        shards = []
        for axis in self.datasets:
            for length in axis.context_tokens:
                config = datasets.dataset_config(axis.name, axis.loader_params(length))
                per_context = config.rows_per_context
                shards += [Shard(axis.name, axis.loader_params(length), index, tuple(methods), tuple(self.protocol),
                                 per_context) for index in range(0, config.row_count(), per_context)]
        return shards

    def _expand(self) -> list[Method]:
        errors: list[str] = []
        try:
            validate_sweep_id(self.name, "name")
        except ConfigError as exc:
            errors.append(str(exc))
        if not isinstance(self.allow_beyond_window, bool):
            errors.append(f"allow_beyond_window: expected true or false, got {self.allow_beyond_window!r}")
        window = self.context_window()
        if self.decode_steps is not None and not (isinstance(self.decode_steps, int) and 1 <= self.decode_steps <= 4096):
            errors.append(f"decode_steps: expected an int in [1, 4096] or null (no cap), got {self.decode_steps!r}")
        if not self.protocol or any(p not in PROTOCOLS for p in self.protocol) or len(set(self.protocol)) < len(self.protocol):
            errors.append(f"protocol: expected a non-empty list of distinct values from {list(PROTOCOLS)}, "
                          f"got {list(self.protocol)!r}")
        if self.run_timeout_s is not None and not (isinstance(self.run_timeout_s, (int, float)) and self.run_timeout_s > 0):
            errors.append(f"run_timeout_s: expected a number of seconds > 0 or null, got {self.run_timeout_s!r}")
        if not self.datasets:
            errors.append("datasets: expected at least one dataset")
        if not self.methods:
            errors.append("methods: expected at least one method")
        for i, axis in enumerate(self.datasets):
            for length in axis.context_tokens:
                try:
                    datasets.validate(axis.name, axis.loader_params(length))
                except ConfigError as exc:
                    errors.append(f"datasets[{i}] ({axis.name}): {exc}")
                if window and isinstance(length, int) and length > window and self.allow_beyond_window is not True:
                    errors.append(f"datasets[{i}] ({axis.name}).context_tokens: expected at most {window} (the "
                                  f"context window of {self.model}), got {length}; set `allow_beyond_window: true` "
                                  f"to run it anyway (its runs are marked)")
        configs: list[Method] = []
        for i, axis in enumerate(self.methods):
            for params in axis.cells():
                try:
                    configs.append(method_config(axis.name, **params))
                except (ConfigError, TypeError) as exc:
                    errors.append(f"methods[{i}] ({axis.name} {params}): {exc}")
        duplicates = {c.to_json() for c in configs if sum(d == c for d in configs) > 1}
        errors += [f"methods: duplicate cell {d}" for d in sorted(duplicates)]
        if errors:
            raise SweepError(errors)
        return configs

    def context_window(self) -> int | None:
        """The model's context window (None when unknown offline; a bad model name is the loader's error)."""
        try:
            return context_window(self.model)
        except ConfigError:
            return None

    def estimate(self) -> dict[str, Any]:
        """Cells, shards and a rough CPU time for `--dry-run`."""
        methods, shards = self.method_configs(), self.shards()
        prefill_tokens = sum(s.dataset_params["context_tokens"] for s in shards)
        # reference decode + per method and protocol a teacher-forced and a free-running decode
        # (answers end at EOS, usually well before the budget: 32 tokens each is a rough guess)
        steps = self.decode_steps or 32
        rows = sum(s.rows for s in shards)
        decode_tokens = rows * steps * (1 + 2 * len(methods) * len(self.protocol))
        seconds = prefill_tokens / PREFILL_TOK_S + decode_tokens / DECODE_TOK_S
        return {"runs": rows * len(methods) * len(self.protocol), "shards": len(shards), "methods": len(methods),
                "prefill_tokens": prefill_tokens, "decode_tokens": decode_tokens, "estimated_cpu_s": round(seconds)}


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _mapping(d: Any, allowed: set[str], where: str, named: bool = True) -> dict:
    """`d` as a mapping with only `allowed` keys (and a `name` when `named`), else a SweepError."""
    if not isinstance(d, dict):
        raise SweepError([f"{where}: expected a mapping, got {d!r}"])
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise SweepError([f"{where}.{unknown[0]}: unknown key; allowed: {sorted(allowed)}"])
    if named and "name" not in d:
        raise SweepError([f"{where}.name: required"])
    return d


def parse_spec(data: dict[str, Any]) -> SweepSpec:
    """Build a spec from a mapping, rejecting unknown keys with their allowed names."""
    top = _mapping(data, {"name", "model", "decode_steps", "protocol", "run_timeout_s", "allow_beyond_window",
                          "datasets", "methods"}, "sweep", named=False)
    dataset_axes = []
    for i, raw in enumerate(top.get("datasets") or []):
        d = _mapping(raw, {"name", "params", "context_tokens", "num_samples", "seed"}, f"datasets[{i}]")
        dataset_axes.append(DatasetAxis(
            name=d["name"], params=dict(d.get("params") or {}),
            context_tokens=_as_tuple(d.get("context_tokens", 1024)),
            num_samples=d.get("num_samples", 1), seed=d.get("seed", 0),
        ))
    method_axes = []
    for i, raw in enumerate(top.get("methods") or []):
        m = _mapping(raw, {"name", "params", "grid"}, f"methods[{i}]")
        method_axes.append(MethodAxis(name=m["name"], params=dict(m.get("params") or {}),
                                      grid={k: list(_as_tuple(v)) for k, v in (m.get("grid") or {}).items()}))
    return SweepSpec(name=str(top.get("name", "sweep")), model=top.get("model", "smollm2-135m"),
                     decode_steps=top.get("decode_steps"),
                     protocol=_as_tuple(top.get("protocol", "query_aware")), run_timeout_s=top.get("run_timeout_s", 1800.0),
                     allow_beyond_window=top.get("allow_beyond_window", False), datasets=tuple(dataset_axes),
                     methods=tuple(method_axes))


def load_spec(source: str | dict[str, Any]) -> SweepSpec:
    """A spec from a dict, a YAML path, or a built-in grid name (kvcompress/grids/NAME.yaml)."""
    if isinstance(source, dict):
        return parse_spec(source)
    path = Path(source)
    if not path.exists():
        path = GRIDS_DIR / f"{source}.yaml"
    if not path.exists():
        builtin = sorted(p.stem for p in GRIDS_DIR.glob("*.yaml"))
        raise SweepError([f"grid: expected a YAML file or one of {builtin}, got {source!r}"])
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SweepError([f"grid: malformed YAML at {where}: {problem}"]) from None
    return parse_spec(data)
