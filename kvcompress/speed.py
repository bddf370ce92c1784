"""Decode throughput of caches, measured taking turns (the speed sweep and `benchmarks/e2e.py`).

Compression pays by memory: the bytes a cache frees hold more sequences in a batch (KIVI: 4x the
batch, 2.35-3.47x the throughput). So a cache is measured at a batch, either given or the largest
whose KV after the prompt fits a memory budget (`fit_batch`, from the bytes one sequence holds,
measured). For each cache of a group (one context length, one batch or budget):

1. `prepare`: a throw-away prefill and two decode steps first (JIT compilation, kernel self-tests),
   then `batch` random prompts of the context length are prefilled in 2048-token chunks (mlx-lm's
   default; MLX's buffer cache cleared after each, as `mlx_lm.generate` does), timed, and decoded
   `warmup` greedy steps; resident KV bytes (`memory.live_kv_bytes`), the peak (the weights plus this
   cache's prefill, as if it were alone) and the kernel paths that ran are noted;
2. `take_turns`: `prefill_rounds - 1` more timed prefills per cache, then `rounds` rounds in which
   every cache in turn (the order rotated each round) decodes `steps` steps timed two ways:
   synchronously per step (as the runner times `step_ms`; the host time to build a step's graph too)
   and pipelined as `mlx_lm.generate` runs (the next step's graph built while the device runs this one).

Taking turns puts the machine's drift (clocks, host load: single runs on the lent H200 moved by up to
1.5x between calls) on every cache alike, so ratios between caches are taken per round (docs/learned.md,
"How to measure"). Every figure counts the batch: tok/s is sequences x steps per second.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from . import attention
from .errors import ConfigError
from .kernels import dispatch
from .memory import live_kv_bytes
from .methods.base import Method
from .model import context_window, default_dtype, load_model, model_fingerprint
from .results import run_id
from .runner import PREFILL_CHUNK, method_identity
from .shapes import random_model, shape_config

WARM_UP_TOKENS = 2100  # a throw-away prefill crosses one chunk boundary: both chunk shapes compile
BATCH_PROBE_TOKENS = 256  # check_batched's prompt (at most): room for every method's budget at its defaults


def prompts(model, batch: int, T: int) -> mx.array:
    """`batch` random T-token prompts [batch, T], the same for every cache at this length."""
    return mx.random.randint(0, vocab_size(model), (batch, T), key=mx.random.key(T))


def vocab_size(model) -> int:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None) or getattr(getattr(args, "text_config", None), "vocab_size", None)
    return int(size) if size else 256


def weight_bytes(model) -> int:
    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


def prefill(model, caches: list, prompt, chunk: int = PREFILL_CHUNK) -> tuple[mx.array, float]:
    """prompt: token ids [T] or [B, T]; returns (logits of the last position [B, 1, vocab], seconds)."""
    prompt = mx.array(prompt)
    prompt = prompt[None] if prompt.ndim == 1 else prompt  # [B, T]
    T = prompt.shape[1]
    mx.synchronize()
    start = time.perf_counter()
    for i in range(0, T - 1, chunk):
        model(prompt[:, i : min(i + chunk, T - 1)], cache=caches)
        mx.eval([c.state for c in caches])
        # as mlx_lm.generate after each chunk: without it, MLX's CUDA allocator can be left releasing
        # its buffer cache on every cache miss, with synchronizing frees, for as long as the process runs
        # (docs/learned.md, "MLX's allocator after a long prefill")
        mx.clear_cache()
    logits = model(prompt[:, -1:], cache=caches)
    mx.eval(logits)
    mx.synchronize()
    return logits, time.perf_counter() - start


def greedy(logits: mx.array) -> mx.array:
    """[B, S, vocab] -> the next token of each sequence [B]."""
    return mx.argmax(logits[:, -1], axis=-1)


def step(model, caches: list, token: mx.array) -> mx.array:
    return greedy(model(token.reshape(-1, 1), cache=caches))


def decode_sync(model, caches: list, token: mx.array, steps: int, warmup: int) -> tuple[float, float, mx.array]:
    """Per-step synchronous decode, as the runner times it: (median ms a step, median ms to build the
    step's graph on the host before the device runs it, the last token)."""
    times, build = [], []
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        logits = model(token.reshape(-1, 1), cache=caches)
        t1 = time.perf_counter()
        token = greedy(logits)
        mx.eval(token)
        if s >= warmup:
            times.append(1e3 * (time.perf_counter() - t0))
            build.append(1e3 * (t1 - t0))
    return (statistics.median(times), statistics.median(build), token) if steps else (0.0, 0.0, token)


def decode_pipelined(model, caches: list, token: mx.array, steps: int) -> float:
    """ms a step as mlx_lm.generate_step runs: the next step's graph is built while the device runs this one."""
    y = step(model, caches, token)
    mx.async_eval(y)
    t0 = time.perf_counter()
    for _ in range(steps):
        next_y = step(model, caches, y)
        mx.async_eval(next_y)
        y.tolist()
        y = next_y
    y.tolist()
    return 1e3 * (time.perf_counter() - t0) / steps


@dataclass
class Measured:
    """One cache of a group: its prefilled caches (dropped after the rounds) and what was measured."""

    label: str
    T: int
    batch: int
    make: Callable[[], list]  # fresh caches of this kind
    caches: list | None
    token: mx.array | None
    live_kv_bytes: int
    peak_memory_bytes: int
    kernels: dict[str, str]
    prefill_s: list[float] = field(default_factory=list)
    decode_ms: list[float] = field(default_factory=list)  # per round: median synchronous ms a step
    host_ms: list[float] = field(default_factory=list)  # per round: median ms to build a step's graph
    pipelined_ms: list[float] = field(default_factory=list)  # per round: ms a step, pipelined

    def drop_caches(self) -> None:
        self.caches = self.token = None


def warm_up(model, make: Callable[[], list], T: int) -> None:
    """A throw-away prefill and two decode steps of a cache of this kind: kernels compile and
    self-test outside the timings."""
    attention.install()
    warm = make()
    logits, _ = prefill(model, warm, prompts(model, 1, min(T, WARM_UP_TOKENS)))
    decode_sync(model, warm, greedy(logits), 2, 0)
    del warm, logits
    gc.collect()


def prepare(model, label: str, make: Callable[[], list], T: int, batch: int, warmup: int) -> Measured:
    """One cache prefilled with `batch` T-token prompts (timed) and decoded `warmup` steps, kept for the rounds."""
    warm_up(model, make, T)
    caches = make()
    prompt = prompts(model, batch, T)
    dispatch.reset_paths()
    resident = mx.get_active_memory()  # the weights and the caches prepared before this one
    mx.reset_peak_memory()
    logits, prefill_s = prefill(model, caches, prompt)
    peak = mx.get_peak_memory() - resident + weight_bytes(model)  # as if this cache were alone
    kv_bytes = live_kv_bytes(caches)
    _, _, token = decode_sync(model, caches, greedy(logits), 0, warmup)
    return Measured(label, T, batch, make, caches, token, kv_bytes, peak, dispatch.paths_used(), [prefill_s])


def bytes_per_sequence(model, make: Callable[[], list], T: int) -> int:
    """Resident KV bytes of one T-token sequence in a cache of this kind (prefilled, then dropped)."""
    attention.install()
    caches = make()
    prefill(model, caches, prompts(model, 1, T))
    held = live_kv_bytes(caches)
    del caches
    gc.collect()
    mx.clear_cache()
    return held


def sequence_footprint(model, make: Callable[[], list], T: int, chunk: int = PREFILL_CHUNK) -> tuple[int, int]:
    """(bytes one T-token sequence's prefill peaks at above what was resident, KV bytes it holds after),
    for the memory check before a speed sweep. Measured at T itself up to one chunk and a token; beyond,
    at one and two chunks (and a token) and extrapolated to T on the line through them: a chunked
    prefill's activations (the chunk's logits, MLP) do not grow with T, its KV and any scores over the
    keys grow linearly, so two lengths past a chunk give both parts without a T-token prefill."""
    lengths = sorted({min(T, chunk + 1), min(T, 2 * chunk + 1)})
    if any(_keeps_more_than_its_budget(make, L) for L in lengths):
        return _prefill_footprint(model, make, T)  # protected tokens fill the short lengths: not linear there
    try:
        measured = [_prefill_footprint(model, make, L) for L in lengths]
    except ConfigError:  # a budget with no room at the short lengths (protected tokens): measured at T
        return _prefill_footprint(model, make, T)
    if len(measured) == 1:
        return measured[0]
    (L1, (peak1, kv1)), (L2, (peak2, kv2)) = zip(lengths, measured)
    # a slope below zero (a fixed-size cache, allocator noise) is taken as flat
    extend = lambda at1, at2: at2 + max(0, at2 - at1) * (T - L2) // (L2 - L1)  # noqa: E731
    return extend(peak1, peak2), extend(kv1, kv2)


def _keeps_more_than_its_budget(make: Callable[[], list], T: int) -> bool:
    """Whether an eviction cache would keep more than its budget at a T-token prompt (its protected
    window leaves no scored token: `resolve` raises the budget, so bytes there do not scale to T)."""
    config = next((c.config for c in make() if hasattr(getattr(c, "config", None), "window_shortfall")), None)
    return config is not None and bool(config.window_shortfall(T))


def _prefill_footprint(model, make: Callable[[], list], T: int) -> tuple[int, int]:
    attention.install()
    caches = make()
    prompt = prompts(model, 1, T)
    mx.eval(prompt)
    mx.synchronize()
    resident = mx.get_active_memory()
    mx.reset_peak_memory()
    prefill(model, caches, prompt)
    peak = mx.get_peak_memory() - resident
    held = live_kv_bytes(caches)
    del caches
    gc.collect()
    mx.clear_cache()
    return peak, held


def group_peak_bytes(weights: int, caches: list[tuple[int, int, int]],
                     prefill_rounds: int = 1) -> tuple[int, int, int]:
    """(estimated peak bytes of a group, the index of the cache whose prefill reaches it, the KV bytes
    resident beside that prefill) from (batch, prefill peak a sequence, KV bytes a sequence) of each
    cache in the order they are prepared: every prepared cache stays resident for the rounds
    (execute_speed_group), so cache i is prefilled beside the KV of the caches before it, and in a
    later prefill round (`prefill_again`) beside all of them."""
    resident = [sum(b * kv for b, _, kv in caches[:i]) for i in range(len(caches))]
    if prefill_rounds > 1:
        resident = [sum(b * kv for b, _, kv in caches)] * len(caches)
    need = [weights + resident[i] + batch * prefill_peak for i, (batch, prefill_peak, _) in enumerate(caches)]
    at = max(range(len(caches)), key=need.__getitem__)
    return need[at], at, resident[at]


def device_memory_bytes() -> int:
    """The memory the default device can hold: Metal's recommended working set, CUDA's total memory,
    on the CPU the machine's RAM."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fit_batch(per_sequence: int, budget_bytes: int, max_batch: int | None = None) -> int:
    """The largest batch whose KV (`per_sequence` bytes each) fits `budget_bytes`, at most `max_batch`;
    0 when one sequence does not fit."""
    fits = budget_bytes // per_sequence if per_sequence > 0 else max_batch or 1
    return min(fits, max_batch) if max_batch else fits


def check_batched(model, label: str, make: Callable[[], list], tokens: int = BATCH_PROBE_TOKENS) -> None:
    """ConfigError when a cache of this kind cannot run two sequences at once (a batch of two
    `tokens`-token prompts, then one decode step), before anything is measured."""
    attention.install()
    try:
        caches = make()
        logits = model(mx.zeros((2, tokens), mx.int32), cache=caches)
        mx.eval(model(greedy(logits).reshape(-1, 1), cache=caches))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 (the cache's own failure is the reason given)
        raise ConfigError(f"{label}: does not run a batch of 2 sequences ({type(exc).__name__}: {exc})") from None


def prefill_again(model, run: Measured) -> None:
    """One more timed prefill of the run's prompts into fresh caches of its kind (then dropped)."""
    caches = run.make()
    _, seconds = prefill(model, caches, prompts(model, run.batch, run.T))
    run.prefill_s.append(seconds)
    del caches
    gc.collect()
    mx.clear_cache()


def decode_round(model, run: Measured, steps: int) -> None:
    """`steps` synchronous steps, then `steps` pipelined ones, appended to the run's lists."""
    ms, build_ms, run.token = decode_sync(model, run.caches, run.token, steps, 0)
    run.decode_ms.append(ms)
    run.host_ms.append(build_ms)
    run.pipelined_ms.append(decode_pipelined(model, run.caches, run.token, steps))


def take_turns(model, runs: list[Measured], steps: int, rounds: int, prefill_rounds: int,
               log: Callable[[str], None] = lambda line: None) -> None:
    """The timed prefills and decode rounds, every cache taking its turn in every round, the order
    rotated each round, so drift in the machine falls on all of them alike."""
    for rnd in range(1, prefill_rounds):
        for run in runs[rnd % len(runs):] + runs[: rnd % len(runs)]:
            prefill_again(model, run)
        log(f"prefill round {rnd}: " + ", ".join(f"{r.label} {r.prefill_s[-1]:.2f} s" for r in runs))
    for rnd in range(rounds):
        for run in runs[rnd % len(runs):] + runs[: rnd % len(runs)]:
            decode_round(model, run, steps)
        log(f"round {rnd}: " + ", ".join(f"{r.label} {r.decode_ms[-1]:.2f}/{r.pipelined_ms[-1]:.2f} ms" for r in runs))
    for run in runs:
        run.drop_caches()
    gc.collect()
    mx.clear_cache()


def ratio(full: list[float], other: list[float]) -> tuple[float, float, float]:
    """full / other per round (the same round's times): (median, min, max)."""
    per_round = [f / o for f, o in zip(full, other)]
    return statistics.median(per_round), min(per_round), max(per_round)


def device_name() -> str:
    """The device measurements ran on, e.g. "gpu: NVIDIA H200" (part of a measurement's identity)."""
    device = mx.default_device()
    try:
        name = mx.device_info().get("device_name", "")
    except Exception:  # noqa: BLE001 (older MLX: the kind alone)
        name = ""
    return f"{device.type.name}: {name}" if name else device.type.name


@dataclass(frozen=True)
class SpeedModel:
    """What a speed grid measures: a model by name (the embedded one, an mlx-lm directory or hub id,
    as a sweep's `model:`) or a random-weight model of a shape (`kvcompress/shapes.py`)."""

    name: str | None = None
    shape: str | None = None
    dtype: str | None = None  # None: load_model's default (float16 on a GPU, float32 on a CPU)
    layers: int | None = None  # shapes only: keep the first N layers

    def resolved_dtype(self) -> str:
        return self.dtype or str(default_dtype()).removeprefix("mlx.core.")

    def load(self):
        if self.shape is not None:
            return random_model(self.shape, self.resolved_dtype(), self.layers)
        return load_model(self.name, self.resolved_dtype())[0]

    def label(self) -> str:
        """How the `speed` table's `model` column names it."""
        if self.shape is None:
            return self.name
        return f"{self.shape} random" + (f" ({self.layers} layers)" if self.layers else "")

    def identity(self) -> dict:
        """The model's part of a measurement's id: the whole shape config, or the weights' fingerprint."""
        if self.shape is not None:
            return {"shape": self.shape, "config": shape_config(self.shape, self.layers), "dtype": self.resolved_dtype()}
        return {"model": self.name, "model_fingerprint": model_fingerprint(self.name, self.resolved_dtype()),
                "dtype": self.resolved_dtype()}

    def context_window(self) -> int | None:
        if self.shape is not None:
            return shape_config(self.shape).get("max_position_embeddings")
        return context_window(self.name)


def measurement_config(model: SpeedModel, method: Method, context_tokens: int, batch: int | None,
                       kv_budget_bytes: int | None, steps: int, rounds: int, warmup: int, prefill_rounds: int) -> dict:
    """The full configuration of one measurement: what its id hashes and the `config` column holds.
    Under a budget the batch is found by measuring, so the budget, not the batch, is its identity."""
    config = {"kind": "speed", "model": model.identity(), "method": method_identity(method),
              "context_tokens": context_tokens, "steps": steps, "rounds": rounds, "warmup": warmup,
              "prefill_rounds": prefill_rounds, "device": device_name(), "mlx": mx.__version__}
    config.update({"batch": batch} if kv_budget_bytes is None else {"kv_budget_bytes": kv_budget_bytes})
    config.update(method.revisions())  # see Method.revision
    return config


def measurement_rows(run: Measured | None, config: dict, model: SpeedModel, method: Method, batch: int,
                     kv_budget_bytes: int | None, per_sequence: int | None, weights: int,
                     error: str | None = None) -> list[dict]:
    """The `speed` table's rows of one measurement: one per round (decode and prefill rounds may
    differ in number: the shorter one's columns are null past its end), or one error row."""
    base = dict(run_id=run_id(config), model=model.label(), dtype=model.resolved_dtype(), device=config["device"],
                context_tokens=config["context_tokens"], batch=batch, kv_budget_bytes=kv_budget_bytes,
                kv_bytes_per_sequence=per_sequence, decode_steps=config["steps"], weight_bytes=weights,
                config_label=method.label(), config=json.dumps(config, sort_keys=True),
                created_at=datetime.now(timezone.utc))
    if run is None:
        return [{**base, "round": None, "status": "error", "error": error}]
    rounds = max(len(run.decode_ms), len(run.prefill_s))
    at = lambda values, i: values[i] if i < len(values) else None  # noqa: E731
    return [{**base, "round": i, "status": "ok", "error": None,
             "decode_ms": at(run.decode_ms, i), "host_ms": at(run.host_ms, i), "pipelined_ms": at(run.pipelined_ms, i),
             "decode_tok_s": batch * 1e3 / run.decode_ms[i] if i < len(run.decode_ms) else None,
             "pipelined_tok_s": batch * 1e3 / run.pipelined_ms[i] if i < len(run.pipelined_ms) else None,
             "prefill_s": at(run.prefill_s, i), "live_kv_bytes": run.live_kv_bytes,
             "peak_memory_bytes": run.peak_memory_bytes, "kernels": json.dumps(run.kernels, sort_keys=True)}
            for i in range(rounds)]
