"""`kvcompress eval`: the one-line evaluation is the grid a YAML file gives, validated and run the same way."""

from __future__ import annotations

import re

import duckdb
import pytest
import yaml

from kvcompress.errors import ConfigError
from kvcompress.oneline import eval_spec, parse_dataset, parse_param
from kvcompress.sweep import SweepError, load_spec
from tests.test_cli import kvcompress, one_line_error


def test_the_line_plans_exactly_what_the_equivalent_yaml_grid_plans(tmp_path):
    spec = eval_spec(["snapkv", "kivi"], [0.25, 0.5], ["kivi.bits=2", "kivi.bits=4", "recent=16"],
                     ["ruler:niah_single_2", "passkey"], [1024, 2048], 3, ["query_aware", "query_agnostic"],
                     "smollm2-135m")
    grid = tmp_path / "same.yaml"
    grid.write_text(yaml.safe_dump({
        "name": spec.name, "model": "smollm2-135m", "protocol": ["query_aware", "query_agnostic"],
        "datasets": [{"name": "ruler", "params": {"task": "niah_single_2"}, "context_tokens": [1024, 2048],
                      "num_samples": 3, "seed": 0},
                     {"name": "passkey", "context_tokens": [1024, 2048], "num_samples": 3, "seed": 0}],
        "methods": [{"name": "full"}, {"name": "snapkv", "grid": {"budget": [0.25, 0.5], "recent": [16]}},
                    {"name": "kivi", "grid": {"bits": [2, 4]}}],
    }))
    assert spec.plan() == load_spec(str(grid)).plan()
    assert [m.label() for m in spec.plan().methods] == [
        "full", "snapkv budget=0.25 recent=16", "snapkv budget=0.5 recent=16", "kivi bits=2", "kivi bits=4"]
    assert spec.plan().runs == 2 * 3 * 2 * 5 * 2  # datasets x samples x contexts x cells x protocols
    # the same line, the same sweep id (a rerun resumes); another line, another one
    assert eval_spec(["snapkv"], [0.25], [], ["passkey"], [512], 2, ["query_aware"], "smollm2-135m").name == \
        eval_spec(["snapkv"], [0.25], [], ["passkey"], [512], 2, ["query_aware"], "smollm2-135m").name != \
        eval_spec(["snapkv"], [0.5], [], ["passkey"], [512], 2, ["query_aware"], "smollm2-135m").name


def test_parsing_of_datasets_and_params():
    assert parse_dataset("ruler:vt") == {"name": "ruler", "params": {"task": "vt"}}
    assert parse_dataset("niah:multikey") == {"name": "niah", "params": {"variant": "multikey"}}
    assert parse_dataset("lm") == {"name": "lm", "params": {}}
    assert parse_param("snapkv.recent=16") == ("snapkv", "recent", 16)
    assert parse_param("bits=4") == (None, "bits", 4)
    assert parse_param("quantize={name: kivi, bits: 4}") == (None, "quantize", {"name": "kivi", "bits": 4})
    with pytest.raises(ConfigError, match=r"--dataset: expected NAME or NAME:TASK .*got 'passkey:x'"):
        parse_dataset("passkey:x")
    with pytest.raises(ConfigError, match=r"--param: expected KEY=VALUE"):
        parse_param("bits")


def test_bad_values_get_the_grids_own_errors_all_at_once():
    with pytest.raises(SweepError) as caught:
        eval_spec(["snapkv", "nosuch"], [1.5], [], ["rulerx"], [9000], 2, ["query_aware"], "smollm2-135m")
    errors = caught.value.errors
    assert any(e.startswith("datasets[0] (rulerx): dataset: expected one of [") for e in errors), errors
    assert any("context_tokens: expected at most 8192" in e for e in errors), errors
    assert any(e.startswith("methods[1] (snapkv {'budget': 1.5}): snapkv.budget: expected") for e in errors), errors
    assert any(e.startswith("methods[2] (nosuch ") for e in errors), errors
    with pytest.raises(ConfigError, match=r"--param bits=4: no method of \['snapkv'\] has a parameter 'bits'"):
        eval_spec(["snapkv"], [], ["bits=4"], ["passkey"], [512], 2, ["query_aware"], "smollm2-135m")
    with pytest.raises(ConfigError, match=r"--budget: no method of \['kivi'\] has a parameter 'budget'"):
        eval_spec(["kivi"], [0.5], [], ["passkey"], [512], 2, ["query_aware"], "smollm2-135m")


def test_eval_dry_run_and_one_line_errors_from_the_command(tmp_path):
    done = kvcompress("eval", "--method", "snapkv", "--budget", "0.25", "--dataset", "ruler:niah_single_2",
                      "--context", "4096", "-n", "20", "--dry-run")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == '{"layers": "global", "name": "full"}'
    assert '"budget": 0.25' in lines[1] and '"name": "snapkv"' in lines[1]
    assert sum(line.startswith("shard ruler") for line in lines) == 20
    assert '"runs": 40' in lines[-1]
    error = one_line_error(kvcompress("eval", "--method", "kivi", "--param", "bits=3", "--protocol", "sideways",
                                      "--dry-run", env={"PREFECT_HOME": str(tmp_path)}))
    assert "protocol: expected a non-empty list of distinct values from ['query_aware', 'query_agnostic']" in error


@pytest.mark.slow  # the embedded model, 4 runs at 512 tokens
def test_eval_runs_the_sweep_and_prints_n_and_the_paired_ci_against_the_full_cache(tmp_path, prefect_server):
    results = tmp_path / "results"
    args = ("eval", "--method", "streaming", "--budget", "0.25", "--dataset", "passkey", "--context", "512",
            "-n", "2", "--results", str(results))
    done = kvcompress(*args, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sweep_id = re.search(r"Sweep (eval-[0-9a-f]{8})", done.stdout).group(1)
    # the leaderboard row of the method: n, its score with a CI, the paired difference with its CI
    row = next(line for line in done.stdout.splitlines() if line.lstrip("0123456789. ").startswith("streaming budget=0.25"))
    assert re.search(r"\b2\b", row) and row.count("(") >= 2, done.stdout
    runs = duckdb.sql(f"SELECT method, count(*) FROM read_parquet('{results}/runs/**/*.parquet', "
                      f"hive_partitioning=true) WHERE sweep_id = '{sweep_id}' AND status = 'ok' GROUP BY 1 ORDER BY 1"
                      ).fetchall()
    assert runs == [("full", 2), ("streaming", 2)]
    again = kvcompress(*args, timeout=900)  # the same line resumes: nothing runs again
    assert again.returncode == 0 and "'ran': 0" in again.stdout + again.stderr
