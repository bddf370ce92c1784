"""Execute one sweep shard with resume: load (cached) model and samples, skip finished runs,
write each run the moment it finishes; and one group of a speed sweep likewise. Used by the
Prefect tasks and by tests alike."""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable, Mapping

from . import datasets, speed
from .adapter import native_cache
from .errors import ConfigError
from .leases import STALE_S, ShardLease
from .model import context_window, load_model, load_tokenizer, model_fingerprint
from .results import finished_run_ids, finished_speed_ids, run_id, write_run, write_speed
from .runner import RunContext, run_sample
from .sweep import Shard, SpeedGroup, SpeedPlan, SweepError

_SAMPLES: dict[tuple, list[dict]] = {}  # (dataset, frozen params, model) -> samples, a few per process
_SAMPLES_KEPT = 8
LEASE_POLL_S = 2.0  # how often a launch waiting for another's shard looks again
# Called with (config label, status) as each run of a shard executed in this process ends: "ok",
# "error" or "timeout" as written, "skipped" for a run a resumed sweep finished before (the CLI's
# per-run progress bar)
RUN_LISTENERS: list[Callable[[str, str], None]] = []


def _frozen(value: Any) -> Any:
    """A hashable stand-in for loader parameters (nested lists and mappings), for the cache key."""
    if isinstance(value, Mapping):
        return (dict, tuple(sorted((k, _frozen(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (list, tuple(_frozen(v) for v in value))
    return value


def load_samples(dataset: str, params: Mapping[str, Any], model_name: str) -> list[dict]:
    """A dataset's samples as dicts, sized in `model_name`'s tokens; cached per process (the
    shards of one dataset share it)."""
    key = (dataset, _frozen(params), model_name)
    if key not in _SAMPLES:
        if len(_SAMPLES) >= _SAMPLES_KEPT:
            _SAMPLES.pop(next(iter(_SAMPLES)))  # the oldest
        tokenizer = load_tokenizer(model_name)
        _SAMPLES[key] = datasets.load_dataset(dataset, tokenizer=tokenizer, **params).to_list()
    return _SAMPLES[key]


def shard_key(shard: Shard) -> str:
    """The shard's identity within a sweep: its dataset, parameters and first row (what its lease locks)."""
    return run_id({"dataset": shard.dataset, "params": dict(shard.dataset_params), "sample": shard.sample_index})


def execute_shard(shard: Shard, model_name: str, decode_steps: int | None, sweep_id: str, results: str,
                  run_timeout_s: float | None = None, lease_wait_s: float = 0.0,
                  log: Callable[[str], None] = lambda line: None) -> dict:
    """Run a shard's unfinished runs under its lease (kvcompress/leases.py); returns counts {"skipped",
    "ran", "failed"}, with "leased_by" (and nothing run) when another process held the lease for
    `lease_wait_s` seconds: another launch of the same sweep is running this shard. `log` gets a line
    per finished run (a shard of the default grid takes minutes; its runs seconds each)."""
    lease = ShardLease(results, sweep_id, shard_key(shard), stale_s=max(STALE_S, 2 * (run_timeout_s or 0)))
    deadline = time.monotonic() + lease_wait_s
    while not lease.acquire():
        if time.monotonic() >= deadline:
            owner = lease.owner()
            return {"skipped": 0, "ran": 0, "failed": 0, "leased_by": owner.describe() if owner else "another process"}
        time.sleep(LEASE_POLL_S)
    try:
        return _execute_leased(shard, model_name, decode_steps, sweep_id, results, run_timeout_s, lease, log)
    finally:
        lease.release()


def _execute_leased(shard: Shard, model_name: str, decode_steps: int | None, sweep_id: str, results: str,
                    run_timeout_s: float | None, lease: ShardLease, log: Callable[[str], None]) -> dict:
    model, tokenizer = load_model(model_name)
    first = shard.sample_index
    samples = load_samples(shard.dataset, shard.dataset_params, model_name)[first:first + shard.rows]
    context = RunContext(model_name, model_fingerprint(model_name), shard.dataset, shard.dataset_params, decode_steps,
                         run_timeout_s)
    finished = finished_run_ids(results, sweep_id)
    window = context_window(model_name)
    beyond_window = bool(window and shard.dataset_params.get("context_tokens", 0) > window)

    to_run: list[str] = []  # run ids, as run_sample asks about them (all before the first run)
    done: list[str] = []

    def pending(config) -> bool:
        if run_id(config) in finished:
            return False
        to_run.append(run_id(config))
        return True

    def write(record) -> None:
        if beyond_window:  # the grid opted in (allow_beyond_window): every report shows it
            record.run["config_label"] += f" [beyond {window}-token window]"
        write_run(results, sweep_id, record.method, record.run, record.steps, record.evidence)
        lease.renew()
        for listener in RUN_LISTENERS:
            listener(record.run["config_label"], record.run["status"])
        done.append(record.run["status"])
        log(f"run {len(done)}/{len(to_run)} of {shard.dataset} #{shard.sample_index}: {record.run['config_label']}: "
            f"{record.run['status']}")

    records = run_sample(model, tokenizer, samples, list(shard.methods), context, on_record=write,
                         protocols=shard.protocols, pending=pending)
    total = len(samples) * len(shard.methods) * len(shard.protocols)
    for listener in RUN_LISTENERS:
        for _ in range(total - len(records)):
            listener(f"{shard.dataset} #{shard.sample_index}", "skipped")
    return {"skipped": total - len(records), "ran": len(records), "failed": sum(r.run["status"] != "ok" for r in records)}


def check_speed_plan(plan: SpeedPlan) -> None:
    """Before any measurement: the model loads, every cache that will run more than one sequence
    runs a batch of two, and every group's estimated peak fits the device's memory (SweepError
    naming each failure)."""
    model = plan.model.load()
    batched = any(g.batch is None or g.batch > 1 for g in plan.groups)
    errors = []
    for method in plan.methods if batched else ():
        try:
            speed.check_batched(model, method.label(), lambda m=method: m.make_cache(model),
                                min(speed.BATCH_PROBE_TOKENS, *(g.context_tokens for g in plan.groups)))
        except ConfigError as exc:
            errors.append(str(exc))
    if errors:
        raise SweepError(errors)
    errors = check_speed_memory(plan, model)
    if errors:
        raise SweepError(errors)


def check_speed_memory(plan: SpeedPlan, model) -> list[str]:
    """Each group's peak, estimated from one sequence of each cache (speed.sequence_footprint) at the
    batch it will run, against the device's memory: a group that cannot fit is refused with the
    numbers, so a grid never dies mid-group. Refused rather than run at a smaller batch: a budget's
    batch is what its row means, and a lower one would mix memory with the budget in x full."""
    available = plan.device_memory_bytes or speed.device_memory_bytes()
    weights = speed.weight_bytes(model)
    footprints = {(m, T): speed.sequence_footprint(model, lambda m=m: m.make_cache(model), T)
                  for T in sorted({g.context_tokens for g in plan.groups}) for m in plan.methods}
    errors = []
    for group in plan.groups:
        caches = []
        for method in plan.methods:
            prefill_peak, kv = footprints[method, group.context_tokens]
            batch = group.batch if group.kv_budget_bytes is None else max(
                1, speed.fit_batch(kv, group.kv_budget_bytes, plan.max_batch))
            caches.append((batch, prefill_peak, kv))
        peak, at, held = speed.group_peak_bytes(weights, caches, plan.prefill_rounds)
        if peak > available:
            batch, prefill_peak, _ = caches[at]
            errors.append(f"{group.describe()}: needs about {peak} bytes ({peak / 2**30:.2f} GiB) at "
                          f"{plan.methods[at].label()}'s prefill at batch {batch} ({weights} of weights + {held} of "
                          f"KV of the caches held beside it + {batch} x {prefill_peak} a sequence), more than the "
                          f"{available} bytes ({available / 2**30:.2f} GiB) of device memory; lower the batch, "
                          f"kv_budget_gib or max_batch, or measure fewer caches together")
    return errors


def execute_speed_group(plan: SpeedPlan, group: SpeedGroup, sweep_id: str, results: str,
                        log: Callable[[str], None] = lambda line: None) -> dict:
    """Measure a group's unfinished caches, taking turns (kvcompress/speed.py), and write each
    measurement; returns counts {"skipped", "ran", "failed"}."""
    finished = finished_speed_ids(results, sweep_id)
    pending = [m for m in plan.methods if run_id(plan.measurement_config(group, m)) not in finished]
    if not pending:
        return {"skipped": len(plan.methods), "ran": 0, "failed": 0}
    model = plan.model.load()
    weights = speed.weight_bytes(model)
    T = group.context_tokens
    # untimed, at this length: a process's first long prefill runs ~2x slower (H200, 32k: 2.77 s, then
    # 1.27-1.57 s), and the cache timed first would pay for it
    speed.prefill(model, native_cache(model), speed.prompts(model, 1, T))
    measured, failed = [], []
    for method in pending:
        config = plan.measurement_config(group, method)
        make = lambda m=method: m.make_cache(model)  # noqa: E731
        per_sequence, batch = None, group.batch
        try:
            if group.kv_budget_bytes is not None:
                per_sequence = speed.bytes_per_sequence(model, make, T)
                batch = speed.fit_batch(per_sequence, group.kv_budget_bytes, plan.max_batch)
                if batch == 0:
                    raise ConfigError(f"{method.label()}: one {T}-token sequence holds {per_sequence} bytes of KV, "
                                      f"more than the budget of {group.kv_budget_bytes}")
            run = speed.prepare(model, method.label(), make, T, batch, plan.warmup)
            log(f"{method.label()} @ {group.describe()}: batch {batch}, {run.live_kv_bytes / 2**20:.1f} MiB KV, "
                f"prefill {run.prefill_s[0]:.2f} s")
            measured.append((method, config, batch, per_sequence, run))
        except Exception as exc:  # noqa: BLE001 (recorded; the other caches go on)
            error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
            failed.append(method)
            write_speed(results, sweep_id, method.name, speed.measurement_rows(
                None, config, plan.model, method, batch or 0, group.kv_budget_bytes, per_sequence, weights, error))
    speed.take_turns(model, [run for *_, run in measured], plan.steps, plan.rounds, plan.prefill_rounds, log)
    for method, config, batch, per_sequence, run in measured:
        write_speed(results, sweep_id, method.name, speed.measurement_rows(
            run, config, plan.model, method, batch, group.kv_budget_bytes, per_sequence, weights))
    return {"skipped": len(plan.methods) - len(pending), "ran": len(measured), "failed": len(failed)}
