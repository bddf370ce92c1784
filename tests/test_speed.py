"""The speed sweep (kvcompress/speed.py, kvcompress/shapes.py, `kind: speed` grids, flows/speed.py):
grid validation before any work, random-weight shapes, batch fitting, and a tiny CPU speed sweep through
the CLI and its Prefect flow into the `speed` table, read back by throughput.sql and the reports."""

import kvcompress  # noqa: F401  (first: preloads OpenBLAS before anything imports mlx)

import json
from pathlib import Path

import pyarrow.dataset as pads
import pytest
import yaml
from pytest import approx

from kvcompress.errors import ConfigError
from kvcompress.sweep import SpeedSpec, SweepError, load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent
TINY = {"shape": "tiny-llama", "dtype": "float32", "layers": 2}
GRID = {"kind": "speed", "name": "tiny-speed", "model": TINY, "context_tokens": [256], "steps": 2, "rounds": 2,
        "warmup": 1, "methods": [{"name": "full"}, {"name": "kivi", "grid": {"bits": [2]}}]}
# KV of one 256-token sequence of the 2-layer tiny Llama: 2 layers x K and V x 2 heads x 32 x 4 bytes x 256
FULL_BYTES_PER_SEQUENCE = 2 * 2 * 2 * 32 * 4 * 256


def errors_of(grid: dict) -> str:
    with pytest.raises(SweepError) as caught:
        parse_spec(grid).plan()
    return str(caught.value)


def test_speed_grid_validates_every_field_before_any_work():
    plan = parse_spec({**GRID, "batch": [1, 2]}).plan()
    assert [(g.context_tokens, g.batch, g.kv_budget_bytes) for g in plan.groups] == [(256, 1, None), (256, 2, None)]
    assert [m.label() for m in plan.methods] == ["full", "kivi bits=2"] and plan.runs == 4
    plan = parse_spec({**GRID, "kv_budget_gib": 0.5}).plan()  # a scalar is a one-value axis
    assert [(g.batch, g.kv_budget_bytes) for g in plan.groups] == [(None, 2**29)]

    assert "batch, kv_budget_gib: expected exactly one of them" in errors_of(GRID)
    assert "got both" in errors_of({**GRID, "batch": [1], "kv_budget_gib": [1]})
    message = errors_of({**GRID, "batch": [0], "steps": 0, "model": {"shape": "llama-9b", "dtype": "int8"},
                         "methods": [{"name": "kivi", "grid": {"bits": [5]}}]})
    assert message.startswith("5 invalid settings; nothing was run:")
    for line in ["model.shape: expected one of ['llama-3.1-8b', 'llama-3.2-1b', 'mistral-7b', 'qwen3-8b', "
                 "'tiny-llama'] or a config.json path, got 'llama-9b'",
                 "model.dtype: expected one of ['float16', 'bfloat16', 'float32'], got 'int8'",
                 "batch: expected a non-empty list of ints >= 1, got [0]", "steps: expected an int >= 1, got 0",
                 "methods[0] (kivi {'bits': 5}): kivi.bits: expected one of"]:
        assert line in message, line
    assert "methods: expected a `full` cell" in errors_of({**GRID, "batch": 1, "methods": [{"name": "kivi"}]})
    assert errors_of({**GRID, "batch": 1, "model": {**TINY, "dtyp": "x"}}).startswith(
        "model.dtyp: unknown key; allowed: ['dtype', 'layers', 'shape']")
    assert errors_of({**GRID, "batch": 1, "contexts": [1]}).startswith("sweep.contexts: unknown key; allowed: [")
    assert errors_of({**GRID, "kind": "sped"}) == "kind: expected one of ['quality', 'speed'], got 'sped' (nothing was run)"
    assert "context_tokens: expected at most 8192 (the context window of smollm2-135m), got 9000" in errors_of(
        {**GRID, "batch": 1, "model": "smollm2-135m", "context_tokens": 9000})


def test_shapes_from_the_table_or_a_config_file(tmp_path):
    from kvcompress.shapes import SHAPES, random_model, shape_config

    assert shape_config("llama-3.1-8b")["num_hidden_layers"] == 32 and shape_config("qwen3-8b", layers=2)[
        "num_hidden_layers"] == 2
    (tmp_path / "config.json").write_text(json.dumps({**SHAPES["tiny-llama"], "num_key_value_heads": 4}))
    assert shape_config(str(tmp_path))["num_key_value_heads"] == 4  # a directory holding a config.json
    (tmp_path / "odd.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    assert "no-such-arch" in errors_of({**GRID, "batch": 1, "model": {"shape": str(tmp_path / "odd.json")}})
    with pytest.raises(ConfigError, match="model.layers: expected an int >= 1"):
        shape_config("tiny-llama", layers=0)
    model = random_model("tiny-llama", "float32", layers=2)
    assert len(model.layers) == 2 and model.args.vocab_size == 4096
    assert random_model("tiny-llama", "float32", layers=2) is model  # built once per process


def test_fit_batch_and_the_batch_check():
    from mlx_lm.models.cache import KVCache

    from kvcompress import speed
    from kvcompress.shapes import random_model

    assert speed.fit_batch(4 * 2**30, 16 * 2**30) == 4  # the 8B full cache at 32k under 16 GiB
    assert speed.fit_batch(777 * 2**20, 16 * 2**30) == 21 and speed.fit_batch(777 * 2**20, 16 * 2**30, 8) == 8
    assert speed.fit_batch(2**31, 2**30) == 0

    class OneSequenceOnly(KVCache):
        def update_and_fetch(self, keys, values):
            if keys.shape[0] > 1:
                raise ValueError("one sequence at a time")
            return super().update_and_fetch(keys, values)

    model = random_model("tiny-llama", "float32", layers=2)
    speed.check_batched(model, "full", lambda: [KVCache() for _ in model.layers])
    with pytest.raises(ConfigError, match=r"odd: does not run a batch of 2 sequences \(ValueError: one sequence"):
        speed.check_batched(model, "odd", lambda: [OneSequenceOnly() for _ in model.layers])


def speed_rows(root: Path) -> list[dict]:
    return pads.dataset(root / "speed", partitioning="hive", format="parquet").to_table().to_pylist()


def test_explicit_batches_measure_every_round_and_resume(tmp_path):
    """Library level (no Prefect): batches 1 and 2, each a group of caches taking turns."""
    from kvcompress.execute import check_speed_plan, execute_speed_group

    plan = parse_spec({**GRID, "batch": [1, 2]}).plan()
    check_speed_plan(plan)
    counts = [execute_speed_group(plan, group, "b", str(tmp_path)) for group in plan.groups]
    assert counts == [{"skipped": 0, "ran": 2, "failed": 0}] * 2
    rows = speed_rows(tmp_path)
    assert len(rows) == 2 * 2 * 2  # groups x caches x rounds
    for r in rows:
        assert r["status"] == "ok" and r["round"] in (0, 1) and r["kv_budget_bytes"] is None
        assert r["decode_tok_s"] == approx(r["batch"] * 1e3 / r["decode_ms"]) and r["host_ms"] < r["decode_ms"]
        assert r["pipelined_tok_s"] > 0 and r["peak_memory_bytes"] > r["weight_bytes"] > 0
        assert (r["prefill_s"] is not None) == (r["round"] == 0)  # one timed prefill (prefill_rounds: 1)
        if r["method"] == "full":
            assert r["live_kv_bytes"] == r["batch"] * FULL_BYTES_PER_SEQUENCE
        config = json.loads(r["config"])
        assert config["batch"] == r["batch"] and config["model"]["config"]["num_hidden_layers"] == 2
    kivi = {r["batch"]: r["live_kv_bytes"] for r in rows if r["method"] == "kivi"}
    assert kivi[2] == 2 * kivi[1] < 2 * FULL_BYTES_PER_SEQUENCE
    # a rerun skips every finished measurement
    assert execute_speed_group(plan, plan.groups[0], "b", str(tmp_path)) == {"skipped": 2, "ran": 0, "failed": 0}


def test_tiny_cpu_speed_sweep_through_the_cli(tmp_path, prefect_server, capsys):
    """`kvcompress sweep GRID` on a speed grid: each cache at the largest batch whose KV fits the
    budget, written to the speed table, read by throughput.sql, shown by `kvcompress report --all`."""
    from kvcompress_flows.cli import main as cli
    from kvcompress_reports import connect, run_report

    budget = 3 * FULL_BYTES_PER_SEQUENCE  # 0.75 MiB: 3 full sequences, more KIVI ones
    grid = tmp_path / "speed.yaml"
    grid.write_text(yaml.safe_dump({**GRID, "kv_budget_gib": [budget / 2**30]}))
    results = str(tmp_path / "results")
    assert cli(["sweep", str(grid), "--results", results]) == 0
    screen = capsys.readouterr().out
    assert "Speed sweep tiny-speed: tiny-llama random (2 layers) float32 on cpu" in screen

    rows = speed_rows(tmp_path / "results")
    assert len(rows) == 2 * 2 and {r["status"] for r in rows} == {"ok"}
    batch = {r["method"]: r["batch"] for r in rows}
    per_sequence = {r["method"]: r["kv_bytes_per_sequence"] for r in rows}
    assert batch["full"] == 3 and per_sequence["full"] == FULL_BYTES_PER_SEQUENCE
    assert batch["kivi"] == budget // per_sequence["kivi"] > batch["full"]  # compression pays by memory
    assert all(r["live_kv_bytes"] <= budget and r["kv_budget_bytes"] == budget for r in rows)

    columns, report = run_report(connect(results), "throughput")
    table = {r["config_label"]: r for r in (dict(zip(columns, row)) for row in report)}
    assert set(table) == {"full", "kivi bits=2"} and table["full"]["x_full"] == 1.0
    kivi = [r for r in rows if r["method"] == "kivi"]
    full = {r["round"]: r["decode_tok_s"] for r in rows if r["method"] == "full"}
    ratios = sorted(r["decode_tok_s"] / full[r["round"]] for r in kivi)
    assert table["kivi bits=2"]["x_full"] == approx(sum(ratios) / 2)  # the median of two rounds
    assert (table["kivi bits=2"]["x_full_min"], table["kivi bits=2"]["x_full_max"]) == approx(tuple(ratios))
    assert table["kivi bits=2"]["batch"] == batch["kivi"] and table["kivi bits=2"]["rounds"] == 2

    assert cli(["report", "--results", results, "--all", "--no-html"]) == 0
    out = capsys.readouterr().out
    assert "== throughput (2 rows)" in out and "kivi bits=2" in out.split("== throughput")[1]
    page = tmp_path / "r.html"
    assert cli(["report", "--results", results, "--html", str(page)]) == 0
    data = json.loads(page.read_text().split('id="report-data">')[1].split("</script>")[0])
    assert {r["config_label"] for r in data["throughput"]} == {"full", "kivi bits=2"}
    assert data["methods"] == ["full", "kivi"]

    # a rerun measures nothing again
    before = sorted(p.stat().st_mtime_ns for p in (tmp_path / "results" / "speed").rglob("*.parquet"))
    assert cli(["sweep", str(grid), "--results", results]) == 0
    assert sorted(p.stat().st_mtime_ns for p in (tmp_path / "results" / "speed").rglob("*.parquet")) == before


def test_the_speed_deployments_and_built_in_grids():
    deployments = {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    for name, grid in (("h200", "speed-h200"), ("cpu", "speed-cpu")):
        assert deployments[name]["entrypoint"] == "flows/speed.py:speed"
        assert deployments[name]["parameters"] == {"grid": grid}
        spec = load_spec(grid)
        assert isinstance(spec, SpeedSpec) and spec.plan().runs >= 5
    h200 = load_spec("speed-h200").plan()
    assert h200.model.identity()["config"]["hidden_size"] == 4096 and h200.model.resolved_dtype() == "float16"
    assert [(g.context_tokens, g.kv_budget_bytes) for g in h200.groups] == [(32768, 16 * 2**30), (131072, 16 * 2**30)]
    assert {m.label() for m in h200.methods} >= {"full", "kivi bits=2", "kivi bits=4", "snapkv budget=0.5"}


def test_a_group_that_cannot_fit_the_device_is_refused_before_any_measurement(tmp_path):
    """check_speed_plan estimates each group's peak (weights + the KV of the caches held beside a
    cache's prefill + its batch x one sequence's measured prefill peak) and refuses the groups over
    `device_memory_gib` with the numbers; a grid whose groups fit runs."""
    from mlx_lm.models.cache import KVCache

    from kvcompress import speed
    from kvcompress.execute import check_speed_plan, execute_speed_group
    from kvcompress.shapes import random_model

    # the peak of a group: cache 1 is prefilled beside cache 0's KV; a second prefill round beside all
    assert speed.group_peak_bytes(100, [(2, 50, 10), (3, 40, 5)]) == (100 + 2 * 10 + 3 * 40, 1, 20)
    assert speed.group_peak_bytes(100, [(2, 50, 10), (3, 40, 5)], prefill_rounds=2) == (100 + 35 + 3 * 40, 1, 35)
    assert speed.device_memory_bytes() > 2**30  # the machine's RAM on the CPU

    model = random_model("tiny-llama", "float32", layers=2)
    make = lambda: [KVCache() for _ in model.layers]  # noqa: E731
    peak, kv = speed.sequence_footprint(model, make, 256)
    assert kv == FULL_BYTES_PER_SEQUENCE and peak >= kv
    # past two chunks, measured at 65 and 129 tokens and extended on the line: the KV is linear in T
    assert speed.sequence_footprint(model, make, 1024, chunk=64)[1] == 4 * FULL_BYTES_PER_SEQUENCE
    # a budget with no room at the short lengths (32 tokens of 65, 40 sinks) is measured at T itself
    from kvcompress.methods.registry import method_config
    sinks = method_config("streaming", budget=0.5, n_sink=40)
    assert speed.sequence_footprint(model, lambda: sinks.make_cache(model), 512, chunk=64)[1] == (
        speed.sequence_footprint(model, lambda: sinks.make_cache(model), 512)[1])

    weights = speed.weight_bytes(model)
    limit = weights + 4 * (peak + FULL_BYTES_PER_SEQUENCE)  # batch 1 fits, batch 8 does not
    grid = {**GRID, "batch": [1, 8], "device_memory_gib": limit / 2**30}
    with pytest.raises(SweepError) as caught:
        check_speed_plan(parse_spec(grid).plan())
    message = str(caught.value)
    assert "256 tokens, batch 8: needs about" in message and "batch 1:" not in message
    assert f"more than the {parse_spec(grid).plan().device_memory_bytes} bytes" in message and "at batch 8 (" in message
    assert "device_memory_gib: expected GiB > 0 or null, got 0.0" in errors_of({**grid, "device_memory_gib": 0})

    plan = parse_spec({**grid, "batch": [1]}).plan()
    check_speed_plan(plan)
    assert execute_speed_group(plan, plan.groups[0], "fits", str(tmp_path)) == {"skipped": 0, "ran": 2, "failed": 0}
    measured = {r["method"]: r["peak_memory_bytes"] for r in speed_rows(tmp_path)}
    assert measured["full"] == approx(weights + peak, rel=0.25)  # the estimate is what a run peaks at
