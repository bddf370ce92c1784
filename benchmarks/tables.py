"""Published tables, written from the stored results: `python -m benchmarks tables [--check]`.

A published table is the region of a markdown page between `<!-- table:NAME -->` and `<!-- /table -->`;
the prose around it is hand-written and stays. `TABLES` maps NAME to its page, the archives of
benchmarks/results/ it reads (newest first) and the function that writes it. Each region starts
with the table's provenance: the archives, the commit and device that measured each, the date; n is
in the table (per column or per row). `--check` writes nothing and exits 1, naming the pages, where
a page differs from what the archives give (tests/test_tables.py runs it).

Adding a table (another engineer's re-measurement, say Expected Attention at epsilon 1e-2):
1. archive the run's results: `tar -cJf benchmarks/results/NAME-DEVICE-DATE.tar.xz -C DIR RESULTS_ROOT`
   (a results root of `kvcompress sweep`, or a `.jsonl.xz` of per-sample rows);
2. add the archive to `ARCHIVES`: the results root inside it, the commit, device and date;
3. add an entry to `TABLES`: the page, the archives, and a writer that takes one source per archive
   (a DuckDB connection over a results root, with sql/'s views; a Path for a JSONL) and returns
   markdown: `single(quality_tables.pivot)`, `newest(...)` (today's verdicts: each config's row from
   the newest archive that measured it, so a re-measurement replaces the old row), or your own;
4. put `<!-- table:NAME -->` and `<!-- /table -->` on lines of their own where it goes; run the command.
A re-measurement of configs already published goes first in the `newest` table's archives: its rows
replace the old ones there (the old rows stay in their archive), and QUALITY.md's "What changed" says so.
"""

from __future__ import annotations

import argparse
import lzma
import re
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pyarrow.dataset as pads  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import quality_tables  # noqa: E402
from kvcompress.results import TABLES as TABLES_SCHEMAS  # noqa: E402
from kvcompress_reports import connect, run_report  # noqa: E402


@dataclass(frozen=True)
class Archive:
    """A stored run: its results root inside the archive ("" for a JSONL), and what measured it."""

    results_root: str
    commit: str
    device: str
    date: str
    tag: str  # a row's source in a table of today's verdicts


@dataclass(frozen=True)
class Table:
    page: str  # relative to the checkout
    archives: tuple[str, ...]  # files of benchmarks/results/, newest first
    write: Callable[[list], str]  # one source per archive -> markdown


H200 = "H200, MLX 0.32.4 CUDA, SmolLM2-135M fp32, 24 processes"
CPU = "this project's 2-core CPU, SmolLM2-135M fp32"
TOKENIZER = "this project's CPU, the embedded tokenizer only"
ARCHIVES = {
    "quality-h200-2026-11-30.tar.xz": Archive("kv-results", "6e3d71c", H200, "2026-11-30", "H200 11-30"),
    "quality-adakv-cpu-2026-11-30.tar.xz": Archive("kv-results", "63cc09c", CPU, "2026-11-30", "CPU 11-30 (AdaKV safeguard)"),
    "quality-keyformer-cpu-2026-11-30.tar.xz": Archive("kv-results", "63cc09c", CPU, "2026-11-30", "CPU 11-30 (Keyformer noise fix)"),
    "quality-fixes-h200-2026-12-03.tar.xz": Archive("kv-results", "38c2441, 988a44d", H200, "2026-12-03", "H200 12-03 (issue 37 fixes)"),
    "speed-h200-2026-12-05.tar.xz": Archive(
        "kv-speed", "not recorded", "H200, MLX 0.32.4 CUDA, random-weight Llama-3.1-8B shape fp16", "2026-12-05",
        "H200 12-05"),
    "ruler-parity-cpu-2026-12-03.jsonl.xz": Archive("", "(issue 44)", CPU, "2026-12-03", "CPU 12-03"),
    "quality-frontier-h200-2026-12-05.tar.xz": Archive("kv-frontier", "c1d564c", H200, "2026-12-05", "H200 12-05"),
    "quality-kvzip-h200-2026-12-05.tar.xz": Archive("kv-results", "c023458", H200, "2026-12-05", "H200 12-05"),
    "quality-kvzip-cpu-2026-12-05.tar.xz": Archive("kv-results", "84cbc0e", CPU, "2026-12-05", "CPU 12-05"),
    "quality-ea-epsilon-cpu-2026-12-07.tar.xz": Archive("kv-results", "17509a5", CPU, "2026-12-07", "CPU 12-07"),
    "speed-cpu-2026-12-07.tar.xz": Archive("kv-speed-cpu", "8b5d02b", CPU, "2026-12-07", "CPU 12-07"),
    "quantizer-kl-cpu-2026-12-07.jsonl.xz": Archive("", "18c2f0c", CPU, "2026-12-07", "CPU 12-07"),
    "composition-cpu-2026-12-08.jsonl.xz": Archive("", "18c2f0c", CPU, "2026-12-08", "CPU 12-08"),
    "workers-cpu-2026-12-07.jsonl.xz": Archive("", "18c2f0c", CPU, "2026-12-07", "CPU 12-07"),
    "ruler-niah-single-3-features-cpu-2026-12-07.jsonl.xz": Archive("", "b955f2d", TOKENIZER, "2026-12-07", "12-07"),
}

VERDICTS = {"worse": "W", "better": "B", "not distinguishable": "n.d."}


_records: dict[tuple[int, str], list[dict]] = {}  # (id of the connection, report) -> rows: several tables read one


def records(con, report: str) -> list[dict]:
    key = (id(con), report)
    if key not in _records:
        columns, rows = run_report(con, report)
        _records[key] = [dict(zip(columns, r)) for r in rows]
    return _records[key]


def single(write: Callable) -> Callable[[list], str]:
    """A writer of one archive's table (e.g. quality_tables.pivot)."""
    return lambda sources: write(sources[0])


def newest(protocol: str, context: int, sweeps: tuple[str, ...], archives: tuple[str, ...]) -> Callable[[list], str]:
    """Today's verdicts at one protocol and context: a row per config (sweeps `sweeps` only), from the
    newest of `archives` that measured it; a cell is score, paired difference vs that archive's full
    cache [bootstrap 95% CI], verdict; then evidence kept (mean over tasks) and where the row is from."""

    def write(sources: list) -> str:
        rows: dict[str, tuple[int, dict]] = {}  # config -> (archive index, {task: record})
        evidence: dict[tuple[str, str], float] = {}
        for i, con in enumerate(sources):
            found: dict[str, dict] = {}
            for r in records(con, "paired"):
                if r["protocol"] == protocol and r["context_tokens"] == context and r.get("sweep_id") in sweeps:
                    found.setdefault(quality_tables._config(r["config_label"]), {})[r["task"]] = r
            for config, cells in found.items():
                if config not in rows:
                    rows[config] = (i, cells)
            for r in records(con, "evidence"):
                if r["protocol"] == protocol and r.get("sweep_id") in sweeps and r["evidence_kept_mean"] is not None:
                    evidence.setdefault((archives[i], quality_tables._config(r["config_label"]), r["task"]),
                                        r["evidence_kept_mean"])
        tasks = sorted({t for _, cells in rows.values() for t in cells})
        lines = ["| config | " + " | ".join(tasks) + " | evidence kept | measured |", "|---" * (len(tasks) + 3) + "|"]
        for config in sorted(rows, key=lambda c: (c != "full", c)):
            i, cells = rows[config]
            row, kept = [], []
            for task in tasks:
                r = cells.get(task)
                if r is None:
                    row.append("-")
                    continue
                n = f" (n={r['n']})" if r["n"] != 25 else ""
                if config == "full":
                    row.append(f"{r['score_mean']:.2f}{n}")
                else:
                    row.append(f"{r['score_mean']:.2f} {r['diff_vs_full']:+.2f} [{r['diff_vs_full_ci_low']:+.2f}, "
                               f"{r['diff_vs_full_ci_high']:+.2f}] {VERDICTS.get(r['vs_full'], r['vs_full'])}{n}")
                if (archives[i], config, task) in evidence:
                    kept.append(evidence[(archives[i], config, task)])
            row.append(f"{sum(kept) / len(kept):.2f}" if kept else "-")
            row.append(ARCHIVES[archives[i]].tag)
            lines.append(f"| {config} | " + " | ".join(row) + " |")
        return "\n".join(lines)

    return write


def ceiling(sources: list) -> str:
    """The full cache's scores per task and context, Wilson 95% CI, query-aware (the ceiling sweep)."""
    cells = {(r["task"], r["context_tokens"]): r for r in records(sources[0], "summary")
             if r["sweep_id"] == "quality-ceiling" and r["protocol"] == "query_aware"
             and quality_tables._config(r["config_label"]) == "full"}
    contexts = sorted({c for _, c in cells})
    lines = ["| task | " + " | ".join(f"{c} tokens" for c in contexts) + " |", "|---" * (len(contexts) + 1) + "|"]
    for task in sorted({t for t, _ in cells}):
        row = []
        for c in contexts:
            r = cells.get((task, c))
            row.append("-" if r is None else
                       f"{r['score_mean']:.2f} [{r['score_ci_low']:.2f}, {r['score_ci_high']:.2f}] (n={r['runs']})")
        lines.append(f"| {task} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def protocols_resolved(sources: list) -> str:
    """Query-aware vs query-agnostic on the same samples, each config from the newest archive that
    measured it: the pairs that differ resolvably (the others counted)."""
    seen, header, body = set(), None, []
    for con in sources:
        table = quality_tables.protocols(con).split("\n")
        header = table[:2]
        rows = [line for line in table[2:] if line.split(" | ")[3] != "full"]
        configs = {line.split(" | ")[3] for line in rows}
        body += [line for line in rows if line.split(" | ")[3] not in seen]
        seen |= configs
    resolved = sorted((line for line in body if not line.rstrip(" |").endswith("not distinguishable")),
                      key=lambda line: line.split(" | ")[1:4])
    return (f"{len(resolved)} of {len(body)} (config, task) pairs differ resolvably, every one listed here; the "
            f"others are not distinguishable.\n\n" + "\n".join(header + resolved))


def evidence_table(sources: list) -> str:
    """Evidence kept vs correctness per eviction config and protocol (niah_single_2, niah_multikey_1,
    passkey: the tasks with one evidence span), each config from the newest archive that measured it."""
    tasks = {"niah_single_2", "niah_multikey_1", "passkey"}
    rows: dict[tuple[str, str], list[dict]] = {}
    for con in sources:
        found: dict[tuple[str, str], list[dict]] = {}
        for r in records(con, "evidence"):
            config = quality_tables._config(r["config_label"])
            if r["task"] in tasks and r["evidence_kept_mean"] is not None and config != "full" and (
                    not config.startswith("kivi")):
                found.setdefault((config, r["protocol"]), []).append(r)
        for key, rs in found.items():
            rows.setdefault(key, rs)

    def mean(rs, key):  # run-weighted over the tasks
        pairs = [(r[key], r["runs"]) for r in rs if r[key] is not None]
        return "-" if not pairs else f"{sum(v * n for v, n in pairs) / sum(n for _, n in pairs):.2f}"

    lines = ["| config | protocol | runs | score | evidence kept (mean) | kept when correct | kept when wrong |",
             "|---|---|---|---|---|---|---|"]
    for (config, protocol), rs in sorted(rows.items()):
        lines.append(f"| {config} | {protocol.removeprefix('query_')} | {sum(r['runs'] for r in rs)} | "
                     f"{mean(rs, 'score_mean')} | {mean(rs, 'evidence_kept_mean')} | "
                     f"{mean(rs, 'evidence_kept_when_correct')} | {mean(rs, 'evidence_kept_when_wrong')} |")
    return "\n".join(lines)


def throughput(cpu: bool = False) -> Callable[[list], str]:
    """Decode throughput at equal KV memory per context (sql/throughput.sql: medians over the rounds,
    min-max), and the caches whose runs failed. A CPU's table (the embedded model's small KV and slow
    steps): KV in MiB, tok/s to a tenth, and the host's ms a step (KIVI's C++ kernel runs there)."""
    kv_unit, scale, tok = ("MiB", 1024, ".1f") if cpu else ("GiB", 1, ".0f")

    def context(tokens: int) -> str:
        return f"{tokens // 1024}k" if tokens >= 1024 else str(tokens)

    def write(sources: list) -> str:
        con = sources[0]
        columns = ["context", "cache", "batch", f"KV {kv_unit}", "decode tok/s (min-max)", "x full (min-max)",
                   "x full pipelined", *(["host ms a step"] * cpu), "prefill s (batch)", "rounds"]
        lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
        for r in records(con, "throughput"):
            x_full = ("1.00" if r["method"] == "full"
                      else f"{r['x_full']:.2f} ({r['x_full_min']:.2f}-{r['x_full_max']:.2f})")
            cells = [context(r["context_tokens"]), r["config_label"], r["batch"], f"{r['live_kv_gib'] * scale:.1f}",
                     f"{r['decode_tok_s']:{tok}} ({r['decode_tok_s_min']:{tok}}-{r['decode_tok_s_max']:{tok}})", x_full,
                     f"{r['x_full_pipelined']:.2f}", *([f"{r['host_ms']:.1f}"] * cpu), f"{r['prefill_s']:.1f}",
                     r["rounds"]]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        failed = con.execute("SELECT context_tokens, config_label, any_value(status), count(*) FROM speed "
                             "WHERE status <> 'ok' GROUP BY ALL ORDER BY ALL").fetchall()
        for tokens, label, status, n in failed:
            cells = [context(tokens), label, "-", "-", f"{status} ({n} runs)", *["-"] * (len(columns) - 5)]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    return write


def ruler_parity(sources: list) -> str:
    import ruler_parity as parity

    return parity.table(sources[0], list(parity.OFFLINE_TASKS))


def quantizer_kl(table: str) -> Callable[[list], str]:
    """One of benchmarks/quantizer_kl.py's tables ("seeds", "kvquant", "essays") from its rows."""
    def write(sources: list) -> str:
        import quantizer_kl as kl

        return {"seeds": kl.seeds_table, "kvquant": kl.kvquant_table, "essays": kl.essays_table}[table](sources[0])

    return write


def composition(sources: list) -> str:
    import composition_cpu

    return composition_cpu.table(sources[0])


def workers(sources: list) -> str:
    import workers as engines

    return engines.table(sources[0])


def niah_single_3(sources: list) -> str:
    import ruler_parity as parity

    return parity.features_table(sources[0], sources[1])


QUALITY = "benchmarks/QUALITY.md"
EVERY_METHOD = ("quality-fixes-h200-2026-12-03.tar.xz", "quality-adakv-cpu-2026-11-30.tar.xz",
                "quality-keyformer-cpu-2026-11-30.tar.xz", "quality-h200-2026-11-30.tar.xz")
SWEEPS_1K = ("quality", "quality-fixes", "quality-adakv", "quality-keyformer")
TABLES = {
    "every-method-aware": Table(QUALITY, EVERY_METHOD, newest("query_aware", 1024, SWEEPS_1K, EVERY_METHOD)),
    "every-method-agnostic": Table(QUALITY, EVERY_METHOD, newest("query_agnostic", 1024, SWEEPS_1K, EVERY_METHOD)),
    "quality-frontier": Table(QUALITY, ("quality-frontier-h200-2026-12-05.tar.xz",), single(quality_tables.pivot)),
    "kvzip-h200": Table(QUALITY, ("quality-kvzip-h200-2026-12-05.tar.xz",), single(quality_tables.pivot)),
    "kvzip-cpu": Table(QUALITY, ("quality-kvzip-cpu-2026-12-05.tar.xz",), single(quality_tables.pivot)),
    "ea-epsilon": Table(QUALITY, ("quality-ea-epsilon-cpu-2026-12-07.tar.xz",), single(quality_tables.pivot)),
    "ceiling": Table(QUALITY, ("quality-h200-2026-11-30.tar.xz",), ceiling),
    "protocols": Table(QUALITY, EVERY_METHOD, protocols_resolved),
    "evidence": Table(QUALITY, EVERY_METHOD, evidence_table),
    "ruler-parity": Table(QUALITY, ("ruler-parity-cpu-2026-12-03.jsonl.xz",), ruler_parity),
    "niah-single-3": Table(QUALITY, ("ruler-niah-single-3-features-cpu-2026-12-07.jsonl.xz",
                                     "ruler-parity-cpu-2026-12-03.jsonl.xz"), niah_single_3),
    "speed-h200": Table("docs/speed.md", ("speed-h200-2026-12-05.tar.xz",), throughput()),
    "quantizer-kl-seeds": Table("docs/methods.md", ("quantizer-kl-cpu-2026-12-07.jsonl.xz",), quantizer_kl("seeds")),
    "kvquant-kl": Table("docs/methods.md", ("quantizer-kl-cpu-2026-12-07.jsonl.xz",), quantizer_kl("kvquant")),
    "kvquant-kl-essays": Table("docs/methods.md", ("quantizer-kl-cpu-2026-12-07.jsonl.xz",), quantizer_kl("essays")),
    "composition": Table("docs/methods.md", ("composition-cpu-2026-12-08.jsonl.xz",), composition),
    "workers": Table("docs/many-machines.md", ("workers-cpu-2026-12-07.jsonl.xz",), workers),
    "speed-cpu": Table("docs/speed.md", ("speed-cpu-2026-12-07.tar.xz",), throughput(cpu=True)),
}

REGION = re.compile(r"(<!-- table:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def provenance(archives: tuple[str, ...]) -> str:
    parts = [f"`{name}` (commit {ARCHIVES[name].commit}, {ARCHIVES[name].date}, {ARCHIVES[name].device})"
             for name in archives]
    return f"_Generated by `python -m benchmarks tables` from benchmarks/results/: {'; '.join(parts)}._\n"


def open_source(name: str, workdir: Path):
    """A DuckDB connection over an archive's results root, or the Path of a decompressed JSONL."""
    target = workdir / name.split(".")[0]
    if name.endswith(".jsonl.xz"):
        target = target.with_suffix(".jsonl")
        target.write_bytes(lzma.decompress((RESULTS / name).read_bytes()))
        return target
    with tarfile.open(RESULTS / name) as tar:
        tar.extractall(target, filter="data")
    root = target / ARCHIVES[name].results_root
    compact(root)
    return connect(str(root), None)


def compact(root: Path) -> None:
    """Each partition's run files (one a run: thousands) as one file, the same rows: DuckDB then opens
    tens of files per report instead of ~14k (the largest archive's tables took minutes)."""
    for table, schema in TABLES_SCHEMAS.items():
        for partition in sorted({path.parent for path in (root / table).glob("sweep_id=*/method=*/*.parquet")}):
            files = sorted(partition.glob("*.parquet"))
            if len(files) > 1:
                rows = pads.dataset([str(f) for f in files], schema=schema, format="parquet").to_table()
                for f in files:
                    f.unlink()
                pq.write_table(rows, partition / "compacted.parquet")


def generate(names: list[str], workdir: Path) -> dict[str, str]:
    """NAME -> the region's text, each archive opened once under `workdir`."""
    sources, out = {}, {}
    _records.clear()  # keyed by connection ids, which new connections may reuse
    for name in names:
        table = TABLES[name]
        for archive in table.archives:
            if archive not in sources:
                sources[archive] = open_source(archive, workdir)
        text = table.write([sources[a] for a in table.archives]).strip("\n")
        out[name] = provenance(table.archives) + "\n" + text + "\n"
    return out


def render(page_text: str, tables: dict[str, str]) -> str:
    return REGION.sub(lambda m: m.group(1) + tables[m.group("name")] + m.group(4) if m.group("name") in tables
                      else m.group(0), page_text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks tables", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 where a page differs")
    parser.add_argument("names", nargs="*", help=f"only these tables (default: every one): {', '.join(TABLES)}")
    args = parser.parse_args(argv)
    names = args.names or sorted(TABLES)
    texts = {page: (ROOT / page).read_text() for page in sorted({TABLES[n].page for n in names})}
    marked = {m.group("name") for text in texts.values() for m in REGION.finditer(text)}
    missing = sorted(set(names) - marked)
    if missing:
        print(f"tables without their markers in their page: {missing}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        tables = generate(names, Path(tmp))
    stale = []
    for page, text in texts.items():
        new = render(text, tables)
        if new != text:
            stale.append(page)
            if not args.check:
                (ROOT / page).write_text(new)
    if args.check and stale:
        print(f"stale tables in {stale}: run `python -m benchmarks tables`", file=sys.stderr)
        return 1
    print(("checked " if args.check else "wrote ") + ", ".join(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
