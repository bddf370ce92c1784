"""A one-line evaluation (`kvcompress eval --method snapkv --budget 0.25 --dataset ruler:niah_single_2`)
as the very grid a YAML file would give: `eval_spec` writes the mapping and `parse_spec` validates it,
so a bad method, budget or dataset gets the grid's own error, and the sweep runs it as any grid.

The full cache is always a cell (every "vs full" is against it). `--budget` and `--param KEY=VALUE`
become grid axes of the methods that have that parameter (`--param bits=2 --param bits=4`: two
cells); `--param snapkv.recent=16` names one method. A dataset is `NAME` or `NAME:TASK`, TASK being
the dataset's task parameter (ruler's `task`, niah's `variant`, longbench's `subset`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from .errors import ConfigError
from .methods import list_methods
from .sweep import SweepSpec, parse_spec

# The parameter `NAME:TASK` sets, per dataset that has one
TASK_PARAMS = {"ruler": "task", "niah": "variant", "longbench": "subset"}


def parse_dataset(text: str) -> dict[str, Any]:
    """`ruler:niah_single_2` -> {name: ruler, params: {task: niah_single_2}}; `passkey` -> {name: passkey}."""
    name, sep, task = text.partition(":")
    if not sep:
        return {"name": name, "params": {}}
    if name not in TASK_PARAMS or not task:
        raise ConfigError(f"--dataset: expected NAME or NAME:TASK (TASK for one of {sorted(TASK_PARAMS)}), got {text!r}")
    return {"name": name, "params": {TASK_PARAMS[name]: task}}


def parse_param(text: str) -> tuple[str | None, str, Any]:
    """`bits=4` -> (None, "bits", 4); `snapkv.recent=16` -> ("snapkv", "recent", 16). The value is read
    as YAML (numbers, booleans, null, lists), as in a grid file."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--param: expected KEY=VALUE or METHOD.KEY=VALUE, got {text!r}")
    method, _, key = key.rpartition(".")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        parsed = value
    return method or None, key, parsed


def eval_spec(methods: list[str], budgets: list[float], params: list[str], datasets: list[str],
              contexts: list[int], num_samples: int, protocols: list[str], model: str, seed: int = 0) -> SweepSpec:
    """The validated grid of a one-line evaluation, named `eval-<hash of the grid>` (a rerun of the same
    line resumes it; another line never mixes its runs in)."""
    known = {m["name"]: m["params"] for m in list_methods()}
    names = ["full"] + [m for m in dict.fromkeys(methods) if m != "full"]
    axes: dict[str, dict[str, list[Any]]] = {name: {} for name in names}
    wanted = [("--budget", None, "budget", b) for b in budgets] + [(f"--param {p}", *parse_param(p)) for p in params]
    for flag, target, key, value in wanted:
        if target is not None and target not in axes:
            raise ConfigError(f"{flag}: expected a method of --method {names[1:]}, got {target!r}")
        takers = [n for n in names[1:] if (target in (None, n)) and (n not in known or key in known[n])]
        if not takers:
            offered = {n: sorted(known[n]) for n in names[1:] if n in known}
            raise ConfigError(f"{flag}: no method of {names[1:]} has a parameter {key!r}; theirs: {offered}")
        for name in takers:
            values = axes[name].setdefault(key, [])
            if value not in values:
                values.append(value)
    grid = {
        "model": model,
        "protocol": list(protocols),
        "datasets": [{**parse_dataset(d), "context_tokens": list(contexts), "num_samples": num_samples, "seed": seed}
                     for d in datasets],
        "methods": [{"name": name, **({"grid": axes[name]} if axes[name] else {})} for name in names],
    }
    digest = hashlib.sha256(json.dumps(grid, sort_keys=True).encode()).hexdigest()[:8]
    spec = parse_spec({"name": f"eval-{digest}", **grid})
    spec.plan()  # every cell validated here (a SweepError lists them all), before any work
    return spec
