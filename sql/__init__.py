"""The reports layer (installed as `kvcompress_reports`): DuckDB SQL over the results Parquet, and
the Python that runs it and renders its answers.

- `sql/*.sql`: the views (`views.sql`, `run_scores.sql`) and one report per file (package data,
  found through the package, so an installed copy works without a checkout);
- `db`: the DuckDB connection with the views, the SQL runner, a report's rows;
- `render`: terminal (rich), Markdown, CSV and JSON renderings and the one-screen summary;
- `html_report` (+ `report.js`): one self-contained, interactive HTML file (plotly.js inlined);
- `regression`: one sweep compared with the previous sweep of its grid.

The library (`kvcompress`) never imports DuckDB; Prefect's thin tasks over this live in `tasks/`.

    from kvcompress_reports import connect, run_report
    columns, rows = run_report(connect("results"), "pareto")
"""

from .db import DEFAULT_REPORTS, connect, report_names, run_report, sql_text, sweep_ids, sweep_reports

__all__ = ["DEFAULT_REPORTS", "connect", "report_names", "run_report", "sql_text", "sweep_ids", "sweep_reports"]
