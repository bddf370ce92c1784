"""Methods scored once from the key alone (kvcompress/methods/eviction/scoring/scored_once.py): KNorm and random.
By default they compress the prompt once (kvpress); decode-time eviction is an option."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcompress import load_dataset
from kvcompress.errors import ConfigError
from kvcompress.methods import method_config
from kvcompress.runner import RunContext, run_sample
from test_eviction import Drive


def test_random_evicts_uniformly_among_the_unprotected_tokens_at_every_step():
    # a score drawn once at arrival keeps the high draws, so the newest token would be the lowest
    # in about half the steps; drawn afresh per eviction, it goes at the uniform rate 1 / unprotected
    T, budget, n_sink, steps, rows = 40, 16, 2, 300, 3
    drive = Drive(method_config("random", budget=budget, decoding="evict", n_sink=n_sink, seed=7),
                  B=1, H=rows, rep=1, D=8, T=T, steps=steps, seed=1)
    drive.prefill()
    c = drive.cache
    newest_evicted, evicted_age = 0, []
    for p in range(T, T + steps):
        before = [set(r.tolist()) for r in c.kept_rows()]
        drive.feed(p)
        for held_before, row in zip(before, c.kept_rows()):
            assert len(row) == budget and set(range(n_sink)) <= set(row.tolist())  # sinks protected
            (gone,) = (held_before | {p}) - set(row.tolist())
            newest_evicted += gone == p
            evicted_age.append(sorted(held_before | {p}).index(gone) - n_sink)  # rank by age among unprotected
    trials, rate = steps * rows, 1 / (budget + 1 - n_sink)
    bound = 4 * math.sqrt(trials * rate * (1 - rate))  # 4 binomial standard deviations
    assert abs(newest_evicted - trials * rate) < bound, (newest_evicted, trials * rate)
    # every age rank among the unprotected is as likely: a chi-square over the 15 ranks (df 14, p > 1e-4)
    counts = np.bincount(evicted_age, minlength=budget + 1 - n_sink)
    expected = trials / len(counts)
    assert ((counts - expected) ** 2 / expected).sum() < 42.0


def test_random_draws_are_seeded_and_fresh_per_step():
    def kept(seed):
        drive = Drive(method_config("random", budget=12, decoding="evict", seed=seed), B=1, H=2, rep=1, D=8,
                      T=30, steps=20, seed=0)
        drive.prefill()
        for p in range(30, 50):
            drive.feed(p)
        return [r.tolist() for r in drive.cache.kept_rows()]

    assert kept(3) == kept(3) and kept(3) != kept(4)


@pytest.mark.parametrize("name", ["knorm", "random"])
def test_by_default_the_prompt_is_compressed_once_and_the_answer_appended(name):
    drive = Drive(method_config(name, budget=10), B=1, H=2, rep=1, D=8, T=30, steps=6, seed=0)
    drive.prefill()
    c = drive.cache
    assert c.tokens_kept == 10 and not c.config.evicts_while_decoding
    prompt_kept = [r.tolist() for r in c.kept_rows()]
    for p in range(30, 36):
        drive.feed(p)
    assert [r.tolist() for r in c.kept_rows()] == [k + list(range(30, 36)) for k in prompt_kept]
    if name == "knorm":  # the prompt's lowest-norm keys, no protection
        norms = np.linalg.norm(drive.K[0, :, :30], axis=-1)  # RoPE keeps norms
        assert prompt_kept == [sorted(np.argsort(n, kind="stable")[:10].tolist()) for n in norms]


def test_knorm_decode_eviction_asks_for_protected_tokens():
    with pytest.raises(ConfigError, match=r"knorm.decoding: 'evict' needs protected tokens"):
        method_config("knorm", decoding="evict")
    with pytest.raises(ConfigError, match=r"knorm.decoding: expected one of \('append', 'evict'\)"):
        method_config("knorm", decoding="fixed")
    assert method_config("knorm", decoding="evict", n_sink=4, recent=8).evicts_while_decoding
    assert method_config("knorm", decoding="evict", n_sink=4, recent=8).label() == \
        "knorm budget=0.5 decoding=evict n_sink=4 recent=8"


def test_knorm_answers_passkey_at_half_the_prompt_on_the_embedded_model(embedded):
    # it scored 0.00 everywhere when it evicted while decoding unprotected: each generated token was
    # compared with survivors kept for their low norms and evicted on arrival ("2000000000...")
    model, tokenizer = embedded
    params = {"context_tokens": 512, "num_samples": 2, "seed": 1}
    samples = load_dataset("passkey", tokenizer=tokenizer, **params).to_list()
    context = RunContext("smollm2-135m", "fp", "passkey", params, None)
    for sample in samples:
        records = run_sample(model, tokenizer, sample, [method_config("knorm", budget=0.5)], context,
                             protocols=("query_aware", "query_agnostic"))
        for r in records:
            assert r.run["status"] == "ok" and r.run["score"] == 1.0, (r.run["protocol"], r.run["prediction"])
