"""`kvcompress` command line: sweep, eval, generate, report, check, methods, grid-schema, doctor."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import textwrap
import warnings
from pathlib import Path

import kvcompress  # noqa: F401  (loads the optimized BLAS before anything imports mlx)
import pyarrow as pa
from kvcompress.errors import ConfigError, StorageError
from kvcompress.methods import list_methods
from kvcompress.results import check_root, default_root, quarantine, redact, scan, validate_sweep_id
from kvcompress.sweep import SpeedPlan, SpeedSpec, grid_schema, load_spec
from kvcompress_flows.dask_shards import validate_dask
from kvcompress_flows.interrupt import remembered
from kvcompress_flows.server_watch import exit_when_server_dies

SCREEN_WIDTH = 120  # the one-screen report's width (kvcompress_reports.render.SCREEN_WIDTH)


@contextlib.contextmanager
def prefect_api():
    """The configured Prefect server, or a temporary local one that dies with this process
    (Prefect's own ephemeral server outlives a `kill -9` of its parent). A configured server on this
    machine that does not answer (`make demo` stopped the one it started) also gets a temporary one:
    nothing else could answer there, and a local sweep needs no particular server."""
    from kvcompress_flows.local_server import LocalServer, healthy, is_loopback_url

    configured = os.environ.get("PREFECT_API_URL")
    if configured and not (is_loopback_url(configured) and not healthy(configured)):
        check_api_auth(configured)
        yield configured
        return
    if configured:
        print(f"PREFECT_API_URL={configured} does not answer: starting a temporary local Prefect server",
              file=sys.stderr)
    else:
        print("starting a temporary local Prefect server (set PREFECT_API_URL to use yours)", file=sys.stderr)
    with LocalServer() as api:
        os.environ["PREFECT_API_URL"] = api
        yield api


def check_api_auth(api_url: str) -> None:
    """Fail in one line, before any work, when the server wants an auth string this process does not
    send (Prefect's clients send PREFECT_API_AUTH_STRING; on the server's own machine the server's
    PREFECT_SERVER_API_AUTH_STRING serves). An unreachable server is left to Prefect's own error."""
    import urllib.error
    import urllib.request

    from kvcompress_flows.local_server import auth_headers

    if not os.environ.get("PREFECT_API_AUTH_STRING") and os.environ.get("PREFECT_SERVER_API_AUTH_STRING"):
        os.environ["PREFECT_API_AUTH_STRING"] = os.environ["PREFECT_SERVER_API_AUTH_STRING"]
    request = urllib.request.Request(api_url.rstrip("/") + "/admin/version", headers=auth_headers())
    try:
        urllib.request.urlopen(request, timeout=30)
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            state = "is refused" if os.environ.get("PREFECT_API_AUTH_STRING") else "is not set"
            raise ConfigError(f"PREFECT_API_URL={api_url} requires an auth string: PREFECT_API_AUTH_STRING {state} "
                              "(the server's PREFECT_SERVER_API_AUTH_STRING)") from None
    except OSError:
        pass


@contextlib.contextmanager
def progress_bar(runs: int | None = None):
    """Rich progress bars of the in-process sweep on a terminal, with ETAs: its `runs` (each run as it
    ends, from runs executed in this process) and its shards (wherever they run); Prefect's log lines
    say the same elsewhere."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from kvcompress.execute import RUN_LISTENERS
    from kvcompress_flows.sweep import PROGRESS_LISTENERS

    bar = Progress(TextColumn("{task.fields[unit]:<6}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.description}"),
                   console=Console(stderr=True))
    run_task = bar.add_task("", total=runs, unit="runs") if runs else None
    task = None

    def update(done: int, total: int, what: str) -> None:
        nonlocal task
        if task is None:
            task = bar.add_task(what, total=total, unit="shards")
        bar.update(task, completed=done, description=what)

    def run_ended(label: str, status: str) -> None:
        bar.update(run_task, advance=1, description=f"{label}: {status}")

    PROGRESS_LISTENERS.append(update)
    if run_task is not None:
        RUN_LISTENERS.append(run_ended)
    try:
        with bar:
            yield
    finally:
        PROGRESS_LISTENERS.remove(update)
        if run_task is not None:
            RUN_LISTENERS.remove(run_ended)


def cmd_sweep(args) -> int:
    spec = load_spec(args.grid)  # parsed once: the flow gets this object, not the name
    if getattr(args, "max_runs", None) is not None:  # `eval` builds its grid without the flag
        spec = spec.model_copy(update={"max_runs": args.max_runs})
    if args.sweep_id is not None:
        validate_sweep_id(args.sweep_id, "--sweep-id")
    plan = spec.plan()  # validates every cell (a SweepError lists them all); the flow reuses it
    if isinstance(spec, SpeedSpec):
        return speed_sweep(args, spec, plan)
    if args.dry_run:
        for config in plan.methods:
            print(config.to_json())
        for shard in plan.shards:
            print(f"shard {shard.dataset} {json.dumps(dict(shard.dataset_params), sort_keys=True)} "
                  f"sample {shard.sample_index}")
        print(json.dumps(plan.estimate()))
        return 0
    validate_dask(args.dask, "--dask")
    if args.distribute and args.dask:
        raise ConfigError("--dask runs the shards on Dask, --distribute on Prefect workers: choose one")
    check_root(args.results)  # before the model loads: a bad root fails here, once
    runs = None if args.distribute or args.dask else plan.runs
    with remembered(), prefect_api() as api, exit_when_server_dies(api), progress_bar(runs):
        from kvcompress_flows.sweep import sweep

        sweep(grid=spec, results=args.results, sweep_id=args.sweep_id, distribute=args.distribute,
              shard_timeout_s=args.shard_timeout, dask=args.dask)
    print_screen(args.results, args.sweep_id or spec.name)
    return 0


def cmd_eval(args) -> int:
    """A one-line evaluation: the grid its options make (kvcompress/oneline.py), run as `sweep` runs one."""
    from kvcompress.oneline import eval_spec

    spec = eval_spec(args.method, args.budget or [], args.param or [], args.dataset or ["ruler:niah_single_2"],
                     args.context or [1024], args.num_samples, args.protocol or ["query_aware"], args.model, args.seed)
    args.grid, args.distribute, args.dask, args.shard_timeout = spec, False, None, 6 * 3600
    return cmd_sweep(args)


def cmd_generate(args) -> int:
    """Stream a greedy answer through a compressed cache, then its cache and speed line."""
    from kvcompress.api import load_model
    from kvcompress.generation import GenerationStats, generate, prompt_tokens
    from kvcompress.methods import method_config
    from kvcompress.oneline import parse_param

    params = {"bits": args.bits, "budget": args.budget}
    for text in args.param or ():
        target, key, value = parse_param(text)
        if target not in (None, args.method):
            raise ConfigError(f"--param {text}: expected a parameter of --method {args.method}, got one of {target!r}")
        params[key] = value
    params = {k: v for k, v in params.items() if v is not None}
    method_config(args.method, **params)  # a bad method or parameter fails before the model loads
    if (args.prompt is None) == (args.prompt_file is None):
        raise ConfigError("--prompt, --prompt-file: expected exactly one of them")
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens: expected an int >= 1, got {args.max_tokens}")
    try:
        text = args.prompt if args.prompt is not None else open(args.prompt_file, encoding="utf-8").read()
    except OSError as exc:
        raise ConfigError(f"--prompt-file: cannot read {args.prompt_file!r} ({exc.strerror})") from None
    model, tokenizer = load_model(args.model)
    tokens = prompt_tokens(tokenizer, text, args.chat)
    if len(tokens) < 2:
        raise ConfigError(f"--prompt: expected at least 2 tokens, got {len(tokens)}")
    for piece in generate(model, tokenizer, tokens, args.method, args.max_tokens, **params):
        if isinstance(piece, GenerationStats):
            print(f"\n[{args.method} {' '.join(f'{k}={v}' for k, v in params.items())}] {piece.line()}".rstrip())
        else:
            print(piece, end="", flush=True)
    return 0


def speed_sweep(args, spec: SpeedSpec, plan: SpeedPlan) -> int:
    """A speed grid (`kind: speed`): the speed flow in-process, then its throughput report."""
    if args.dry_run:
        print(f"model {plan.model.label()} ({plan.model.resolved_dtype()})")
        for config in plan.methods:
            print(config.to_json())
        for group in plan.groups:
            print(f"group {group.describe()}")
        print(json.dumps(plan.estimate()))
        return 0
    check_root(args.results)
    with prefect_api() as api, exit_when_server_dies(api):
        from kvcompress_flows.speed import speed

        speed(grid=spec, results=args.results, sweep_id=args.sweep_id)
    print_screen(args.results, args.sweep_id or spec.name)
    return 0


def default_html_path(results: str, sweep_id: str) -> str:
    """Where the HTML report goes unless --html says: beside local results, else here; proven inside
    that directory (a sweep id comes from a results tree, which may be someone else's)."""
    validate_sweep_id(sweep_id, "--sweep")
    if "://" in results and not results.startswith("file://"):
        directory, name = ".", f"kvcompress-report-{sweep_id}.html"
    else:
        directory, name = os.path.join(results.removeprefix("file://"), "html"), f"{sweep_id}.html"
    path = os.path.join(directory, name)
    if not Path(path).resolve().is_relative_to(Path(directory).resolve()):
        raise ConfigError(f"--html: refusing to write {path!r}: outside {directory!r}")
    return path


def print_screen(results: str, sweep_id: str | None = None, baseline: str | None = None,
                 html: str | None = "") -> None:
    """The one-screen report of a sweep (default: the newest), the HTML report's path, and how to
    get the rest. `html`: "" for the default path, None for no HTML file."""
    from kvcompress.errors import check
    from kvcompress_reports import connect, report_names, sweep_ids
    from kvcompress_reports.render import screen, to_text

    if sweep_id is not None:
        validate_sweep_id(sweep_id, "--sweep")
    con = connect(results, baseline)
    sweeps = sweep_ids(con)
    sweep_id = sweep_id or sweeps[0]
    check(sweep_id in sweeps, "--sweep", f"one of {sweeps}", sweep_id)
    print(to_text(*screen(con, sweep_id)) + "\n")
    if html is not None:
        from kvcompress_reports.html_report import write_html

        path = write_html(results, html or default_html_path(results, sweep_id), sweep_id=sweep_id, baseline=baseline)
        print(f"HTML report (interactive): {path}")
    others = f"; other sweeps (--sweep ID): {', '.join(s for s in sweeps if s != sweep_id)}" if len(sweeps) > 1 else ""
    names = [n for n in report_names() if n in ("paired", "pareto", "speed_memory", "evidence")]
    print(textwrap.fill(f"More: --all, --report NAME (e.g. {', '.join(names)}), --format csv|json|markdown{others}",
                        width=SCREEN_WIDTH, subsequent_indent="  "))


def cmd_report(args) -> int:
    from kvcompress_reports import DEFAULT_REPORTS, connect, render, run_report, sweep_ids
    from kvcompress_reports.db import check_report

    for name in args.report or ():
        check_report(name)  # an unknown report name fails before any query
    if not (args.all or args.report or args.format != "table"):
        print_screen(args.results, args.sweep, args.baseline, None if args.no_html else (args.html or ""))
        return 0
    if args.sweep is not None:
        validate_sweep_id(args.sweep, "--sweep")
    con = connect(args.results, args.baseline)
    sweeps = sweep_ids(con)
    if args.sweep is not None and args.sweep not in sweeps:
        raise ConfigError(f"--sweep: expected one of {sweeps}, got {args.sweep!r}")
    names = args.report or [n for n in DEFAULT_REPORTS if n != "compare_sweeps" or len(sweeps) > 1]
    if args.format != "table" and not (args.all or args.report):
        names = ["summary", "pareto"]
    if args.format == "csv" and len(names) > 1:
        raise ConfigError(f"--format csv: expected one --report NAME (CSV holds one table), got {len(names)} reports")
    reports = {}
    for name in names:
        columns, rows = run_report(con, name)
        if args.sweep is not None and "sweep_id" in columns:
            rows = [r for r in rows if r[columns.index("sweep_id")] == args.sweep]
        reports[os.path.basename(name).removesuffix(".sql")] = (columns, rows)
    if args.format == "json":
        print(render.format_json(reports))
    elif args.format == "csv":
        (columns, rows), = reports.values()
        print(render.format_csv(columns, rows))
    elif args.format == "markdown":
        print("\n\n".join(f"### {name}\n\n{render.format_markdown(*report)}" for name, report in reports.items()))
    else:
        print("\n\n".join(f"== {name} ({len(report[1])} rows)\n{render.format_table(*report)}"
                          for name, report in reports.items()))
    if args.html:
        from kvcompress_reports.html_report import write_html

        print(f"HTML report: {write_html(args.results, args.html, sweep_id=args.sweep, baseline=args.baseline)}")
    return 0


def cmd_check(args) -> int:
    """List (and with --repair move aside) files no report or resume should trust."""
    problems = scan(args.results)
    for problem in problems:
        print(f"{problem.path}: {problem.reason}")
    if not problems:
        print(f"{redact(args.results)}: every run reads back whole")
        return 0
    if args.repair:
        moved = quarantine(args.results, problems)
        print(f"moved {len(moved)} file(s) under {redact(args.results)}/_quarantine; the next sweep reruns those runs")
        return 0
    print(f"{len(problems)} problem(s); `kvcompress check --repair` moves them aside")
    return 1


def cmd_grid_schema(args) -> int:
    print(json.dumps(grid_schema(args.kind), indent=2))
    return 0


METHODS_WIDTH = 100  # `kvcompress methods` wraps to the terminal, at most this wide


def cmd_methods(args) -> int:
    """Each method: what it is, its parameters with their allowed values (from its docstring) and
    defaults, wrapped to the terminal."""
    import shutil

    width = min(shutil.get_terminal_size((METHODS_WIDTH, 24)).columns, METHODS_WIDTH)
    indent = " " * 4
    fill = functools.partial(textwrap.fill, width=width, break_on_hyphens=False)  # "output-projected" stays whole
    print(fill("Every method also takes layers: \"global\" (every global-attention layer) or \"all\"; "
               "an eviction method takes quantize: a quantizer ({name: kivi, bits: 4}) that stores the "
               "tokens it keeps.") + "\n")
    for m in list_methods():
        print(fill(f"{m['name']}: {m['doc']}", subsequent_indent=indent))
        if m["params_doc"]:
            print(fill(m["params_doc"], initial_indent=indent, subsequent_indent=indent))
        defaults = ", ".join(f"{k}={json.dumps(v)}" for k, v in m["params"].items())
        print(fill(f"defaults: {defaults}", initial_indent=indent, subsequent_indent=indent * 2))
    return 0


def cmd_doctor(args) -> int:
    """This machine's back-end, versions, BLAS, each kernel's path and why, and a model smoke test;
    exit 1 when a fused kernel failed its self-test."""
    from kvcompress import doctor

    with warnings.catch_warnings():  # a failed self-test's warning says what the report says
        warnings.simplefilter("ignore", RuntimeWarning)
        report = doctor.run(quick=args.quick)
    print(json.dumps(report.to_dict(), indent=2) if args.format == "json" else doctor.to_text(report))
    return 1 if report.failed() else 0


def _number(text: str) -> int | float:
    """A budget as the grid reads it: 256 is tokens (an int), 0.25 a fraction (a float)."""
    try:
        return int(text)
    except ValueError:
        return float(text)  # argparse turns a ValueError into its one-line usage error


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcompress", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    results_help = "results root: a path or URL (default $KVCOMPRESS_RESULTS or ./results)"

    s = sub.add_parser("sweep", help="run a sweep (or a speed grid) in-process (the same flows as the deployments)")
    s.add_argument("grid", nargs="?", default="default", help="built-in grid name or YAML file")
    s.add_argument("--results", default=None, help=results_help)
    s.add_argument("--sweep-id", default=None, help="name of this set of results (default: the grid's name)")
    s.add_argument("--dry-run", action="store_true", help="print the expanded grid and a cost estimate")
    s.add_argument("--max-runs", type=int, default=None, metavar="N",
                   help="refuse a grid of more than N runs before expanding it (default: the grid's max_runs, 100000)")
    s.add_argument("--distribute", action="store_true",
                   help="submit shards to the sweep-shard/shard deployment (needs a server and shard workers)")
    s.add_argument("--dask", default=None, metavar="local:N|tcp://HOST:PORT",
                   help="run the shards on a Dask cluster: N local worker processes, or a running scheduler")
    s.add_argument("--shard-timeout", type=float, default=6 * 3600,
                   help="with --distribute or --dask: seconds to wait for the shards before failing (default 6 h)")
    s.set_defaults(func=cmd_sweep)

    e = sub.add_parser("eval", help="evaluate methods in one line, without a grid file (the grid it makes runs as a sweep)",
                       description="e.g. kvcompress eval --method snapkv --budget 0.25 --dataset ruler:niah_single_2 "
                                   "--context 4096 -n 20. The full cache is always run too (every 'vs full' is against it).")
    e.add_argument("--model", default="smollm2-135m", help="model name or path (default: the embedded SmolLM2-135M)")
    e.add_argument("--method", action="append", required=True, help="a method (`kvcompress methods`); repeatable")
    e.add_argument("--budget", action="append", type=_number,
                   help="KV budget (fraction of the prompt, or tokens if > 1) of the methods that have one; repeatable")
    e.add_argument("--param", action="append", metavar="[METHOD.]KEY=VALUE",
                   help="a method parameter (e.g. bits=4, snapkv.recent=16); repeat a key for several values")
    e.add_argument("--dataset", action="append", metavar="NAME[:TASK]",
                   help="e.g. ruler:niah_single_2, passkey, niah:multikey, lm (default ruler:niah_single_2); repeatable")
    e.add_argument("--context", action="append", type=int, help="context tokens (default 1024); repeatable")
    e.add_argument("-n", "--num-samples", type=int, default=10, help="samples per dataset and context (default 10)")
    e.add_argument("--seed", type=int, default=0, help="the datasets' seed")
    e.add_argument("--protocol", action="append", help="query_aware (default) or query_agnostic; repeatable")
    e.add_argument("--results", default=None, help=results_help)
    e.add_argument("--sweep-id", default=None, help="name of this set of results (default: eval-<hash of the grid>)")
    e.add_argument("--dry-run", action="store_true", help="print the expanded grid and a cost estimate")
    e.set_defaults(func=cmd_eval)

    gen = sub.add_parser("generate", help="generate from a prompt with a compressed cache (as mlx_lm.generate)")
    gen.add_argument("--model", default="smollm2-135m", help="model name or path (default: the embedded SmolLM2-135M)")
    gen.add_argument("--method", default="full", help="a method (`kvcompress methods`; default full)")
    gen.add_argument("--bits", type=int, default=None, help="the method's bits (quantizers)")
    gen.add_argument("--budget", type=_number, default=None, help="the method's KV budget (eviction methods)")
    gen.add_argument("--param", action="append", metavar="KEY=VALUE", help="another method parameter; repeatable")
    gen.add_argument("--prompt", default=None, help="the prompt text")
    gen.add_argument("--prompt-file", default=None, help="a file holding the prompt")
    gen.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.set_defaults(func=cmd_generate)

    r = sub.add_parser("report", help="the answer on one screen (summary and Pareto front), or any report")
    r.add_argument("--results", default=None, help=results_help)
    r.add_argument("--sweep", default=None, help="the sweep to show (default: the one with the newest run)")
    r.add_argument("--all", action="store_true", help="every report (compare_sweeps when there are two sweeps)")
    r.add_argument("--report", "--sql", dest="report", action="append",
                   help="a report name (sql/NAME.sql) or .sql file; repeatable")
    r.add_argument("--format", choices=["table", "csv", "json", "markdown"], default="table",
                   help="output format (for scripts; default: terminal tables)")
    r.add_argument("--html", default=None,
                   help="write the self-contained HTML report here (default: RESULTS/html/SWEEP.html)")
    r.add_argument("--no-html", action="store_true", help="do not write the HTML report")
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
    g.add_argument("--kind", choices=["quality", "speed"], default="quality", help="a quality grid or a speed grid")
    g.set_defaults(func=cmd_grid_schema)

    d = sub.add_parser("doctor", help="check this machine: back-end, versions, BLAS, each kernel's path and why")
    d.add_argument("--quick", action="store_true", help="skip the speed check and the model's smoke answer")
    d.add_argument("--format", choices=["text", "json"], default="text", help="json: for a bug report")
    d.set_defaults(func=cmd_doctor)
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
    except (OSError, pa.ArrowException) as exc:  # storage: a wrong secret, a full disk, an unreachable store
        line = redact((str(exc).strip() or type(exc).__name__).splitlines()[0])
        where = "" if isinstance(exc, StorageError) or not hasattr(args, "results") else f"results {redact(args.results)!r}: "
        print(f"error: {where}{line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line, not the flow engine's stack
        print("interrupted: finished runs are kept; the same command resumes the rest", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
