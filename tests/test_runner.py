"""The runner on the real embedded model: shared prefill, reference decode, per-method metrics."""

from __future__ import annotations

import json
import math

import pytest

from kvcompress import datasets, load_dataset
from kvcompress.methods import method_config
from kvcompress.runner import RunContext, run_sample


def context_for(dataset: str, params: dict, steps: int, timeout: float | None = None) -> RunContext:
    return RunContext("smollm2-135m", "fp", dataset, json.dumps(params, sort_keys=True), steps, timeout)


def test_language_modelling_is_teacher_forced_on_the_dataset_continuation(embedded):
    model, tokenizer = embedded
    params = {"context_tokens": 256, "continuation_tokens": 8, "num_samples": 1, "seed": 3}
    sample = load_dataset("lm", tokenizer=tokenizer, **params)[0]
    methods = [method_config("full"), method_config("streaming", budget=64, n_sink=4)]
    full, stream = run_sample(model, tokenizer, sample, methods, context_for("lm", params, 32))
    continuation = datasets.reference_tokens(sample, tokenizer)
    assert len(full.steps) == len(continuation) - 1  # capped by the continuation, not decode_steps
    assert [s["ref_token"] for s in full.steps] == continuation[1:]
    assert all(s["kl"] == 0.0 for s in full.steps)
    nll = [s["nll"] for s in full.steps]
    assert full.run["score"] == pytest.approx(math.exp(-sum(nll) / len(nll)))
    assert full.run["prediction"] is None and full.run["context_tokens"] == 256
    assert stream.run["tokens_kept"] == 64
    assert stream.run["live_kv_bytes"] < 0.35 * stream.run["full_kv_bytes"]
    assert all(s["kl"] > 0 for s in stream.steps)
    assert full.run["run_id"] != stream.run["run_id"]


def test_a_run_past_its_timeout_is_recorded_and_the_shard_goes_on(embedded):
    model, tokenizer = embedded
    params = {"context_tokens": 256, "num_samples": 1, "seed": 0}
    sample = load_dataset("passkey", tokenizer=tokenizer, **params)[0]
    methods = [method_config("mlx-quant", bits=8), method_config("full")]
    slow, ok = run_sample(model, tokenizer, sample, methods, context_for("passkey", params, 2, timeout=1e-9))
    assert slow.run["status"] == "timeout" and "run_timeout_s" in slow.run["error"] and slow.steps == []
    assert ok.run["status"] == "timeout"  # recorded too: the shard went on to it
    generous = run_sample(model, tokenizer, sample, methods[:1], context_for("passkey", params, 2, timeout=600))
    assert generous[0].run["status"] == "ok" and len(generous[0].steps) == 2


def test_prefill_records_exactly_the_prompt_queries_for_methods_that_score_with_them(embedded):
    from kvcompress.runner import reference

    model, tokenizer = embedded
    params = {"context_tokens": 256, "num_samples": 1, "seed": 0}
    sample = load_dataset("passkey", tokenizer=tokenizer, **params)[0]
    ref = reference(model, tokenizer, sample, [method_config("keyformer", budget=64)], decode_steps=3)
    layer = ref.prefilled[0]
    assert layer.prompt_queries.shape == (1, 9, len(ref.prompt), 64)  # decode steps are not recorded
    assert layer.offset == len(ref.prompt)  # the reference decode did not leak into the prefill
    plain = reference(model, tokenizer, sample, [method_config("full")], decode_steps=3)
    assert not hasattr(plain.prefilled[0], "prompt_queries")


def test_budget_keeps_its_unit_one_token_is_not_the_whole_prompt(embedded):
    model, tokenizer = embedded
    params = {"context_tokens": 256, "continuation_tokens": 4, "num_samples": 1, "seed": 3}
    sample = load_dataset("lm", tokenizer=tokenizer, **params)[0]
    methods = [method_config("full"), method_config("knorm", budget=1), method_config("knorm", budget=1.0),
               method_config("pyramidkv", budget=0.5)]
    full, one, whole, pyramid = run_sample(model, tokenizer, sample, methods, context_for("lm", params, 2))
    assert (one.run["budget"], one.run["budget_tokens"]) == (1.0, 1.0)
    assert (whole.run["budget"], whole.run["budget_tokens"]) == (1.0, whole.run["prompt_tokens"])
    assert one.run["config_label"] == "knorm budget=1" and whole.run["config_label"] == "knorm budget=1.0"
    assert full.run["budget"] is None and full.run["budget_tokens"] is None
    assert pyramid.run["budget_tokens"] == round(0.5 * pyramid.run["prompt_tokens"])  # mean over layers
