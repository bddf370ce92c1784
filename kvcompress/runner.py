"""Run one dataset sample through every method of a shard, sharing one full-cache prefill.

For one sample:
1. prefill the prompt once with full mlx-lm caches, recording each layer's post-RoPE queries when
   a method scores with them (Keyformer);
2. decode `decode_steps` tokens with the full cache: greedy for QA tasks, the dataset's own
   continuation for language modelling. These are the reference tokens and distributions;
3. per method: derive its cache from the prefill (compress after prefill, as Keyformer and KIVI
   do), decode teacher-forced on the reference tokens recording per-step KL, top-1 agreement, NLL
   and resident bytes; then derive again and decode free-running for the task answer.

A method that raises or produces non-finite logits is recorded with its status and error; the
others go on.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import attention, datasets
from .memory import budget_tokens, live_kv_bytes, tokens_kept
from .methods.base import Method
from .metrics import step_metrics
from .results import run_id
from .kernels import dispatch

PREFILL_CHUNK = 2048  # as mlx-lm's generate: bounds the attention matrix of a long prompt


@dataclass(frozen=True)
class RunContext:
    """What every run of a sweep shares, and what identifies a run besides its method and sample."""

    model: str
    model_fingerprint: str
    dataset: str
    dataset_params: str  # canonical JSON
    decode_steps: int = 32
    run_timeout_s: float | None = None  # per method run; does not change results, so not in run ids


class RunTimeout(Exception):
    """A method run exceeded `RunContext.run_timeout_s` (checked between decode steps)."""


@dataclass
class RunRecord:
    run: dict[str, Any]  # a row of the `runs` table (without sweep_id / method partition keys)
    steps: list[dict[str, Any]]
    method: str


def sample_fingerprint(sample: dict) -> str:
    """Hash of the sample's text and answers: a changed essay or local file changes the run id."""
    text = json.dumps([sample["context"], sample["question"], list(sample["answers"])])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_config(context: RunContext, sample: dict, method: Method) -> dict[str, Any]:
    """The full configuration of one run: what its id hashes and its `config` column holds."""
    return {
        "model": context.model,
        "model_fingerprint": context.model_fingerprint,
        "dataset": context.dataset,
        "dataset_params": json.loads(context.dataset_params),
        "sample_id": sample["id"],
        "sample_fingerprint": sample_fingerprint(sample),
        "method": json.loads(method.to_json()),
        "decode_steps": context.decode_steps,
    }


class RecordingKVCache(KVCache):
    """A full KVCache that keeps the post-RoPE queries of the prompt (for `from_prefill`)."""

    def __init__(self):
        super().__init__()
        self.chunks: list[mx.array] = []  # [B, H_q, chunk, D] per prefill chunk
        self.prompt_queries: mx.array | None = None  # [B, H_q, T, D] once the prompt is done

    def attention(self, queries, keys, values, scale, mask):
        if self.prompt_queries is None:  # decode steps after the prompt are not recorded
            self.chunks.append(queries)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    def finish_prompt(self) -> None:
        self.prompt_queries = mx.concatenate(self.chunks, axis=2)
        self.chunks = []


def prefill(model, prompt: list[int], record_queries: bool) -> tuple[list, mx.array, float]:
    """Full-attention prefill in chunks: (caches, last-position logits [V], seconds)."""
    attention.install()
    caches = [RecordingKVCache() if record_queries else KVCache() for _ in model.layers]
    tokens = mx.array(prompt)[None]
    start = time.perf_counter()
    for begin in range(0, len(prompt), PREFILL_CHUNK):
        logits = model(tokens[:, begin : begin + PREFILL_CHUNK], cache=caches)
        mx.eval(logits, [c.state for c in caches])
    if record_queries:
        for cache in caches:
            cache.finish_prompt()
    return caches, logits[0, -1], time.perf_counter() - start


def derive_cache(model, method: Method, prefilled: list) -> list:
    """Build `method`'s cache and compress the finished prefill into it."""
    caches = method.make_cache(model)
    for cache, full in zip(caches, prefilled):
        keys, values = full.keys_and_values()  # [B, H_kv, T, D]
        queries = full.prompt_queries if method.needs_queries else None
        if hasattr(cache, "from_prefill"):
            cache.from_prefill(keys, values, queries)
        else:  # an mlx-lm cache: the prompt's keys and values go in as one update
            cache.update_and_fetch(keys, values)
    mx.eval([c.state for c in caches])
    return caches


def decode_step(model, token: int, caches: list) -> mx.array:
    logits = model(mx.array([[token]]), cache=caches)[0, -1]
    mx.eval(logits)
    return logits


def reference_decode(model, caches: list, first_logits: mx.array, continuation: list[int] | None, steps: int):
    """Full-cache decode: reference tokens y_0..y_steps and the distributions that predicted them."""
    logits_seq, tokens = [first_logits], []
    for s in range(steps + 1):
        token = continuation[s] if continuation is not None else int(mx.argmax(logits_seq[-1]).item())
        tokens.append(token)
        if s < steps:
            logits_seq.append(decode_step(model, token, caches))
    return tokens, logits_seq


def check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise RunTimeout("run exceeded run_timeout_s")


def free_running(model, caches: list, first_token: int, max_tokens: int, eos: set[int],
                 deadline: float | None = None) -> list[int]:
    """Greedy answer tokens starting from the prefill's own argmax."""
    tokens = [first_token]
    while len(tokens) < max_tokens and tokens[-1] not in eos:
        check_deadline(deadline)
        tokens.append(int(mx.argmax(decode_step(model, tokens[-1], caches)).item()))
    return [t for t in tokens if t not in eos]


@dataclass
class Reference:
    """What every method of a sample shares: the prompt, its full prefill and the reference decode."""

    prompt: list[int]
    continuation: list[int] | None  # the dataset's own next tokens (language modelling), else None
    prefilled: list  # full caches holding exactly the prompt (and its queries when recorded)
    prefill_s: float
    tokens: list[int]  # y_0 .. y_steps
    logits: list[mx.array]  # the full cache's distributions that predicted them
    full_kv_bytes: int  # the full cache after `steps` decode steps
    steps: int


def reference(model, tokenizer, sample: dict, methods: list[Method], decode_steps: int) -> Reference:
    prompt = datasets.prompt_tokens(sample, tokenizer)
    continuation = datasets.reference_tokens(sample, tokenizer)
    steps = decode_steps if continuation is None else min(decode_steps, len(continuation) - 1)
    caches, first_logits, prefill_s = prefill(model, prompt, any(m.needs_queries for m in methods))
    prompt_kv = [c.keys_and_values() for c in caches]
    tokens, logits = reference_decode(model, caches, first_logits, continuation, steps)
    full_bytes = live_kv_bytes(caches)
    for cache, (keys, values) in zip(caches, prompt_kv):  # back to the prompt alone
        cache.state = (keys, values, keys.shape[2])
    return Reference(prompt, continuation, caches, prefill_s, tokens, logits, full_bytes, steps)


def run_sample(
    model,
    tokenizer,
    sample: dict,
    methods: list[Method],
    context: RunContext,
    on_record: Callable[[RunRecord], None] | None = None,
) -> list[RunRecord]:
    """Run every method on one sample; `on_record` sees each record as soon as it exists."""
    ref = reference(model, tokenizer, sample, methods, context.decode_steps)
    records = []
    for method in methods:
        record = run_method(model, tokenizer, sample, method, context, ref)
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records


def run_method(model, tokenizer, sample: dict, method: Method, context: RunContext, ref: Reference) -> RunRecord:
    """One method on one sample: derive its cache, decode teacher-forced, then free-running."""
    config = run_config(context, sample, method)
    row: dict[str, Any] = {
        "run_id": run_id(config),
        "model": context.model,
        "dataset": context.dataset,
        "task": sample["task"],
        "sample_id": sample["id"],
        "context_tokens": json.loads(context.dataset_params).get("context_tokens", len(ref.prompt)),
        "prompt_tokens": len(ref.prompt),
        **method.grid_columns(),
        "status": "ok",
        "error": None,
        "full_kv_bytes": ref.full_kv_bytes,
        "decode_steps": ref.steps,
        "config_label": method.label(),
        "config": json.dumps(config, sort_keys=True),
        "created_at": datetime.now(timezone.utc),
    }
    step_rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + context.run_timeout_s if context.run_timeout_s else None
    dispatch.reset_paths()
    try:
        mx.reset_peak_memory()
        start = time.perf_counter()
        caches = derive_cache(model, method.for_run(ref.steps), ref.prefilled)
        row["prefill_s"] = ref.prefill_s + time.perf_counter() - start
        row["budget_tokens"] = budget_tokens(caches)
        # the free-running answer starts from the same compressed prompt: copy it, do not re-derive
        answer_caches = copy.deepcopy(caches) if ref.continuation is None else None
        for s in range(ref.steps):
            check_deadline(deadline)
            t0 = time.perf_counter()
            logits = decode_step(model, ref.tokens[s], caches)
            step_ms = 1000 * (time.perf_counter() - t0)
            metrics = step_metrics(ref.logits[s + 1], logits, ref.tokens[s + 1])
            if not all(math.isfinite(metrics[k]) for k in ("kl", "logit_cosine", "nll")):
                row["status"], row["error"] = "nonfinite", f"non-finite logits at decode step {s}"
                break
            step_rows.append({
                "run_id": row["run_id"], "step": s, "position": len(ref.prompt) + s,
                "ref_token": ref.tokens[s + 1], "token": metrics["token"],
                "top1_agree": metrics["token"] == ref.tokens[s + 1], "kl": metrics["kl"],
                "logit_cosine": metrics["logit_cosine"], "nll": metrics["nll"],
                "tokens_kept": tokens_kept(caches), "live_kv_bytes": live_kv_bytes(caches), "step_ms": step_ms,
            })
        decode_s = sum(r["step_ms"] for r in step_rows) / 1000
        row["decode_tok_s"] = len(step_rows) / decode_s if decode_s else None
        row["live_kv_bytes"] = live_kv_bytes(caches)
        row["tokens_kept"] = tokens_kept(caches)
        row["peak_memory_bytes"] = mx.get_peak_memory()
        if ref.continuation is not None:  # language modelling: geometric-mean token probability
            row["score"] = math.exp(-sum(r["nll"] for r in step_rows) / len(step_rows)) if step_rows else None
            row["prediction"] = None
        else:
            eos = set(tokenizer.eos_token_ids)
            answer = free_running(model, answer_caches, ref.tokens[0],
                                  datasets.max_answer_tokens(sample), eos, deadline)
            row["prediction"] = tokenizer.decode(answer)
            row["score"] = datasets.score(sample, row["prediction"])
    except RunTimeout as exc:
        row["status"], row["error"] = "timeout", f"{exc} ({context.run_timeout_s} s)"
    except Exception as exc:  # recorded, and the shard goes on with the next method
        row["status"] = "error"
        row["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
    # which path each kernel took (fused / reference), outside the hashed part: the same run on a
    # GPU and on a CPU keeps one run id
    config["kernels"] = dispatch.paths_used()
    row["config"] = json.dumps(config, sort_keys=True)
    return RunRecord(row, step_rows, method.name)
