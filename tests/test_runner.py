"""The runner on the real embedded model: shared prefill, reference decode, per-method metrics."""

from __future__ import annotations

import math

import pytest

from kvcompress import datasets, load_dataset
from kvcompress.methods import method_config
from kvcompress.runner import RunContext, decode_step, run_sample


def context_for(dataset: str, params: dict, steps: int, timeout: float | None = None) -> RunContext:
    return RunContext("smollm2-135m", "fp", dataset, params, steps, timeout)


def test_language_modelling_is_teacher_forced_on_the_dataset_continuation(embedded):
    model, tokenizer = embedded
    params = {"context_tokens": 256, "continuation_tokens": 8, "num_samples": 1, "seed": 3}
    sample = load_dataset("lm", tokenizer=tokenizer, **params)[0]
    methods = [method_config("full"), method_config("streaming", budget=64, n_sink=4)]
    full, stream = run_sample(model, tokenizer, sample, methods, context_for("lm", params, 32))
    continuation = datasets.reference_tokens(sample, tokenizer)
    assert len(full.steps) == len(continuation)  # every continuation token, y_0 included
    assert [s["ref_token"] for s in full.steps] == continuation
    assert all(s["kl"] == 0.0 for s in full.steps)
    nll = [s["nll"] for s in full.steps]
    assert full.run["score"] == pytest.approx(math.exp(-sum(nll) / len(nll)))
    assert full.run["prediction"] is None and full.run["context_tokens"] == 256
    assert stream.run["tokens_kept"] == 64
    assert stream.run["live_kv_bytes"] < 0.35 * stream.run["full_kv_bytes"]
    assert stream.steps[0]["kl"] == 0.0  # query-aware: y_0 comes from the full prefill
    assert all(s["kl"] > 0 for s in stream.steps[1:])
    # lm: agreement with the full cache and accuracy against the text are separate columns
    assert all(s["top1_agree"] for s in full.steps)
    assert [s["top1_text"] for s in full.steps] == [s["full_token"] == s["ref_token"] for s in full.steps]
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
    ref = reference(model, tokenizer, sample, [method_config("keyformer", budget=64)], decode_steps=3,
                    protocols=("query_aware", "query_agnostic"))
    layer = ref.prefilled[0]
    assert layer.prompt_queries.shape == (1, 9, len(ref.prompt), 64)  # decode steps are not recorded
    assert layer.offset == len(ref.prompt)  # the reference decode did not leak into the prefill
    assert ref.context_kv[0][0].shape[2] == ref.question_start < len(ref.prompt)
    plain = reference(model, tokenizer, sample, [method_config("full")], decode_steps=3)
    assert plain.context_kv is None
    assert not hasattr(plain.prefilled[0], "prompt_queries")


def test_prefill_and_compression_leave_no_cached_buffers_behind(embedded):
    # as mlx_lm.generate: on CUDA a long prefill's cached buffers left MLX's allocator freeing on every
    # later miss, synchronizing the device in each decode step (docs/learned.md, "MLX's allocator after a long prefill").
    # Without the release MLX held ~33 MB of buffers after each of the two here (401 tokens); with it,
    # only what the functions' locals free on return (1.6 KB and 3 MB)
    import mlx.core as mx

    from kvcompress.runner import compress_kv, prefill

    model, tokenizer = embedded
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)
    caches, _, _ = prefill(model, prompt, record_queries=True)
    assert mx.get_cache_memory() < 2**20
    kv = [c.keys_and_values() for c in caches]
    mx.eval(kv)
    keyformer = compress_kv(model, method_config("keyformer", budget=64), kv, [c.prompt_queries for c in caches])
    assert mx.get_cache_memory() < 8 * 2**20
    assert keyformer[0].tokens_kept == 64


def test_reference_answer_runs_to_eos_and_a_cap_that_cuts_it_warns(embedded):
    model, tokenizer = embedded
    params = {"task": "niah_single_2", "context_tokens": 512, "num_samples": 1, "seed": 0}
    sample = load_dataset("ruler", tokenizer=tokenizer, **params)[0]
    (full,) = run_sample(model, tokenizer, sample, [method_config("full")], context_for("ruler", params, None))
    eos = set(tokenizer.eos_token_ids)
    assert full.steps[-1]["ref_token"] in eos and not full.run["reference_cut"]
    assert len(full.steps) == full.run["decode_steps"] < 128
    answer = tokenizer.decode([s["ref_token"] for s in full.steps[:-1]])
    assert answer.strip() == full.run["prediction"].strip()
    with pytest.warns(UserWarning, match="decode_steps=2 cut the reference answer"):
        (cut,) = run_sample(model, tokenizer, sample, [method_config("full")], context_for("ruler", params, 2))
    assert cut.run["reference_cut"] and len(cut.steps) == 2
    assert cut.run["prediction"] == full.run["prediction"]  # the free-running answer is not capped


def test_at_a_budget_covering_the_context_both_protocols_give_the_full_caches_answer(embedded):
    model, tokenizer = embedded
    params = {"task": "niah_single_2", "context_tokens": 512, "num_samples": 1, "seed": 3}
    sample = load_dataset("ruler", tokenizer=tokenizer, **params)[0]
    # a token budget above the whole prompt and answer: nothing is ever evicted, under either protocol
    methods = [method_config("full"), method_config("streaming", budget=1024),
               method_config("h2o", budget=1024), method_config("keyformer", budget=1024)]
    records = run_sample(model, tokenizer, sample, methods, context_for("ruler", params, 12),
                         protocols=("query_aware", "query_agnostic"))
    assert [r.run["protocol"] for r in records] == ["query_aware"] * 4 + ["query_agnostic"] * 4
    full = records[0].run
    for r in records:
        assert r.run["status"] == "ok", r.run["error"]
        assert r.run["prediction"] == full["prediction"], (r.method, r.run["protocol"])
        assert all(s["top1_agree"] for s in r.steps)
    ids = {r.run["run_id"] for r in records}
    assert len(ids) == 8  # the protocol is part of the run id
    agnostic_full = records[4]
    assert max(s["kl"] for s in agnostic_full.steps) < 1e-4


def test_query_agnostic_compresses_the_context_before_the_question(embedded):
    model, tokenizer = embedded
    params = {"task": "niah_single_2", "context_tokens": 512, "num_samples": 1, "seed": 0}
    sample = load_dataset("ruler", tokenizer=tokenizer, **params)[0]
    method = method_config("streaming", budget=64, n_sink=4)
    aware, agnostic = run_sample(model, tokenizer, sample, [method], context_for("ruler", params, None),
                                 protocols=("query_aware", "query_agnostic"))
    prompt = datasets.sample_prompt(sample, tokenizer)
    assert aware.steps[0]["kl"] == 0.0  # query-aware: the prefill's own logits predict y_0
    assert agnostic.steps[0]["kl"] > 0.0  # the question attended to the compressed context
    # the budget is relative to the context part; the question is appended without eviction, and
    # decoding then keeps that count
    question = len(prompt.tokens) - prompt.question_start
    assert question > 1 and aware.run["tokens_kept"] == 64
    assert agnostic.run["tokens_kept"] == 64 + question
    assert all(s["tokens_kept"] == 64 + question for s in agnostic.steps)


EVICTION = ["streaming", "h2o", "keyformer", "tova", "snapkv", "pyramidkv", "adakv", "knorm", "random", "keydiff",
            "expected_attention", "criticalkv", "kvzip"]


@pytest.mark.filterwarnings("ignore:decode_steps=4 cut the reference answer")
def test_query_agnostic_every_method_holds_the_same_tokens_when_the_answer_starts(embedded):
    # one protocol for all (kvpress's): the context compressed to the budget, the question appended
    # without eviction; decode-time eviction (streaming, h2o, keyformer, tova) starts with the answer
    from kvcompress.runner import compress, reference

    model, tokenizer = embedded
    params = {"task": "niah_single_2", "context_tokens": 512, "num_samples": 1, "seed": 0}
    sample = load_dataset("ruler", tokenizer=tokenizer, **params)[0]
    methods = [method_config(name, budget=0.5) for name in EVICTION]
    ref = reference(model, tokenizer, sample, methods, 4, ("query_agnostic",))
    context, question = ref.question_start, len(ref.prompt) - ref.question_start
    expected = round(0.5 * context) + question
    for method in methods:
        caches, _ = compress(model, method.for_run(ref.budget, ref.steps), ref, "query_agnostic")
        for cache in caches:  # real tokens (AdaKV pads rows): the mean over a layer's heads is the budget
            held = [len(row) for row in cache.kept_rows()]
            assert cache.answer_start == len(ref.prompt), method.name
            assert sum(held) == (cache.capacity + question) * len(held), method.name
        assert sum(sum(len(r) for r in c.kept_rows()) for c in caches) == expected * 3 * len(caches), method.name
        for token in ref.tokens[:3]:  # the answer: evicting methods keep the count, the others append
            decode_step(model, token, caches)
        grown = 0 if method.evicts_while_decoding else 3
        assert sum(sum(len(r) for r in c.kept_rows()) for c in caches) == (expected + grown) * 3 * len(caches)


def test_evidence_survival_per_layer_and_stage(embedded):
    model, tokenizer = embedded
    params = {"task": "niah_single_2", "context_tokens": 512, "num_samples": 1, "seed": 0}
    sample = load_dataset("ruler", tokenizer=tokenizer, **params)[0]
    prompt = datasets.sample_prompt(sample, tokenizer)
    (start, end), = prompt.evidence
    methods = [method_config("full"), method_config("kivi", bits=2), method_config("mlx-quant", bits=4),
               method_config("streaming", budget=end + 4, n_sink=4),  # keeps the needle only if it is early
               method_config("streaming", budget=64, n_sink=4)]
    full, kivi, quant, early, late = run_sample(model, tokenizer, sample, methods, context_for("ruler", params, None))
    layers = len(model.layers)
    assert all(r.run["status"] == "ok" for r in (full, kivi, quant, early, late))
    assert all(r["kept_min"] == 1.0 and 0.0 < r["key_rel_err"] < 0.5 for r in quant.evidence)
    for record in (full, kivi, quant, early, late):
        assert [(r["layer"], r["stage"]) for r in record.evidence] == \
            [(i, s) for s in ("compressed", "final") for i in range(layers)]
    assert all(r["kept_min"] == 1.0 and r["key_rel_err"] == 0.0 == r["value_rel_err"] for r in full.evidence)
    assert all(r["kept_min"] == 1.0 and 0.05 < r["key_rel_err"] < 1.0 for r in kivi.evidence)  # 2-bit codes
    # a recent window of 64 tokens after a 512-token prompt: the needle (earlier) is gone
    needle_is_early = end + 4 < len(prompt.tokens) - 64
    if needle_is_early:
        assert all(r["kept_mean"] == 0.0 for r in late.evidence) and late.run["evidence_kept"] == 0.0
    assert full.run["evidence_kept"] == 1.0 == kivi.run["evidence_kept"]
    # the needle's depth: its first token over the prompt before the question, the same for every method
    assert 0.0 < full.run["evidence_depth"] == start / prompt.question_start < 1.0
    assert {r.run["evidence_depth"] for r in (full, kivi, quant, early, late)} == {full.run["evidence_depth"]}
    compressed = [r for r in early.evidence if r["stage"] == "compressed"]
    kept = sum(1 for p in range(start, end) if p < 4 or p >= len(prompt.tokens) - (end + 4 - 4)) / (end - start)
    assert all(r["kept_mean"] == pytest.approx(kept) for r in compressed)


def test_several_questions_on_one_context_share_one_compression_per_method(embedded, monkeypatch):
    from kvcompress import runner

    model, tokenizer = embedded
    params = {"task": "niah_multikey_1", "context_tokens": 512, "num_samples": 1, "seed": 0, "questions": 2}
    samples = load_dataset("ruler", tokenizer=tokenizer, **params).to_list()
    assert len(samples) == 2 and samples[0]["context"] == samples[1]["context"]
    methods = [method_config("full"), method_config("streaming", budget=0.5)]  # 8 answer tokens: enough to compare
    calls = []
    real = runner.compress_kv
    monkeypatch.setattr(runner, "compress_kv", lambda *a: calls.append(a[1].name) or real(*a))
    together = run_sample(model, tokenizer, samples, methods, context_for("ruler", params, 8),
                          protocols=("query_aware", "query_agnostic"))
    assert [(r.run["sample_id"], r.run["protocol"]) for r in together] == [
        (s["id"], p) for s in samples for p in ("query_aware", "query_agnostic") for _ in methods]
    # query_aware compresses each question's whole prompt; query_agnostic the context once per method
    assert sorted(calls) == sorted(["full", "streaming"] * 2 + ["full", "streaming"])
    alone = [r for s in samples for r in run_sample(model, tokenizer, s, methods, context_for("ruler", params, 8),
                                                  protocols=("query_aware", "query_agnostic"))]
    assert [r.run["prediction"] for r in together] == [r.run["prediction"] for r in alone]
    assert [r.run["run_id"] for r in together] == [r.run["run_id"] for r in alone]


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


def test_a_method_revision_changes_only_that_methods_run_ids():
    # Keyformer's revision 1 (the noise fix) is in its run config, so its old runs are recomputed;
    # a method never revised keeps the config, hence the run id, it always had
    from kvcompress.results import run_id
    from kvcompress.runner import run_config

    context = RunContext("smollm2-135m", "fp", "lm", {"context_tokens": 64}, 4)
    sample = {"id": "s0", "task": "lm", "context": "a b c", "question": "", "answers": []}
    keyformer = run_config(context, sample, method_config("keyformer", budget=0.5))
    h2o = run_config(context, sample, method_config("h2o", budget=0.5))
    assert keyformer["method_revision"] == 2 and "method_revision" not in h2o
    assert run_id(keyformer) != run_id({k: v for k, v in keyformer.items() if k != "method_revision"})
    # the question appended under query_agnostic changed that protocol's runs of methods that evict
    # while decoding only: theirs carry a protocol revision, the others' ids stay
    h2o_agnostic = run_config(context, sample, method_config("h2o", budget=0.5), "query_agnostic")
    snapkv = {p: run_config(context, sample, method_config("snapkv", budget=0.5), p)
              for p in ("query_aware", "query_agnostic")}
    assert h2o_agnostic["protocol_revision"] == 1 and "protocol_revision" not in h2o
    assert not any("protocol_revision" in c for c in snapkv.values())
    # `layers` (issue 36) at its default leaves every run id as it was; "all" is another run
    assert h2o["method"] == {"name": "h2o", "budget": 0.5, "recent": 0.5}
    assert run_config(context, sample, method_config("h2o", budget=0.5, layers="all"))["method"]["layers"] == "all"


def test_a_gpu_process_warms_each_method_once_untimed_and_the_results_do_not_change(embedded, monkeypatch):
    # on a GPU the first call of each kernel compiles it (seconds): the runner runs the reference and
    # each (method, protocol) once untimed first. Simulated here (nothing compiles on a CPU): the
    # warm-up must leave every number the runs record, timings aside, exactly as without it
    from kvcompress import runner

    model, tokenizer = embedded
    params = {"task": "niah_single_2", "context_tokens": 256, "num_samples": 1, "seed": 1}
    sample = load_dataset("ruler", tokenizer=tokenizer, **params)[0]
    methods = [method_config("keyformer", budget=96), method_config("kivi", bits=4, residual=32)]
    protocols = ("query_aware", "query_agnostic")
    plain = run_sample(model, tokenizer, sample, methods, context_for("ruler", params, 3), protocols=protocols)

    warmed = []
    monkeypatch.setattr(runner, "warm_up_needed", lambda: True)
    monkeypatch.setattr(runner, "_warmed", set())
    real_warm_up = runner.warm_up
    monkeypatch.setattr(runner, "warm_up", lambda model, method, *args: (warmed.append(method.label()),
                                                                          real_warm_up(model, method, *args)))
    first = run_sample(model, tokenizer, sample, methods, context_for("ruler", params, 3), protocols=protocols)
    again = run_sample(model, tokenizer, sample, methods, context_for("ruler", params, 3), protocols=protocols)
    assert sorted(warmed) == sorted(m.label() for m in methods for _ in protocols)  # once per process
    assert "reference" in runner._warmed
    for records in (first, again):
        for a, b in zip(plain, records):
            assert (a.run["run_id"], a.run["prediction"], a.run["score"]) == (b.run["run_id"], b.run["prediction"],
                                                                             b.run["score"])
            assert [(s["token"], s["kl"], s["nll"]) for s in a.steps] == [(s["token"], s["kl"], s["nll"]) for s in b.steps]
