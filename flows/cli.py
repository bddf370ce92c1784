"""`kvcompress` command line: sweep, report, check, methods, grid-schema."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings

import kvcompress  # noqa: F401  (loads the optimized BLAS before anything imports mlx)
from kvcompress.errors import ConfigError
from kvcompress.methods import list_methods
from kvcompress.results import check_root, default_root, quarantine, scan, validate_sweep_id
from kvcompress.sweep import grid_schema, load_spec


@contextlib.contextmanager
def prefect_api():
    """The configured Prefect server, or a temporary local one that dies with this process
    (Prefect's own ephemeral server outlives a `kill -9` of its parent)."""
    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    from kvcompress_flows.local_server import LocalServer

    print("starting a temporary local Prefect server (set PREFECT_API_URL to use yours)", file=sys.stderr)
    with LocalServer() as api:
        os.environ["PREFECT_API_URL"] = api
        yield api


def cmd_sweep(args) -> int:
    spec = load_spec(args.grid)  # parsed once: the flow gets this object, not the name
    if args.sweep_id is not None:
        validate_sweep_id(args.sweep_id, "--sweep-id")
    plan = spec.plan()  # validates every cell (a SweepError lists them all); the flow reuses it
    if args.dry_run:
        for config in plan.methods:
            print(config.to_json())
        for shard in plan.shards:
            print(f"shard {shard.dataset} {json.dumps(dict(shard.dataset_params), sort_keys=True)} "
                  f"sample {shard.sample_index}")
        print(json.dumps(plan.estimate()))
        return 0
    check_root(args.results)  # before the model loads: a bad root fails here, once
    with prefect_api():
        from kvcompress_flows.sweep import sweep
        from kvcompress_reports.render import render_reports

        sweep(grid=spec, results=args.results, sweep_id=args.sweep_id, distribute=args.distribute,
              shard_timeout_s=args.shard_timeout)
    print(render_reports(args.results))
    return 0


def cmd_report(args) -> int:
    from kvcompress_reports.db import DEFAULT_REPORTS, check_report
    from kvcompress_reports.render import render_reports

    for name in args.sql or ():
        check_report(name)  # an unknown report name fails before any query
    print(render_reports(args.results, args.sql or DEFAULT_REPORTS, args.baseline))
    if args.html:
        from kvcompress_reports.html_report import write_html

        print(f"wrote {write_html(args.results, args.html, baseline=args.baseline)}")
    return 0


def cmd_check(args) -> int:
    """List (and with --repair move aside) files no report or resume should trust."""
    problems = scan(args.results)
    for problem in problems:
        print(f"{problem.path}: {problem.reason}")
    if not problems:
        print(f"{args.results}: every run reads back whole")
        return 0
    if args.repair:
        moved = quarantine(args.results, problems)
        print(f"moved {len(moved)} file(s) under {args.results}/_quarantine; the next sweep reruns those runs")
        return 0
    print(f"{len(problems)} problem(s); `kvcompress check --repair` moves them aside")
    return 1


def cmd_grid_schema(args) -> int:
    print(json.dumps(grid_schema(), indent=2))
    return 0


def cmd_methods(args) -> int:
    for m in list_methods():
        print(f"{m['name']:<12} {m['doc']}\n{'':<12} params: {json.dumps(m['params'])}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcompress", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    results_help = "results root: a path or URL (default $KVCOMPRESS_RESULTS or ./results)"

    s = sub.add_parser("sweep", help="run a sweep in-process (the same flow as the deployments)")
    s.add_argument("grid", nargs="?", default="default", help="built-in grid name or YAML file")
    s.add_argument("--results", default=None, help=results_help)
    s.add_argument("--sweep-id", default=None, help="name of this set of results (default: the grid's name)")
    s.add_argument("--dry-run", action="store_true", help="print the expanded grid and a cost estimate")
    s.add_argument("--distribute", action="store_true",
                   help="submit shards to the sweep-shard/shard deployment (needs a server and shard workers)")
    s.add_argument("--shard-timeout", type=float, default=6 * 3600,
                   help="with --distribute: seconds to wait for the shards before failing (default 6 h)")
    s.set_defaults(func=cmd_sweep)

    r = sub.add_parser("report", help="print the DuckDB reports over the results")
    r.add_argument("--results", default=None, help=results_help)
    r.add_argument("--report", "--sql", dest="sql", action="append",
                   help="a report name (sql/NAME.sql) or .sql file; repeatable")
    r.add_argument("--html", default=None, help="also write a self-contained HTML report here")
    r.add_argument("--baseline", default=None,
                   help="a config_label the paired report also compares every config with (e.g. 'h2o budget=0.5')")
    r.set_defaults(func=cmd_report)

    c = sub.add_parser("check", help="list broken result files and stale temp files (--repair moves them aside)")
    c.add_argument("--results", default=None, help=results_help)
    c.add_argument("--repair", action="store_true", help="move the listed files under RESULTS/_quarantine")
    c.set_defaults(func=cmd_check)

    m = sub.add_parser("methods", help="list compression methods and their parameters")
    m.set_defaults(func=cmd_methods)

    g = sub.add_parser("grid-schema", help="print the JSON Schema of a sweep grid file (for editors)")
    g.set_defaults(func=cmd_grid_schema)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if getattr(args, "results", None) is None and hasattr(args, "results"):
        args.results = default_root()
    warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
