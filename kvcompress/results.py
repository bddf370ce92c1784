"""Run results as hive-partitioned Parquet datasets, one file per run, written atomically.

    {root}/runs/sweep_id={sweep}/method={method}/{run_id}.parquet    one row per run
    {root}/steps/sweep_id={sweep}/method={method}/{run_id}.parquet   one row per decode step
    {root}/evidence/sweep_id={sweep}/method={method}/{run_id}.parquet  per layer and stage
    {root}/speed/sweep_id={sweep}/method={method}/{run_id}.parquet   a speed measurement, one row per round

`sweep_id` and `method` live in the directory names only (DuckDB's `hive_partitioning` turns
them into columns and prunes on them), so both are validated before they become a path. The steps
file is written first, and a reader never sees a half-written file: on a file system each file goes
to a temporary name and is renamed into place; on an object store, where a rename is a copy, each
file is one PUT, which the store makes visible whole or not at all. A run is finished when both of
its files read back with the row counts the runs row promises (`step_rows`); anything else (a
truncated or foreign file, a lost steps file) is rerun by the next sweep, and `scan` / `quarantine`
list and move such files aside. `root` is a local path or any URL pyarrow understands (s3://,
gs://, file://, ...); an S3 URL takes its endpoint, region and credentials from the usual AWS
environment variables or from URL options (`?endpoint_override=HOST:PORT&scheme=http&region=R`).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .errors import ConfigError, shown

RUNS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("model", pa.string()),
        ("dataset", pa.string()),
        ("task", pa.string()),
        ("sample_id", pa.string()),
        ("protocol", pa.string()),  # query_aware | query_agnostic
        ("context_tokens", pa.int64()),  # the configured context length (the grouping key)
        ("prompt_tokens", pa.int64()),  # tokens actually fed to the model
        ("budget", pa.float64()),  # as configured: tokens, or a fraction of the prompt
        ("budget_tokens", pa.float64()),  # the budget resolved for this prompt (mean over layers)
        ("bits", pa.float64()),
        ("tau_init", pa.float64()),
        ("tau_end", pa.float64()),
        ("score", pa.float64()),
        ("status", pa.string()),  # ok | error | nonfinite | timeout
        ("error", pa.string()),
        ("prefill_s", pa.float64()),  # shared full prefill + this method's compression
        ("decode_tok_s", pa.float64()),  # teacher-forced decode steps per second
        ("live_kv_bytes", pa.int64()),  # resident KV bytes after the last decode step
        ("full_kv_bytes", pa.int64()),  # the full cache's, same tokens
        ("tokens_kept", pa.int64()),
        # tokens held as codes right after the prompt was compressed, per quantizing layer (the mean
        # over them, as tokens_kept); NULL for a method that quantizes nothing by design, and in
        # results written before the column; 0: everything inside a full-precision window
        ("quantized_tokens", pa.int64()),
        ("peak_memory_bytes", pa.int64()),  # MLX peak during the run: weights and shared caches included
        ("method_peak_bytes", pa.int64()),  # the method's own peak above the run's shared baseline
        ("decode_steps", pa.int64()),  # teacher-forced steps: the reference answer's tokens
        ("reference_cut", pa.bool_()),  # decode_steps stopped the reference before EOS / the budget
        ("evidence_kept", pa.float64()),  # evidence tokens held after the answer: mean over layers, KV heads
        ("evidence_depth", pa.float64()),  # where the first evidence token sits in the context part, 0..1
        ("step_rows", pa.int64()),  # rows of this run in `steps` (resume checks the file holds them)
        ("prediction", pa.string()),
        ("config_label", pa.string()),  # method + non-default parameters: what reports group by
        ("config", pa.string()),  # JSON of the full run configuration (what run_id hashes)
        ("created_at", pa.timestamp("us", tz="UTC")),
    ]
)

STEPS_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("position", pa.int64()),  # sequence position of the token fed at this step
        ("ref_token", pa.int64()),  # the full cache's next token (or the dataset's, for lm)
        ("token", pa.int64()),  # this method's argmax
        ("full_token", pa.int64()),  # the full cache's argmax
        ("top1_agree", pa.bool_()),  # token == full_token: agreement with the full cache
        ("top1_text", pa.bool_()),  # token == ref_token: accuracy against the reference (lm: the text)
        ("kl", pa.float64()),  # KL(full || method), nats
        ("logit_cosine", pa.float64()),
        ("nll", pa.float64()),  # -log p_method(ref_token)
        ("tokens_kept", pa.int64()),
        ("live_kv_bytes", pa.int64()),
        ("step_ms", pa.float64()),
    ]
)

EVIDENCE_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("layer", pa.int64()),
        ("stage", pa.string()),  # compressed (after the prompt) | final (after the reference answer)
        ("kept_min", pa.float64()),  # fraction of evidence tokens held, min over KV heads
        ("kept_mean", pa.float64()),  # ... mean over KV heads
        ("key_rel_err", pa.float64()),  # ||K_held - K|| / ||K|| over held evidence tokens
        ("value_rel_err", pa.float64()),
    ]
)

# the speed sweep's measurements (kvcompress/speed.py): one row per measurement and round
SPEED_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),  # hash of the measurement's config (`config`)
        ("model", pa.string()),  # a model name, or "SHAPE random" for random weights of a named shape
        ("dtype", pa.string()),
        ("device", pa.string()),  # e.g. "gpu: NVIDIA H200"
        ("context_tokens", pa.int64()),  # tokens of each prompt
        ("batch", pa.int64()),  # sequences decoded together
        ("kv_budget_bytes", pa.int64()),  # the KV budget the batch was fitted to; null: the batch was given
        ("kv_bytes_per_sequence", pa.int64()),  # measured KV of one sequence after its prompt (budget runs)
        ("round", pa.int64()),  # 0.. (the caches of a group took turns in each); null on an error row
        ("status", pa.string()),  # ok | error
        ("error", pa.string()),
        ("decode_steps", pa.int64()),  # steps per round, each way (synchronous, pipelined)
        ("decode_ms", pa.float64()),  # median synchronous ms a step in this round
        ("decode_tok_s", pa.float64()),  # batch x 1000 / decode_ms
        ("host_ms", pa.float64()),  # median ms to build a step's graph on the host
        ("pipelined_ms", pa.float64()),  # ms a step pipelined as mlx_lm.generate runs
        ("pipelined_tok_s", pa.float64()),
        ("prefill_s", pa.float64()),  # this round's timed prefill of the batch (time to first token)
        ("live_kv_bytes", pa.int64()),  # resident KV of the whole batch after its prompts
        ("peak_memory_bytes", pa.int64()),  # weights + this cache's prefill peak, as if it ran alone
        ("weight_bytes", pa.int64()),
        ("kernels", pa.string()),  # JSON {"kernel/backend/dtype": "fused" | "reference"}
        ("config_label", pa.string()),
        ("config", pa.string()),  # JSON of the full measurement configuration (what run_id hashes)
        ("created_at", pa.timestamp("us", tz="UTC")),
    ]
)

TABLES = {"runs": RUNS_SCHEMA, "steps": STEPS_SCHEMA, "evidence": EVIDENCE_SCHEMA, "speed": SPEED_SCHEMA}


SWEEP_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
SWEEP_ID_MAX_LEN = 128
PARTITION_SCHEMA = pa.schema([("sweep_id", pa.string()), ("method", pa.string())])  # the hive directories
OBJECT_STORES = ("s3", "gcs", "abfs")  # pyarrow file systems whose PUT is atomic and whose rename is a copy
SECRET_URL_OPTIONS = ("access_key", "secret_key", "session_token", "access_token", "account_key", "sas_token")
READERS = 16  # footers read at once when listing readable files
STALE_TEMP_S = 3600.0  # a temp file this old is a crashed write, whatever host wrote it
QUARANTINE = "_quarantine"  # where `quarantine` moves broken files (outside every table's glob)


def validate_sweep_id(value: Any, field: str = "sweep_id") -> str:
    """A sweep id becomes a directory name and a hive partition value: letters, digits, `.`, `_`
    and `-` only (no `/`, `=`, `..`), starting with a letter or digit, at most 128 characters."""
    if not (isinstance(value, str) and SWEEP_ID_PATTERN.fullmatch(value) and ".." not in value
            and len(value) <= SWEEP_ID_MAX_LEN):
        raise ConfigError(f"{field}: expected 1-{SWEEP_ID_MAX_LEN} characters of [A-Za-z0-9._-], starting with a "
                          f"letter or digit and without '..', got {value!r}")
    return value


def run_id(config: dict[str, Any]) -> str:
    """Stable id of a run: sha256 of its canonical JSON configuration (16 hex digits)."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def default_root() -> str:
    return os.environ.get("KVCOMPRESS_RESULTS", "results")


def redact(root: str) -> str:
    """`root` as it may be printed or logged: credentials in a URL (`user:secret@`, `secret_key=...`)
    replaced by `***`."""
    root = re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@?#]*@", r"\1***@", root)
    return re.sub(rf"([?&](?:{'|'.join(SECRET_URL_OPTIONS)})=)[^&#]*", r"\1***", root)


def _filesystem(root: str) -> tuple[pafs.FileSystem, str]:
    if "://" in root:
        try:
            return pafs.FileSystem.from_uri(root)
        except (pa.ArrowException, ValueError) as exc:
            scheme = root.split("://", 1)[0]
            raise ConfigError(f"results: unsupported location {redact(root)!r} ({scheme}://): use a local path, "
                              f"file://, s3://, gs:// or hdfs:// ({redact(str(exc).splitlines()[0])})") from None
    return pafs.LocalFileSystem(), os.path.abspath(root)


def is_object_store(root: str) -> bool:
    """Whether `root` is on an object store (S3, GCS, Azure): files are PUT whole, never renamed, and
    DuckDB reads them through pyarrow (`read_files`) instead of its own network extension."""
    return _filesystem(root)[0].type_name in OBJECT_STORES


def refuse_credentials(root: str) -> None:
    """A URL with credentials in it (`s3://KEY:SECRET@bucket`, `?secret_key=...`) is refused: a sweep's
    results URL is a flow run parameter, which Prefect stores and shows on its dashboard."""
    if redact(root) != root:
        raise ConfigError(f"results: credentials in the URL {redact(root)!r} are refused (Prefect would store them "
                          "with the flow run): put them in the store's environment variables (AWS_ACCESS_KEY_ID, "
                          "AWS_SECRET_ACCESS_KEY, ...) instead")


def check_root(root: str) -> None:
    """Fail fast, before any model load, when `root` cannot hold results: credentials in a URL, an
    unknown scheme, an unreachable store, a path that is not writable. Writes and removes one small
    probe file."""
    refuse_credentials(root)
    fs, base = _filesystem(root)
    probe = f"{base}/.write-probe-{uuid.uuid4().hex}"
    try:
        fs.create_dir(base, recursive=True)
        with fs.open_output_stream(probe) as out:
            out.write(b"ok")
        fs.delete_file(probe)
    except (OSError, pa.ArrowException) as exc:
        raise ConfigError(f"results: cannot write to {redact(root)!r}: {redact(str(exc).splitlines()[0])}") from None


def _inside(base: str, path: str) -> bool:
    if os.path.isabs(base):  # local: resolve links too
        base, path = os.path.realpath(base), os.path.realpath(path)
        return os.path.commonpath([base, path]) == base
    base, path = posixpath.normpath(base), posixpath.normpath(path)
    return path == base or path.startswith(base.rstrip("/") + "/")


def _temp_name(name: str) -> str:
    """`.{name}.{host}.{pid}.{uuid}.tmp`: who wrote it, so a crashed writer's file is recognisable."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())
    return f".{name}.{host}.{os.getpid()}.{uuid.uuid4().hex}.tmp"


def _temp_is_stale(base_name: str, mtime_s: float | None) -> bool:
    """A temp file from a dead process on this host, or older than STALE_TEMP_S from anywhere."""
    parts = base_name.split(".")
    if len(parts) >= 5 and parts[-4] == re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) and parts[-3].isdigit():
        pid = int(parts[-3])
        if pid != os.getpid():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                pass
    return mtime_s is not None and time.time() - mtime_s > STALE_TEMP_S


def write_table(root: str, relative_dir: str, name: str, table: pa.Table) -> str:
    """Write `table` to {root}/{relative_dir}/{name}.parquet atomically: on an object store one PUT
    of the whole file (serialized first, so a failure while encoding uploads nothing); elsewhere a
    temp file renamed into place.

    Refuses any path that resolves outside `root`; removes stale temp files of the same name."""
    fs, base = _filesystem(root)
    directory = f"{base}/{relative_dir}"
    final = f"{directory}/{name}.parquet"
    if not _inside(base, final) or "/" in name:
        raise ConfigError(f"results: refusing to write {final!r}: outside the results root {base!r}")
    if fs.type_name in OBJECT_STORES:  # no directories to make, no rename, no temp files to sweep up
        encoded = pa.BufferOutputStream()
        pq.write_table(table, encoded)
        with fs.open_output_stream(final) as out:
            out.write(encoded.getvalue())
        return final
    fs.create_dir(directory, recursive=True)
    temporary = f"{directory}/{_temp_name(name)}"
    pq.write_table(table, temporary, filesystem=fs)
    fs.move(temporary, final)
    for info in fs.get_file_info(pafs.FileSelector(directory)):
        if info.base_name.startswith(f".{name}.") and info.base_name.endswith(".tmp") and \
                _temp_is_stale(info.base_name, info.mtime.timestamp() if info.mtime else None):
            fs.delete_file(info.path)
    return final


def write_run(root: str, sweep_id: str, method: str, run: dict[str, Any], steps: list[dict[str, Any]],
              evidence: list[dict[str, Any]] | None = None) -> None:
    """Write one run's steps and evidence, then its runs row (the row marks the run finished)."""
    validate_sweep_id(sweep_id)
    validate_sweep_id(method, "method")
    run = {**run, "step_rows": len(steps)}
    for table, rows in (("steps", steps), ("evidence", evidence or []), ("runs", [run])):
        partition = f"{table}/sweep_id={sweep_id}/method={method}"
        write_table(root, partition, run["run_id"], pa.Table.from_pylist(rows, schema=TABLES[table]))


def write_speed(root: str, sweep_id: str, method: str, rows: list[dict[str, Any]]) -> None:
    """Write one speed measurement's rows (every round, or its error row) as one file: it is there
    whole or not at all, so a file that reads back is a finished measurement."""
    validate_sweep_id(sweep_id)
    validate_sweep_id(method, "method")
    write_table(root, f"speed/sweep_id={sweep_id}/method={method}", rows[0]["run_id"],
                pa.Table.from_pylist(rows, schema=SPEED_SCHEMA))


def finished_speed_ids(root: str, sweep_id: str) -> set[str]:
    """Run ids of a speed sweep's measurements whose file reads back (whatever their status)."""
    fs, base = _filesystem(root)
    finished = set()
    for info in _parquet_files(fs, f"{base}/speed/sweep_id={sweep_id}"):
        if info.base_name.startswith(".") or not info.base_name.endswith(".parquet") or \
                _partition_problem(posixpath.relpath(info.path, base)) is not None:
            continue
        rows, foreign = _file_problem(fs, info.path, "speed")  # a foreign file is no finished measurement
        if rows and foreign is None:
            finished.add(info.base_name[: -len(".parquet")])
    return finished


def failed_speed_measurements(root: str, sweep_id: str) -> dict[str, str]:
    """{"config_label @ context_tokens": its error} for every measurement of a speed sweep that
    ended in an error (a cache that does not fit the budget, a failed prefill): such a sweep must not
    end "Completed" with the cache silently absent from its report."""
    fs, base = _filesystem(root)
    failed = {}
    for info in _parquet_files(fs, f"{base}/speed/sweep_id={sweep_id}"):
        if info.base_name.startswith(".") or not info.base_name.endswith(".parquet"):
            continue
        try:
            row = pq.read_table(info.path, filesystem=fs, columns=["config_label", "context_tokens", "status",
                                                                   "error"]).to_pylist()[0]
        except (OSError, pa.ArrowException, IndexError):
            continue
        if row["status"] != "ok":
            failed[f"{row['config_label']} @ {row['context_tokens']}"] = row["error"] or row["status"]
    return dict(sorted(failed.items()))


@dataclass(frozen=True)
class Problem:
    """A file under a results root that no report or resume should trust."""

    path: str
    reason: str


def _parquet_files(fs: pafs.FileSystem, directory: str) -> list[pafs.FileInfo]:
    selector = pafs.FileSelector(directory, recursive=True, allow_not_found=True)
    return [i for i in fs.get_file_info(selector) if i.is_file]


def _rows(fs: pafs.FileSystem, path: str) -> int | None:
    """Row count from the Parquet footer, or None when the file is not readable Parquet."""
    try:
        return pq.read_metadata(path, filesystem=fs).num_rows
    except (OSError, pa.ArrowException):
        return None


def _partition_problem(relative: str) -> str | None:
    """Why `relative` ({table}/sweep_id=S/method=M/{run_id}.parquet, below the root) is not where a
    writer puts a file, or None: S and M must pass the sweep id rule where they are read, as where
    they are written (DuckDB decodes `%2F` in a directory name, so `sweep_id=%2Fetc` reads as
    "/etc" and would become a path)."""
    parts = relative.split("/")
    if len(parts) != 4:
        return f"not at TABLE/sweep_id=ID/method=NAME/RUN.parquet ({len(parts) - 1} directories deep)"
    for part, key in zip(parts[1:3], ("sweep_id", "method")):
        name, _, value = part.partition("=")
        if name != key or not valid_sweep_id(value):
            return f"directory {part!r}: expected {key}=ID with ID of 1-{SWEEP_ID_MAX_LEN} characters of [A-Za-z0-9._-]"
    return None


def valid_sweep_id(value: Any) -> bool:
    """Whether `value` passes `validate_sweep_id` (for names read back, where a bad one is skipped)."""
    try:
        validate_sweep_id(value)
    except ConfigError:
        return False
    return True


def _file_problem(fs: pafs.FileSystem, path: str, table: str) -> tuple[int | None, str | None]:
    """(rows, why the file is not one of `table`'s, or None): readable Parquet whose every column is
    one of the table's, of its type (a file written before a column existed lacks it: read as NULL)."""
    try:
        metadata = pq.read_metadata(path, filesystem=fs)
        schema = metadata.schema.to_arrow_schema()
    except (OSError, pa.ArrowException):
        return None, "not readable Parquet"
    expected = TABLES[table]
    for field in schema:
        if field.name not in expected.names:
            return metadata.num_rows, f"column {field.name[:80]} is not one of it"
        if not field.type.equals(expected.field(field.name).type):
            return metadata.num_rows, (f"column {field.name} is {field.type}, the {table} table's "
                                       f"{expected.field(field.name).type}")
    if "run_id" not in schema.names:
        return metadata.num_rows, "it has no run_id column"
    return metadata.num_rows, None


def _run_problem(fs: pafs.FileSystem, base: str, relative: str) -> str | None:
    """Why the run whose runs file is {base}/runs/{relative} is not finished, or None when it is:
    its runs file holds one row, its steps file the rows that row promises, and its evidence file
    (absent for runs written before the table existed) reads as Parquet."""
    where = _partition_problem(f"runs/{relative}")
    if where is not None:
        return where
    runs_path = f"{base}/runs/{relative}"
    rows, foreign = _file_problem(fs, runs_path, "runs")
    if rows != 1:
        return "runs file is not readable Parquet with one row"
    if foreign is not None:
        return f"runs file is not of the runs table: {foreign}"
    steps_rows, foreign = _file_problem(fs, f"{base}/steps/{relative}", "steps")
    if steps_rows is None:
        return "its steps file is missing or not readable Parquet"
    if foreign is not None:
        return f"its steps file is not of the steps table: {foreign}"
    expected_id = posixpath.basename(relative)[: -len(".parquet")]
    try:
        row = pq.read_table(runs_path, filesystem=fs).to_pylist()[0]
    except (OSError, pa.ArrowException) as exc:
        return f"runs file does not read back: {exc}"
    if row["run_id"] != expected_id:  # a whole run, but another run's: resume must not skip this one
        return f"runs file holds run {shown(row['run_id'], 80)}, not {expected_id!r}"
    promised = row.get("step_rows")  # None for files written before the column existed
    if promised is not None and promised != steps_rows:
        return f"steps file holds {steps_rows} rows, the run wrote {promised}"
    evidence_path = f"{base}/evidence/{relative}"
    if fs.get_file_info(evidence_path).type != pafs.FileType.NotFound:
        evidence_rows, foreign = _file_problem(fs, evidence_path, "evidence")
        if evidence_rows is None or foreign is not None:
            return f"its evidence file is {foreign or 'not readable Parquet'}"
    return None


def finished_run_ids(root: str, sweep_id: str) -> set[str]:
    """Run ids of a sweep whose runs and steps files both read back whole (whatever their status)."""
    fs, base = _filesystem(root)
    finished = set()
    for info in _parquet_files(fs, f"{base}/runs/sweep_id={sweep_id}"):
        if info.base_name.startswith(".") or not info.base_name.endswith(".parquet"):
            continue
        if _run_problem(fs, base, posixpath.relpath(info.path, f"{base}/runs")) is None:
            finished.add(info.base_name[: -len(".parquet")])
    return finished


def configs_without_ok_run(root: str, sweep_id: str) -> dict[str, str]:
    """{config_label: an error of it} for every config of a finished sweep none of whose runs ended
    `ok` (a method that fails on every sample, e.g. a kernel that does not run on this machine):
    such a sweep must not end "Completed" with the config silently absent from every report."""
    fs, base = _filesystem(root)
    ok, errors = set(), {}
    for info in _parquet_files(fs, f"{base}/runs/sweep_id={sweep_id}"):
        if info.base_name.startswith(".") or not info.base_name.endswith(".parquet"):
            continue
        try:
            row = pq.read_table(info.path, filesystem=fs, columns=["config_label", "status", "error"]).to_pylist()[0]
        except (OSError, pa.ArrowException, IndexError):
            continue  # unfinished or corrupt: `finished_run_ids` and `scan` deal with it
        if row["status"] == "ok":
            ok.add(row["config_label"])
        else:
            errors.setdefault(row["config_label"], f"{row['status']}: {row['error']}")
    return {label: error for label, error in sorted(errors.items()) if label not in ok}


def scan(root: str) -> list[Problem]:
    """Every file under `root` a report or a resume must not trust: unreadable `*.parquet`, runs
    whose steps do not match, and stale temp files of crashed writes."""
    fs, base = _filesystem(root)
    problems = []
    for info in _parquet_files(fs, base):
        relative = posixpath.relpath(info.path, base)
        top = relative.split("/", 1)[0]
        if top == QUARANTINE:
            continue
        name = info.base_name
        if name.startswith(".") and name.endswith(".tmp"):
            if _temp_is_stale(name, info.mtime.timestamp() if info.mtime else None):
                problems.append(Problem(info.path, "stale temporary file of a crashed write"))
        elif name.endswith(".parquet") and not name.startswith("."):
            if top == "runs":
                reason = _run_problem(fs, base, relative.split("/", 1)[1])
            elif top in TABLES:  # steps without a runs row are a run in progress: left alone when whole
                reason = _partition_problem(relative) or _file_problem(fs, info.path, top)[1]
            else:  # not a table of runs (regressions/...): its own reader checks it
                reason = None if _rows(fs, info.path) is not None else "not readable Parquet"
            if reason is not None:
                problems.append(Problem(info.path, reason))
    return problems


def quarantine(root: str, problems: list[Problem]) -> list[str]:
    """Move each problem file to {root}/_quarantine/<UTC time>/<its relative path>; returns the
    new paths. Reports and resume never read there; the next sweep reruns the runs involved."""
    fs, base = _filesystem(root)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    paths = []
    for problem in problems:  # a broken run goes with its steps and evidence files: the run stays whole
        relative = posixpath.relpath(problem.path, base)
        paths.append(relative)
        if relative.startswith("runs/") and problem.path.endswith(".parquet"):
            paths += [f"{table}/" + relative.split("/", 1)[1] for table in TABLES if table != "runs"]
    moved = []
    for relative in dict.fromkeys(paths):
        if fs.get_file_info(f"{base}/{relative}").type == pafs.FileType.NotFound:
            continue
        target = f"{base}/{QUARANTINE}/{stamp}/{relative}"
        if not _inside(f"{base}/{QUARANTINE}/{stamp}", target):  # a listed name is the store's, maybe hostile
            continue
        fs.create_dir(posixpath.dirname(target), recursive=True)
        fs.move(f"{base}/{relative}", target)
        moved.append(target)
    return moved


def readable_files(root: str, table: str) -> tuple[list[str], list[Problem]]:
    """The `*.parquet` files of one table a report may read, and the ones it must not: unreadable,
    foreign (a column not of the table, or of another type) or under a partition directory whose
    name is not a valid sweep id or method."""
    fs, base = _filesystem(root)
    paths = [i.path for i in _parquet_files(fs, f"{base}/{table}")
             if not i.base_name.startswith(".") and i.base_name.endswith(".parquet")]

    def problem(path: str) -> str | None:
        return _partition_problem(posixpath.relpath(path, base)) or _file_problem(fs, path, table)[1]

    with ThreadPoolExecutor(READERS) as pool:  # an object store answers each footer read after a round trip
        reasons = list(pool.map(problem, paths))
    good = [p for p, reason in zip(paths, reasons) if reason is None]
    if not isinstance(fs, pafs.LocalFileSystem):  # object stores list "bucket/key": readers need the scheme back
        scheme = root.split("://", 1)[0]
        good = [f"{scheme}://{p}" for p in good]
    return good, [Problem(p, reason) for p, reason in zip(paths, reasons) if reason is not None]


def read_files(root: str, table: str, paths: list[str]) -> pa.Table:
    """The files `paths` of one table (as `readable_files` lists them) as one Arrow table, with the
    hive columns last (`method`, `sweep_id`: DuckDB's order) and NULL for columns a file predates: how
    reports read an object store offline (DuckDB's own reader would download its network extension)."""
    fs, base = _filesystem(root)
    schema = pa.unify_schemas([TABLES[table], pa.schema(sorted(PARTITION_SCHEMA, key=lambda field: field.name))])
    if not paths:
        return schema.empty_table()
    dataset = pads.dataset([p.split("://", 1)[-1] for p in paths], schema=schema, format="parquet", filesystem=fs,
                           partitioning=pads.partitioning(PARTITION_SCHEMA, flavor="hive"),
                           partition_base_dir=f"{base}/{table}")
    return dataset.to_table()
