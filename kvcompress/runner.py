"""Run one dataset sample through every method of a shard, sharing one full-cache prefill.

For one sample:
1. prefill the prompt once with full mlx-lm caches, in two parts: the context part (instruction and
   context) and the question part (question, generation prompt, answer prefix), keeping a copy of
   the context-only caches when a query-agnostic run needs them; record each layer's post-RoPE
   queries when a method scores with them (Keyformer);
2. decode the reference answer with the full cache until EOS or the task's answer budget (greedy
   for QA tasks, the dataset's own continuation for language modelling), capped by `decode_steps`
   when set (a warning says when the cap cuts an answer). These are the reference tokens
   y_0..y_n and the distributions that predicted them;
3. per protocol and method: derive the method's cache (compress after prefill, as Keyformer and
   KIVI do). `query_aware` compresses the whole prompt; `query_agnostic` compresses the context
   part only and then feeds the question part through the compressed cache, as NVIDIA kvpress
   and the RULER-4k leaderboard do: the question is appended without eviction by every method, so
   all hold the same tokens when the answer starts, and methods that evict while decoding begin
   with the first generated token. Decode teacher-forced on the reference tokens recording per
   step KL, top-1 agreement, NLL and resident bytes for every answer token y_0..y_n; then decode
   free-running from a copy of the same compressed cache for the task answer. Evidence survival
   (kvcompress/evidence.py) is recorded right after compression and after the reference answer.

A method that raises or produces non-finite logits is recorded with its status and error; the
others go on.

On a GPU, the first call of each kernel in a process compiles it (MLX's own JIT, and the fused
kernels' NVRTC compile and self-test), seconds where a warm call takes milliseconds: measured on
the H200 (8 Llama-8B-shaped layers, 4k prompt), the first full prefill 10.8 s against 0.033 s,
H2O's first compression 19.0 s and its first two decode steps 12.2 s and 10.1 s against 3-6 ms.
So a GPU process runs each piece of timed work once untimed first (`warm_up`): the reference on
its first sample, and each (method, protocol) on its first sample before its timed run. On CPU
nothing is repeated: the one kernel built at run time there (KIVI's attention, ~2 s of C++) is
built by the set-up, and a self-test costs milliseconds.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
import traceback
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Mapping

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import attention, datasets
from .adapter import native_cache
from .evidence import depth as evidence_depth
from .evidence import layer_rows as evidence_rows
from .memory import budget_tokens, live_kv_bytes, quantized_tokens, tokens_kept
from .methods.base import Method
from .metrics import step_metrics
from .reconstruct import ReconstructionPrompt, reconstruct, reconstruction_prompt
from .results import run_id
from .kernels import dispatch

PREFILL_CHUNK = 2048  # as mlx-lm's generate: bounds the attention matrix of a long prompt
WARM_UP_STEPS = 4  # decode steps of a method's untimed first pass (H2O compiles in its first two)
PROTOCOLS = ("query_aware", "query_agnostic")


@dataclass(frozen=True)
class RunContext:
    """What every run of a sweep shares, and what identifies a run besides its method and sample."""

    model: str
    model_fingerprint: str
    dataset: str
    dataset_params: Mapping[str, Any]  # the dataset's loader parameters (context_tokens, ...)
    decode_steps: int | None = None  # cap on the reference answer (None: EOS or the task's budget)
    run_timeout_s: float | None = None  # per method run; does not change results, so not in run ids

    def __post_init__(self):
        if not isinstance(self.dataset_params, Mapping):  # JSON belongs to the Prefect edge, not here
            raise TypeError(f"RunContext.dataset_params: expected a mapping, got {type(self.dataset_params).__name__}")


class RunTimeout(Exception):
    """A method run exceeded `RunContext.run_timeout_s` (checked between decode steps)."""


@dataclass
class RunRecord:
    run: dict[str, Any]  # a row of the `runs` table (without sweep_id / method partition keys)
    steps: list[dict[str, Any]]
    method: str
    evidence: list[dict[str, Any]] = field(default_factory=list)  # rows of the `evidence` table


def sample_fingerprint(sample: dict) -> str:
    """Hash of the sample's text and answers: a changed essay or local file changes the run id."""
    text = json.dumps([sample["context"], sample["question"], list(sample["answers"])])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_config(context: RunContext, sample: dict, method: Method, protocol: str = "query_aware") -> dict[str, Any]:
    """The full configuration of one run: what its id hashes and its `config` column holds."""
    config = {
        "model": context.model,
        "model_fingerprint": context.model_fingerprint,
        "dataset": context.dataset,
        "dataset_params": dict(context.dataset_params),
        "sample_id": sample["id"],
        "sample_fingerprint": sample_fingerprint(sample),
        "method": method_identity(method),
        "decode_steps": context.decode_steps,
        "protocol": protocol,
    }
    config.update(method.revisions())  # see Method.revision
    if protocol == "query_agnostic" and method.evicts_while_decoding:
        # 1: the question part is appended without eviction, as for every other method (such methods
        # evicted through it down to the context's budget), so their old query-agnostic runs recompute
        config["protocol_revision"] = 1
    return config


def method_identity(method: Method) -> dict[str, Any]:
    """The method's part of a run id: its full configuration, less `layers` at its default. Runs
    from before the field (which compressed every layer of models whose layers are all global
    attention, as "global" does) keep their ids."""
    config = method.to_dict()
    if config["layers"] == "global":
        del config["layers"]
    return config


class RecordingKVCache(KVCache):
    """A full KVCache that keeps the post-RoPE queries of the prompt (for `from_prefill`)."""

    def __init__(self):
        super().__init__()
        self.chunks: list[mx.array] = []  # [B, H_q, chunk, D] per prefill chunk
        self.prompt_queries: mx.array | None = None  # [B, H_q, T, D] once the prompt is done

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        if self.prompt_queries is None:  # decode steps after the prompt are not recorded
            self.chunks.append(queries)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def finish_prompt(self) -> None:
        self.prompt_queries = mx.concatenate(self.chunks, axis=2)
        self.chunks = []

    def reopen(self) -> None:
        """Record again: the prompt continues (another question after a shared context)."""
        self.chunks, self.prompt_queries = [self.prompt_queries], None


def prefill(model, prompt: list[int], record_queries: bool) -> tuple[list, mx.array, float]:
    """Full-attention prefill in chunks: (caches, last-position logits [V], seconds)."""
    return prefill_parts(model, prompt, record_queries)[:3]


def prefill_parts(model, prompt: list[int], record_queries: bool, split: int | None = None):
    """Full-attention prefill in chunks that break at `split`.

    Returns (caches, last-position logits [V], seconds, context): `context` is, when `split` is
    given, each layer's (keys, values) after the first `split` tokens and the logits [V] at
    position split - 1 (None when split is 0), else None.
    """
    attention.install()
    caches = prefill_caches(model, record_queries)
    tokens = mx.array(prompt)[None]
    bounds = sorted({0, len(prompt), *range(0, len(prompt), PREFILL_CHUNK), *([split] if split else [])})
    context, logits = None, None
    start = time.perf_counter()
    for begin, end in zip(bounds, bounds[1:]):
        logits = model(tokens[:, begin:end], cache=caches)
        mx.eval(logits, [c.state for c in caches])
        if end == split:
            context = ([snapshot(c) for c in caches], logits[0, -1])
            mx.eval(context)
    if split == 0:
        context = ([None] * len(caches), None)
    for cache in caches:
        if isinstance(cache, RecordingKVCache):
            cache.finish_prompt()
    release_buffers()
    return caches, logits[0, -1], time.perf_counter() - start, context


def prefill_caches(model, record_queries: bool) -> list:
    """The model's own prompt cache (kvcompress/adapter.py), with a `RecordingKVCache` on every
    global-attention layer when the prompt's queries are needed."""
    caches = native_cache(model)
    if record_queries:
        caches = [RecordingKVCache() if type(c) is KVCache else c for c in caches]
    return caches


def snapshot(cache):
    """What one prefilled layer holds, to compress or restore from: a global layer's (keys, values)
    [B, H_kv, T, D], else (a sliding window, a recurrent state) a copy of the model's own cache."""
    if isinstance(cache, KVCache):
        return cache.keys_and_values()
    return copy.deepcopy(cache)


def restore(caches: list, snapshots: list) -> None:
    """Put every layer back to its snapshot (in place: the list is the shared reference prefill)."""
    for i, held in enumerate(snapshots):
        if isinstance(held, tuple):
            keys, values = held
            caches[i].state = (keys, values, keys.shape[2])
        else:
            caches[i] = copy.deepcopy(held)


def release_buffers() -> None:
    """Drop MLX's cached buffers after a prompt's transients (as mlx_lm.generate after prefill chunks).
    On CUDA a long prefill can leave the allocator releasing its cache, with synchronizing frees, on
    every allocation that misses it, so every decode step after it pays them (H200, KIVI-2 at 128k
    tokens: 21 ms a step, 16 after one clear; docs/learned.md)."""
    mx.clear_cache()


def derive_cache(model, method: Method, prefilled: list, tokens: list[int] | None = None,
                 reconstruction: ReconstructionPrompt | None = None) -> list:
    """Build `method`'s cache and compress a finished full prefill (caches holding the prompt) into it."""
    queries = [getattr(c, "prompt_queries", None) for c in prefilled] if method.needs_queries else None
    return compress_kv(model, method, [snapshot(c) for c in prefilled], queries, tokens, reconstruction)


def compress_kv(model, method: Method, kv: list, queries: list | None, tokens: list[int] | None = None,
                reconstruction: ReconstructionPrompt | None = None) -> list:
    """Build `method`'s cache and compress finished full-attention keys/values into it.

    kv: per layer a `snapshot` ((keys, values) [B, H_kv, T, D] of a global layer, or a copy of the
    model's own cache of another kind, which the method keeps as it is) or None (nothing yet);
    queries: per layer [B, H_q, T, D] or None. A method that reconstructs (KVzip) also needs the
    held prompt's `tokens` and the tokenizer's `reconstruction` request: its pass runs here, so the
    runner's prefill_s counts it.
    """
    if method.reconstructs and (tokens is None or reconstruction is None):
        raise ValueError(f"{method.name} reconstructs the prompt: pass its tokens and reconstruction prompt")
    caches = method.make_cache(model)
    for i, (cache, held) in enumerate(zip(caches, kv)):
        if held is None:  # nothing to compress (an empty context part)
            continue
        if not isinstance(held, tuple):  # a layer the method leaves to the model's own cache
            caches[i] = copy.deepcopy(held)
            continue
        keys, values = held
        if hasattr(cache, "from_prefill"):
            cache.from_prefill(keys, values, queries[i] if method.needs_queries else None)
        else:  # an mlx-lm cache: the keys and values go in as one update
            cache.update_and_fetch(keys, values)
    if method.reconstructs and any(held is not None for held in kv):
        reconstruct(model, caches, tokens, reconstruction)
    mx.eval([c.state for c in caches if not c.empty()])
    release_buffers()  # the compression's transients (scores, gathers) before the method decodes
    return caches


def decode_step(model, token: int, caches: list) -> mx.array:
    logits = model(mx.array([[token]]), cache=caches)[0, -1]
    mx.eval(logits)
    return logits


def feed(model, tokens: list[int], caches: list) -> mx.array:
    """Feed several tokens through `caches` in one call: the logits [V] after the last one."""
    logits = model(mx.array(tokens)[None], cache=caches)[0, -1]
    mx.eval(logits)
    return logits


def reference_decode(model, caches: list, first_logits: mx.array, continuation: list[int] | None,
                     budget: int, eos: set[int]):
    """Full-cache decode of the reference answer: tokens y_0..y_n and the distributions that
    predicted them. QA: greedy until EOS (kept as y_n) or `budget` tokens; language modelling: the
    dataset's continuation, `budget` tokens of it."""
    logits_seq, tokens = [first_logits], []
    while True:
        token = continuation[len(tokens)] if continuation is not None else int(mx.argmax(logits_seq[-1]).item())
        tokens.append(token)
        if len(tokens) >= budget or (continuation is None and token in eos):
            return tokens, logits_seq
        logits_seq.append(decode_step(model, token, caches))


def check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise RunTimeout("run exceeded run_timeout_s")


def free_running(model, caches: list, first_token: int, max_tokens: int, eos: set[int],
                 deadline: float | None = None) -> list[int]:
    """Greedy answer tokens starting from `first_token` (the argmax after the prompt)."""
    tokens = [first_token]
    while len(tokens) < max_tokens and tokens[-1] not in eos:
        check_deadline(deadline)
        tokens.append(int(mx.argmax(decode_step(model, tokens[-1], caches)).item()))
    return [t for t in tokens if t not in eos]


@dataclass
class Reference:
    """What every method of a sample shares: the prompt, its full prefill and the reference decode."""

    prompt: list[int]
    question_start: int  # prompt[:question_start] is the context part, the rest the question part
    evidence: list[tuple[int, int]]  # token spans of the sample's evidence in the prompt
    continuation: list[int] | None  # the dataset's own next tokens (language modelling), else None
    prefilled: list  # full caches holding exactly the prompt (and its queries when recorded)
    context_kv: list | None  # per layer (keys, values) of the context part alone, when kept
    context_logits: mx.array | None  # full-cache logits at the last context position
    prefill_s: float
    tokens: list[int]  # y_0 .. y_n, the reference answer
    logits: list[mx.array]  # the full cache's distributions that predicted them
    full_kv_bytes: int  # the full cache after the reference answer
    budget: int  # the task's answer budget
    cut: bool  # decode_steps stopped the reference before EOS and the budget
    # the tokenizer's "repeat the context" request, where a method reconstructs the prompt (KVzip)
    reconstruction: ReconstructionPrompt | None = None

    @property
    def steps(self) -> int:
        return len(self.tokens)


@dataclass
class SharedContext:
    """A context part prefilled once for several questions about it."""

    tokens: list[int]  # prompt[:question_start], the same for every question
    caches: list  # full caches holding exactly the context part (copied for each question)
    kv: list  # per layer (keys, values) of the context part
    logits: mx.array  # at the last context position
    prefill_s: float


def share_context(model, tokenizer, sample: dict, methods: list[Method]) -> SharedContext:
    """Prefill the context part of `sample` (and of every question about the same context)."""
    prompt = datasets.sample_prompt(sample, tokenizer)
    head = prompt.tokens[:prompt.question_start]
    caches, logits, seconds, (kv, _) = prefill_parts(model, head, any(m.needs_queries for m in methods), len(head))
    return SharedContext(head, caches, kv, logits, seconds)


def continue_prefill(model, shared: SharedContext, prompt: list[int]) -> tuple[list, mx.array, float]:
    """A copy of the shared context's caches with the rest of `prompt` fed: (caches, logits, seconds)."""
    if prompt[:len(shared.tokens)] != shared.tokens:
        raise ValueError("samples of one shard must share their context part")
    caches = copy.deepcopy(shared.caches)
    recording = [c for c in caches if isinstance(c, RecordingKVCache)]
    for cache in recording:
        cache.reopen()
    start = time.perf_counter()
    logits = shared.logits
    for begin in range(len(shared.tokens), len(prompt), PREFILL_CHUNK):
        logits = model(mx.array(prompt[begin:begin + PREFILL_CHUNK])[None], cache=caches)[0, -1]
        mx.eval(logits, [c.state for c in caches])
    for cache in recording:
        cache.finish_prompt()
    release_buffers()
    return caches, logits, shared.prefill_s + time.perf_counter() - start


def reference(model, tokenizer, sample: dict, methods: list[Method], decode_steps: int | None,
              protocols: tuple[str, ...] = ("query_aware",), shared: SharedContext | None = None) -> Reference:
    """The sample's full prefill and reference answer; from a copy of `shared` when given."""
    prompt = datasets.sample_prompt(sample, tokenizer)
    continuation = datasets.reference_tokens(sample, tokenizer)
    budget = len(continuation) if continuation is not None else datasets.max_answer_tokens(sample)
    cap = budget if decode_steps is None else min(budget, decode_steps)
    agnostic = "query_agnostic" in protocols
    if shared is None:
        caches, first_logits, prefill_s, context = prefill_parts(
            model, prompt.tokens, any(m.needs_queries for m in methods), prompt.question_start if agnostic else None)
    else:
        caches, first_logits, prefill_s = continue_prefill(model, shared, prompt.tokens)
        context = (shared.kv, shared.logits) if agnostic else None
    prompt_kv = [snapshot(c) for c in caches]
    eos = set(tokenizer.eos_token_ids)
    tokens, logits = reference_decode(model, caches, first_logits, continuation, cap, eos)
    cut = cap < budget and len(tokens) == cap and (continuation is not None or tokens[-1] not in eos)
    if cut:
        warnings.warn(f"decode_steps={decode_steps} cut the reference answer of sample {sample['id']!r} "
                      f"after {cap} of up to {budget} tokens, before EOS: per-step metrics do not cover the "
                      f"whole answer (runs.reference_cut)", stacklevel=2)
    full_bytes = live_kv_bytes(caches)
    restore(caches, prompt_kv)  # back to the prompt alone
    context_kv, context_logits = context if context is not None else (None, None)
    reconstruction = reconstruction_prompt(tokenizer) if any(m.reconstructs for m in methods) else None
    return Reference(prompt.tokens, prompt.question_start, prompt.evidence, continuation, caches, context_kv,
                     context_logits, prefill_s, tokens, logits, full_bytes, budget, cut, reconstruction)


def run_sample(
    model,
    tokenizer,
    sample: dict | list[dict],
    methods: list[Method],
    context: RunContext,
    on_record: Callable[[RunRecord], None] | None = None,
    protocols: tuple[str, ...] = ("query_aware",),
    pending: Callable[[dict[str, Any]], bool] | None = None,
) -> list[RunRecord]:
    """Run every method under every protocol on one sample, or on several questions about one
    context (a list of samples sharing their context part: one context prefill, and under
    query_agnostic one compression per method, each question answered from its own copy).

    Each run's configuration (`run_config`) is built once; only runs whose configuration
    `pending(config)` accepts run, when given (a resumed sweep skips finished run ids); `on_record`
    sees each record as soon as it exists. Records come sample by sample, protocol by protocol,
    methods in order.
    """
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown or not protocols:
        raise ValueError(f"protocols: expected a non-empty list of {list(PROTOCOLS)}, got {list(protocols)!r}")
    samples = sample if isinstance(sample, list) else [sample]
    todo = {}  # sample index -> its pending (protocol, method, run config)
    for i, one in enumerate(samples):
        cells = [(p, m, run_config(context, one, m, p)) for p in protocols for m in methods]
        todo[i] = [cell for cell in cells if pending is None or pending(cell[2])]
    if not any(todo.values()):
        return []
    if warm_up_needed() and "reference" not in _warmed:  # before the first timed prefill of this process
        reference(model, tokenizer, samples[0], methods, context.decode_steps, tuple(protocols))
        _warmed.add("reference")
    shared = share_context(model, tokenizer, samples[0], methods) if len(samples) > 1 else None
    compressed: dict[Method, list] = {}  # query_agnostic: method -> its compressed context, made once
    records = []
    for i, one in enumerate(samples):
        if not todo[i]:
            continue
        ref = reference(model, tokenizer, one, methods, context.decode_steps, tuple(protocols), shared)
        for protocol, method, config in todo[i]:
            base = None
            if protocol == "query_agnostic" and shared is not None:
                as_run = method.for_run(ref.budget, ref.steps)  # Keyformer's tau schedule depends on them
                if as_run not in compressed:
                    compressed[as_run] = compress_context(model, as_run, ref)
                base = compressed[as_run]
            if warm_up_needed() and (method.label(), protocol) not in _warmed:
                warm_up(model, method, ref, protocol, base)
                _warmed.add((method.label(), protocol))
            record = run_method(model, tokenizer, one, method, context, ref, protocol, base, config)
            records.append(record)
            if on_record is not None:
                on_record(record)
    return records


_warmed: set = set()  # "reference" and (method label, protocol) pairs this process has run untimed


def warm_up_needed() -> bool:
    """Whether timed work needs an untimed first pass: on a GPU (see the module docstring)."""
    return dispatch.gpu_backend() is not None


def warm_up(model, method: Method, ref: Reference, protocol: str, base: list | None = None) -> None:
    """`method`'s compression of `ref` and its first decode steps, untimed and thrown away: every
    kernel a timed run of it calls has been compiled (and self-tested) afterwards. `ref` and `base`
    are left as they were (compression copies them)."""
    caches, _ = compress(model, method.for_run(ref.budget, ref.steps), ref, protocol, base)
    for token in ref.tokens[:WARM_UP_STEPS]:
        decode_step(model, token, caches)
    mx.synchronize()


def compress_context(model, method: Method, ref: Reference) -> list:
    """The method's cache holding the compressed context part only (query_agnostic)."""
    T = ref.question_start
    queries = None
    if method.needs_queries:
        queries = [None if q is None else q[:, :, :T] for q in (getattr(c, "prompt_queries", None) for c in ref.prefilled)]
    return compress_kv(model, method, ref.context_kv, queries, ref.prompt[:T], ref.reconstruction)


def compress(model, method: Method, ref: Reference, protocol: str, base: list | None = None) -> tuple[list, mx.array]:
    """The method's cache after the whole prompt, and its logits [V] predicting y_0.

    query_aware: the whole prompt's keys/values are compressed (the full prefill's logits predict
    y_0). query_agnostic: only the context part is compressed (or `base`, a compressed context
    shared by several questions, is copied), then the question part is fed through the compressed
    cache, whose last logits predict y_0.
    """
    layers = ref.prefilled
    if protocol == "query_aware":
        return derive_cache(model, method, layers, ref.prompt, ref.reconstruction), ref.logits[0]
    caches = copy.deepcopy(base) if base is not None else compress_context(model, method, ref)
    question = ref.prompt[ref.question_start:]
    return caches, feed(model, question, caches) if question else ref.context_logits


def run_method(model, tokenizer, sample: dict, method: Method, context: RunContext, ref: Reference,
               protocol: str = "query_aware", base: list | None = None,
               config: dict[str, Any] | None = None) -> RunRecord:
    """One method on one sample under one protocol: compress, decode teacher-forced, then free-running.
    `config`: the run's `run_config`, when the caller has built it already."""
    config = config if config is not None else run_config(context, sample, method, protocol)
    row: dict[str, Any] = {
        "run_id": run_id(config),
        "model": context.model,
        "dataset": context.dataset,
        "task": sample["task"],
        "sample_id": sample["id"],
        "protocol": protocol,
        "context_tokens": context.dataset_params.get("context_tokens", len(ref.prompt)),
        "prompt_tokens": len(ref.prompt),
        **method.grid_columns(),
        "status": "ok",
        "error": None,
        "full_kv_bytes": ref.full_kv_bytes,
        "decode_steps": ref.steps,
        "reference_cut": ref.cut,
        "evidence_depth": evidence_depth(ref.evidence, ref.question_start),
        # reports group by config_label: the protocol is part of a config's identity
        "config_label": method.label() + ("" if protocol == "query_aware" else f" protocol={protocol}"),
        "config": json.dumps(config, sort_keys=True),
        "created_at": datetime.now(timezone.utc),
    }
    step_rows: list[dict[str, Any]] = []
    evidence_records: list[dict[str, Any]] = []
    deadline = time.monotonic() + context.run_timeout_s if context.run_timeout_s else None
    dispatch.reset_paths()
    try:
        mx.synchronize()
        baseline = mx.get_active_memory()  # weights, the shared full caches and reference logits
        mx.reset_peak_memory()
        start = time.perf_counter()
        # Keyformer anneals tau over the answer budget (not part of the run id)
        caches, first_logits = compress(model, method.for_run(ref.budget, ref.steps), ref, protocol, base)
        row["prefill_s"] = ref.prefill_s + time.perf_counter() - start
        row["budget_tokens"] = budget_tokens(caches)
        row["quantized_tokens"] = quantized_tokens(caches)
        if row["quantized_tokens"] == 0 and getattr(method, "quantize", None) is not None:
            warnings.warn(f"{row['config_label']} on sample {sample['id']!r}: the quantizer holds none of the "
                          f"{tokens_kept(caches)} tokens per layer kept after the prompt as codes (all inside its "
                          f"full-precision window), so this run is the eviction's alone in more bytes "
                          f"(runs.quantized_tokens = 0)", stacklevel=2)
        full_kv = [snapshot(c) for c in ref.prefilled]
        evidence = evidence_rows(caches, full_kv, ref.evidence, "compressed")
        # the free-running answer starts from the same compressed prompt: copy it, do not re-derive
        answer_caches = copy.deepcopy(caches) if ref.continuation is None else None
        # step s: the logits that predict reference token y_s (s = 0 comes from the prompt itself)
        logits, step_ms = first_logits, 0.0
        for s in range(ref.steps):
            check_deadline(deadline)
            if s > 0:
                t0 = time.perf_counter()
                logits = decode_step(model, ref.tokens[s - 1], caches)
                step_ms = 1000 * (time.perf_counter() - t0)
            metrics = step_metrics(ref.logits[s], logits, ref.tokens[s])
            if not all(math.isfinite(metrics[k]) for k in ("kl", "logit_cosine", "nll")):
                row["status"], row["error"] = "nonfinite", f"non-finite logits at decode step {s}"
                break
            step_rows.append({
                "run_id": row["run_id"], "step": s, "position": len(ref.prompt) + s - 1,
                "ref_token": ref.tokens[s], "token": metrics["token"], "full_token": metrics["ref_argmax"],
                "top1_agree": metrics["token"] == metrics["ref_argmax"], "top1_text": metrics["token"] == ref.tokens[s],
                "kl": metrics["kl"], "logit_cosine": metrics["logit_cosine"], "nll": metrics["nll"],
                "tokens_kept": tokens_kept(caches), "live_kv_bytes": live_kv_bytes(caches), "step_ms": step_ms,
            })
        final = evidence_rows(caches, full_kv, ref.evidence, "final")
        evidence += final
        row["evidence_kept"] = sum(r["kept_mean"] for r in final) / len(final) if final else None
        timed = [r["step_ms"] for r in step_rows[1:]]
        row["decode_tok_s"] = len(timed) / (sum(timed) / 1000) if timed and sum(timed) else None
        row["live_kv_bytes"] = live_kv_bytes(caches)
        row["tokens_kept"] = tokens_kept(caches)
        row["peak_memory_bytes"] = mx.get_peak_memory()
        if ref.continuation is not None:  # language modelling: geometric-mean token probability
            row["score"] = math.exp(-sum(r["nll"] for r in step_rows) / len(step_rows)) if step_rows else None
            row["prediction"] = None
        else:
            eos = set(tokenizer.eos_token_ids)
            answer = free_running(model, answer_caches, int(mx.argmax(first_logits).item()), ref.budget, eos,
                                  deadline)
            row["prediction"] = tokenizer.decode(answer)
            row["score"] = datasets.score(sample, row["prediction"])
        mx.synchronize()
        row["method_peak_bytes"] = max(mx.get_peak_memory() - baseline, 0)
        evidence_records = [{"run_id": row["run_id"], **r} for r in evidence]
    except RunTimeout as exc:
        row["status"], row["error"] = "timeout", f"{exc} ({context.run_timeout_s} s)"
    except Exception as exc:  # recorded, and the shard goes on with the next method
        row["status"] = "error"
        row["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
    # which path each kernel took (fused / reference), outside the hashed part: the same run on a
    # GPU and on a CPU keeps one run id
    config["kernels"] = dispatch.paths_used()
    row["config"] = json.dumps(config, sort_keys=True)
    return RunRecord(row, step_rows, method.name, evidence_records)
