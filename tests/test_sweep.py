"""Grid specs: per-method axes, up-front validation of every cell, dry-run, resume."""

from __future__ import annotations

import json

import pytest

from kvcompress_flows.cli import main as cli
from kvcompress.execute import execute_shard
from kvcompress.results import finished_run_ids
from kvcompress.sweep import SweepError, load_spec

GRID = {
    "name": "t",
    "decode_steps": 8,
    "datasets": [{"name": "passkey", "context_tokens": [256, 512], "num_samples": 2}],
    "methods": [
        {"name": "full"},
        {"name": "mlx-quant", "grid": {"bits": [4, 8]}},
        {"name": "streaming", "params": {"n_sink": 2}, "grid": {"budget": [0.25, 0.5, 64]}},
    ],
}


def test_axes_are_per_method_without_duplicate_cells():
    spec = load_spec(GRID)
    configs = [json.loads(c.to_json()) for c in spec.method_configs()]
    assert len(configs) == 1 + 2 + 3
    assert {c["name"] for c in configs if "bits" in c} == {"mlx-quant"}
    assert all(c["n_sink"] == 2 for c in configs if c["name"] == "streaming")
    shards = spec.shards()
    assert len(shards) == 2 * 2 and all(len(s.methods) == 6 for s in shards)
    assert spec.estimate()["runs"] == 24


def test_mapping_axis_sets_parameters_together():
    axis = load_spec({**GRID, "methods": [{"name": "streaming", "grid": {
        "window": [{"budget": 32, "n_sink": 2}, {"budget": 64, "n_sink": 8}]}}]}).method_configs()
    assert [(c.budget, c.n_sink) for c in axis] == [(32, 2), (64, 8)]


def test_every_invalid_cell_is_reported_at_once():
    bad = {
        **GRID,
        "decode_steps": 0,
        "datasets": [{"name": "passkey", "context_tokens": [256], "params": {"depth": 3.0}}],
        "methods": [{"name": "mlx-quant", "grid": {"bits": [4, 7]}}, {"name": "streaming", "grid": {"budget": [-1]}},
                    {"name": "no_such_method"}],
    }
    with pytest.raises(SweepError) as info:
        load_spec(bad).shards()
    text = str(info.value)
    assert len(info.value.errors) == 5, text
    for fragment in ("decode_steps", "depth", "mlx-quant.bits", "streaming.budget", "method: expected one of"):
        assert fragment in text


def test_unknown_keys_and_grid_names_are_rejected():
    with pytest.raises(SweepError, match=r"sweep.metods: unknown key"):
        load_spec({**GRID, "metods": []})
    with pytest.raises(SweepError, match=r"methods\[1\].name: required"):
        load_spec({**GRID, "methods": [{"name": "full"}, {"grid": {"bits": [4]}}]})
    with pytest.raises(SweepError, match="one of .*default.*smoke"):
        load_spec("no-such-grid")


def test_cli_dry_run_prints_grid_and_estimate(tmp_path, capsys):
    path = tmp_path / "grid.yaml"
    path.write_text(json.dumps(GRID))  # JSON is YAML
    assert cli(["sweep", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert sum(line.startswith("{\"") and "name" in line for line in out) == 6
    assert json.loads(out[-1])["runs"] == 24
    assert cli(["sweep", "no-such-grid", "--dry-run"]) == 2
    assert "grid: expected a YAML file" in capsys.readouterr().err


def test_rerun_skips_finished_runs_and_isolates_failures(tmp_path, embedded):
    grid = {**GRID, "decode_steps": 3, "datasets": [{"name": "passkey", "context_tokens": [256]}],
            "methods": [{"name": "full"}, {"name": "mlx-quant", "params": {"group_size": 128}},
                        {"name": "streaming", "grid": {"budget": [64]}}]}
    spec = load_spec(grid)
    (shard,) = spec.shards()
    root = str(tmp_path)
    first = execute_shard(shard, spec.model, spec.decode_steps, "s", root)
    # group_size 128 does not divide head_dim 64: that run fails, recorded; the others finish
    assert first == {"skipped": 0, "ran": 3, "failed": 1}
    assert len(finished_run_ids(root, "s")) == 3
    again = execute_shard(shard, spec.model, spec.decode_steps, "s", root)
    assert again == {"skipped": 3, "ran": 0, "failed": 0}
    import pyarrow.dataset as ds

    runs = ds.dataset(f"{root}/runs", partitioning="hive").to_table().to_pylist()
    status = {r["method"]: (r["status"], r["error"]) for r in runs}
    assert status["full"] == ("ok", None) and status["streaming"][0] == "ok"
    assert status["mlx-quant"][0] == "error" and "group_size" in status["mlx-quant"][1]


def test_ruler_task_lists_and_questions_become_one_shard_per_context():
    from kvcompress.sweep import load_spec

    spec = load_spec({"name": "q", "protocol": ["query_aware", "query_agnostic"],
                      "datasets": [{"name": "ruler", "params": {"task": ["niah_single_2", "niah_multikey_1"],
                                                                "questions": 2},
                                    "context_tokens": [1024], "num_samples": 2}],
                      "methods": [{"name": "full"}]})
    shards = spec.shards()
    assert [(s.sample_index, s.rows) for s in shards] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert all(s.to_dict()["protocols"] == ["query_aware", "query_agnostic"] for s in shards)
    assert spec.estimate()["runs"] == 8 * 2  # rows x methods x protocols


def test_structural_errors_name_the_field_and_the_allowed_values():
    with pytest.raises(SweepError) as info:
        load_spec({**GRID, "decode_steps": "8", "datasets": [{"name": "passkey", "seed": True, "colour": 1}]})
    assert info.value.errors == [
        "decode_steps: expected a valid integer, got '8'",
        "datasets[0].seed: expected a valid integer, got True",
        "datasets[0].colour: unknown key; allowed: ['context_tokens', 'name', 'num_samples', 'params', 'seed']",
    ]


def test_grid_schema_describes_the_grid(capsys):
    assert cli(["grid-schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"name", "datasets", "methods", "protocol", "decode_steps"} <= set(schema["properties"])
    assert schema["additionalProperties"] is False
    axis = schema["$defs"]["MethodAxis"]
    assert axis["required"] == ["name"] and set(axis["properties"]) == {"name", "params", "grid"}


def test_cli_sweep_parses_and_validates_the_grid_once(tmp_path, embedded, prefect_server, monkeypatch):
    """From the YAML file to the cache: the CLI parses the grid once and hands the flow the parsed
    spec; the spec is expanded once; each method config is validated once (shards carry the
    objects to the cache: no JSON round trip in between)."""
    from kvcompress.methods.eviction.streaming import Streaming
    from kvcompress.sweep import SweepSpec

    counts = {"parse": 0, "expand": 0}
    budgets = []
    parse, expand, post_init = SweepSpec.model_validate.__func__, SweepSpec._validate, Streaming.__post_init__
    monkeypatch.setattr(SweepSpec, "model_validate",
                        classmethod(lambda cls, *a, **k: counts.__setitem__("parse", counts["parse"] + 1) or
                                    parse(cls, *a, **k)))
    monkeypatch.setattr(SweepSpec, "_validate", lambda self: counts.__setitem__("expand", counts["expand"] + 1) or
                        expand(self))
    monkeypatch.setattr(Streaming, "__post_init__", lambda self: budgets.append(self.budget) or post_init(self))
    path = tmp_path / "grid.yaml"
    path.write_text(json.dumps({**GRID, "decode_steps": 2, "datasets": [{"name": "passkey", "context_tokens": [256]}],
                                "methods": [{"name": "streaming", "grid": {"budget": [64]}}]}))
    assert cli(["sweep", str(path), "--results", str(tmp_path / "results"), "--sweep-id", "once"]) == 0
    assert counts == {"parse": 1, "expand": 1} and budgets == [64]
    assert len(finished_run_ids(str(tmp_path / "results"), "once")) == 1


def test_quantize_in_params_and_as_an_axis_multiplies_budget_by_quantizer():
    axes = load_spec({**GRID, "methods": [
        {"name": "snapkv", "grid": {"budget": [0.25, 0.5],
                                    "quantize": [None, {"name": "kivi", "bits": 4}, {"name": "kivi", "bits": 2}]}},
        {"name": "adakv", "params": {"quantize": {"name": "turboquant", "bits": 3}}},
    ]})
    labels = [c.label() for c in axes.method_configs()]
    k4, k2 = "kivi bits=4 residual=32", "kivi bits=2 residual=32"  # a store's window: one group by default
    assert labels == ["snapkv budget=0.25", f"snapkv budget=0.25 + {k4}", f"snapkv budget=0.25 + {k2}",
                      "snapkv budget=0.5", f"snapkv budget=0.5 + {k4}", f"snapkv budget=0.5 + {k2}",
                      "adakv budget=0.5 + turboquant bits=3"]
    shard = axes.shards()[0]
    assert type(shard).from_dict(json.loads(json.dumps(shard.to_dict()))).methods == shard.methods  # Prefect's edge
    with pytest.raises(SweepError, match=r"snapkv.quantize: kivi.bits: expected one of 2, 3, 4, 8, got 5"):
        load_spec({**GRID, "methods": [{"name": "snapkv", "grid": {"quantize": [{"name": "kivi", "bits": 5}]}}]}).shards()
    with pytest.raises(SweepError, match=r"h2o.quantize: h2o evicts while decoding"):
        load_spec({**GRID, "methods": [{"name": "h2o", "params": {"quantize": {"name": "kivi"}}}]}).shards()
COMPRESSIONS = {0.5, 0.25, 0.125, 0.0625}  # 2x, 4x, 8x, 16x


@pytest.mark.parametrize("grid", ["nightly", "benchmarks/grids/quality.yaml"])
def test_nightly_and_quality_grids_cover_2x_to_16x_for_every_eviction_method(grid):
    from kvcompress.methods.eviction.base import Eviction

    spec = load_spec(grid)
    configs = spec.method_configs()
    budgets: dict[str, set] = {}
    for c in configs:
        if isinstance(c, Eviction):
            budgets.setdefault(c.name, set()).add(c.budget)
    assert budgets and all(b == COMPRESSIONS for b in budgets.values()), budgets
    assert "duoattention" in budgets
    per_config = sum(s.rows for s in spec.shards()) * len(spec.protocol)
    assert spec.estimate()["runs"] == len(configs) * per_config


def test_budgets_down_to_a_32nd_of_the_prompt_validate_and_resolve():
    from kvcompress.methods import REGISTRY, method_config
    from kvcompress.methods.eviction.base import Eviction

    spec = load_spec({**GRID, "methods": [{"name": "streaming", "grid": {"budget": [0.0625, 0.03125]}},
                                          {"name": "knorm", "grid": {"budget": [0.03125]}}]})
    assert [c.budget for c in spec.method_configs()] == [0.0625, 0.03125, 0.03125]
    for name, cls in REGISTRY.items():
        if issubclass(cls, Eviction) and name != "duoattention":  # its windows: 128 + 256 by default
            cfg = method_config(name, budget=0.03125)
            if not (cfg.n_sink or cfg.recent or getattr(cfg.scoring(), "recent", 0)):
                assert cfg.resolve(4096)[0] == 128, name
    assert method_config("duoattention", budget=0.03125).resolve(16384)[0] == 512


def test_a_fractional_budget_below_a_methods_protected_window_is_refused_up_front():
    bad = {**GRID, "datasets": [{"name": "passkey", "context_tokens": [1024]}],
           "methods": [{"name": "snapkv", "grid": {"budget": [0.0625, 0.03125]}}]}
    with pytest.raises(SweepError) as info:
        load_spec(bad).shards()
    assert len(info.value.errors) == 1
    assert "snapkv budget=0.03125" in str(info.value) and "context_tokens 1024" in str(info.value)


def test_gguf_models_in_a_grid(tmp_path, monkeypatch):
    """`model:` takes the embedded Qwen name (its window known without the file) and .gguf paths
    (the window read from the file); a .gguf path that is not a file is refused up front."""
    import numpy as np
    from gguf_files import CONTEXT, tiny_model

    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "cache"))
    qwen = {**GRID, "model": "qwen2.5-coder-1.5b"}
    assert load_spec({**qwen, "datasets": [{"name": "passkey", "context_tokens": [16384], "num_samples": 2}]}).shards()
    with pytest.raises(SweepError, match=r"context_tokens: expected at most 32768 \(the context window of qwen2.5-coder-1.5b\)"):
        load_spec({**qwen, "datasets": [{"name": "passkey", "context_tokens": [40000], "num_samples": 2}]}).shards()
    with pytest.raises(SweepError, match="model: expected an existing GGUF file"):
        load_spec({**GRID, "model": str(tmp_path / "missing.gguf")}).shards()
    path = tmp_path / "tiny.gguf"
    tiny_model(path, "qwen2", np.random.default_rng(0))
    assert len(load_spec({**GRID, "model": str(path)}).shards()) == 4  # 256 and 512 tokens fit its window
    with pytest.raises(SweepError, match=rf"expected at most {CONTEXT} \(the context window of {path}\)"):
        load_spec({**GRID, "model": str(path), "datasets": [{"name": "passkey", "context_tokens": [1024]}]}).shards()
