"""One sweep against the previous sweep of its grid: regression.sql over compare_sweeps.sql."""

from __future__ import annotations

import re

import pyarrow as pa

from .db import sql_text

NIGHTLY_ID = re.compile(r"^(?P<grid>.+)-\d{8}-\d{6}$")  # <grid name>-YYYYmmdd-HHMMSS (UTC)


def previous_sweep(con, sweep_id: str) -> str | None:
    """The latest earlier sweep of the same grid (ids sort by time), or None."""
    match = NIGHTLY_ID.match(sweep_id)
    if match is None:
        return None
    ids = [r[0] for r in con.execute("SELECT DISTINCT sweep_id FROM runs").fetchall()]
    earlier = [s for s in ids if s < sweep_id and (m := NIGHTLY_ID.match(s)) and m["grid"] == match["grid"]]
    return max(earlier, default=None)


def compare(con, sweep_a: str, sweep_b: str) -> pa.Table:
    """regression.sql over compare_sweeps.sql for the two sweeps."""
    con.execute("SET VARIABLE sweep_a = ?", [sweep_a])
    con.execute("SET VARIABLE sweep_b = ?", [sweep_b])
    comparison = sql_text("compare_sweeps").strip().rstrip(";")
    con.execute(f"CREATE OR REPLACE TEMP VIEW sweep_comparison AS {comparison}")
    return con.sql(sql_text("regression")).to_arrow_table()
