"""Every published table equals what `python -m benchmarks tables` writes from the stored archives
(benchmarks/tables.py): rerunning the command changes nothing. Reads the archives only (DuckDB over
their Parquet; no model)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tables  # noqa: E402


def test_every_table_is_marked_once_in_its_page():
    for name, table in tables.TABLES.items():
        text = (ROOT / table.page).read_text()
        assert text.count(f"<!-- table:{name} -->") == 1, name
        assert all(archive in tables.ARCHIVES and (tables.RESULTS / archive).is_file() for archive in table.archives)


def test_rendering_replaces_a_region_and_leaves_the_prose():
    page = "prose\n<!-- table:a -->\nold\n<!-- /table -->\nmore prose\n<!-- table:b -->\nkept\n<!-- /table -->\n"
    assert tables.render(page, {"a": "new\n"}) == (
        "prose\n<!-- table:a -->\nnew\n<!-- /table -->\nmore prose\n<!-- table:b -->\nkept\n<!-- /table -->\n")


def test_the_committed_tables_are_what_the_archives_give(tmp_path):
    generated = tables.generate(sorted(tables.TABLES), tmp_path)
    for name, table in tables.TABLES.items():
        page = (ROOT / table.page).read_text()
        assert tables.render(page, {name: generated[name]}) == page, (
            f"{name} in {table.page} differs from the archives: run `python -m benchmarks tables`")
