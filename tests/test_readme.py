"""The README's and the docs' examples run as written: every fenced block after a
`<!-- readme-test... -->` line in README.md, then in `docs/*.md` (sorted by name), runs here, against
a real tiny sweep (the README's own `readme-test: grid` block, on the embedded model). Python blocks
run in a directory whose `results` is that sweep's results root; SQL blocks run on the report views
(`kvcompress_reports.connect`) and must return rows; the `spec` block is a grid that must parse and
plan."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^<!-- readme-test(?::\s*(\w+))? -->\n```(\w+)\n(.*?)^```", re.M | re.S)


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def readme_blocks() -> list[tuple[str, str, str]]:
    """(kind, language, code) of every marked block: README.md's in order, then each docs page's."""
    return [
        (kind or "run", lang, code)
        for document in DOCUMENTS
        for kind, lang, code in BLOCK.findall(document.read_text())
    ]


def test_the_readme_marks_its_runnable_examples():
    kinds = [(kind, lang) for kind, lang, _ in readme_blocks()]
    assert kinds.count(("run", "python")) == 3 and kinds.count(("run", "sql")) == 3
    assert kinds.count(("grid", "yaml")) == 1 and ("spec", "yaml") in kinds


@pytest.fixture(scope="module")
def readme_results(tmp_path_factory, embedded):
    """The README's tiny sweep, run shard by shard (no Prefect needed) into DIR/results."""
    from kvcompress.execute import execute_shard
    from kvcompress.sweep import load_spec

    (grid,) = [code for kind, _, code in readme_blocks() if kind == "grid"]
    plan = load_spec(yaml.safe_load(grid)).plan()
    directory = tmp_path_factory.mktemp("readme")
    for shard in plan.shards:
        execute_shard(shard, plan.model, plan.decode_steps, plan.name, str(directory / "results"))
    return directory


def test_readme_grid_examples_parse_and_plan():
    from kvcompress.sweep import load_spec

    for kind, _, code in readme_blocks():
        if kind in ("spec", "grid"):
            assert load_spec(yaml.safe_load(code)).plan().runs > 0


@pytest.mark.parametrize("index", [i for i, (kind, lang, _) in enumerate(readme_blocks()) if kind == "run"])
def test_readme_example_runs(index, readme_results, monkeypatch, capsys):
    kind, lang, code = readme_blocks()[index]
    monkeypatch.chdir(readme_results)
    if lang == "python":
        names = {"__name__": "__readme__"}
        exec(compile(code, f"readme-test block {index}", "exec"), names)
        out = capsys.readouterr().out
        assert out.strip() or names.get("rows")  # each shows or returns something
        answers = code.count("in stream_generate(")
        assert not answers or len(out.strip().splitlines()) == answers, out  # one answer a line
    else:
        from kvcompress_reports import connect

        rows = connect("results").sql(code).fetchall()
        assert rows, f"readme-test SQL block {index} returned no rows on the README sweep"


def test_the_readme_stays_a_front_door():
    # issue 51: at most 250 lines; detail belongs in docs/
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
