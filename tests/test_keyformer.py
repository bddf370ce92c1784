"""Keyformer and H2O's own parts (config, tau schedule, noise); the eviction base is tested for
every method in tests/test_eviction.py."""

import re

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import stream_generate

from kvcompress.errors import ConfigError
from kvcompress.methods.eviction.h2o import H2O
from kvcompress.kernels.counter_hash import gumbel_noise
from kvcompress.methods.eviction.keyformer import Keyformer



# ---------------------------------------------------------------------------------------------
# config


@pytest.mark.parametrize(
    "params,field",
    [
        (dict(budget=0), "budget"),
        (dict(budget=1.5), "budget"),
        (dict(budget=10, n_sink=4, recent=6), "budget"),  # budget <= sinks + recent
        (dict(budget=10, recent=0.9, n_sink=1), "budget"),
        (dict(recent=1.0), "recent"),
        (dict(recent=-1), "recent"),
        (dict(n_sink=-1), "n_sink"),
        (dict(tau_init=-0.5), "tau_init"),
        (dict(tau_end=-1.0), "tau_end"),
        (dict(tau_init=0.0, tau_end=2.0), "tau_init"),
        (dict(anneal_steps=2.5), "anneal_steps"),
        (dict(tau_init=float("nan")), "tau_init"),
        (dict(anneal_steps=0), "anneal_steps"),
        (dict(score="key"), "score"),
        (dict(noise="fresh"), "noise"),
        (dict(positions="relative"), "positions"),
        (dict(seed=-3), "seed"),
    ],
)
def test_invalid_config_names_the_field(params, field):
    with pytest.raises(ConfigError, match=rf"keyformer\.{field}"):
        Keyformer(**params)


def test_h2o_has_its_own_knobs_and_columns():
    assert H2O().params() == {"budget": 0.2, "recent": 0.5, "layers": "global", "quantize": None}  # the paper: 20%, heavy = recent
    assert H2O().grid_columns() == {"budget": 0.2, "bits": None, "tau_init": None, "tau_end": None}
    assert H2O(budget=0.5).label() == "h2o budget=0.5"
    assert H2O().resolve(1000) == (200, 100)
    assert Keyformer(budget=256).grid_columns() == {"budget": 256.0, "bits": None, "tau_init": 1.0, "tau_end": 2.0}
    with pytest.raises(ConfigError, match=r"h2o\.noise: unknown parameter"):
        kvcompress.method_config("h2o", noise="frozen")
    assert Keyformer.needs_queries and H2O.needs_queries


def test_fractional_budget_too_small_for_the_prompt_keeps_the_window_and_says_so():
    # issue 48: a prompt the protected window nearly covers is kept (window + one scored token), never
    # refused mid-generate; the sweep refuses such a cell before work through window_shortfall
    cfg = Keyformer(budget=0.1, n_sink=4, recent=4)
    assert cfg.resolve(50) == (9, 4)
    assert re.search(r"keyformer\.budget.*50-token prompt", cfg.window_shortfall(50))
    assert cfg.window_shortfall(1000) == ""
    assert cfg.resolve(1000) == (100, 4)
    assert Keyformer().resolve(1000) == (600, 180)  # paper defaults: 60% of the prompt, w = 30%


def test_tau_schedule_anneals_over_decode_steps():
    cfg = Keyformer(tau_init=1.0, tau_end=2.0, anneal_steps=100)
    taus = cfg.tau(mx.array([-50, 0, 50, 100, 400])).tolist()
    assert taus == pytest.approx([1.0, 1.0, 1.5, 2.0, 2.0])


def test_noise_is_gumbel_and_differs_by_layer_query_head_step():
    keys = mx.broadcast_to(mx.arange(4000, dtype=mx.int32), (2, 4000))
    heads = mx.arange(4, dtype=mx.uint32).reshape(2, 2)  # 2 KV heads x 2 query heads each
    g = gumbel_noise(7, 3, heads, mx.array([10, 11]), keys)  # [2, 2, 2, 4000]
    assert abs(g.mean().item() - 0.5772) < 0.05 and abs(g.std().item() - 1.2825) < 0.05
    assert not mx.allclose(g[0], g[1]).item()  # KV heads differ
    assert not mx.allclose(g[:, 0], g[:, 1]).item()  # query heads of one KV head differ (reference code)
    assert not mx.allclose(g[:, :, 0], g[:, :, 1]).item()  # steps differ
    assert not mx.allclose(g, gumbel_noise(7, 4, heads, mx.array([10, 11]), keys)).item()  # layers differ
    again = gumbel_noise(7, 3, heads, mx.array([11]), keys)
    assert mx.array_equal(again[:, :, 0], g[:, :, 1]).item()  # a value depends only on its coordinates


# ---------------------------------------------------------------------------------------------
# positions, batching, chunking and save/load are tested for every eviction method in
# tests/test_eviction.py; here what is Keyformer's own


def test_tau_anneals_over_the_answer_budget():
    cfg = Keyformer()
    # the answer budget (max_new_tokens), as the reference code; the reference answer's length optional
    assert cfg.anneal_steps is None and cfg.for_run(16, 5).anneal_steps == 16 == cfg.for_run(16).anneal_steps
    assert Keyformer(anneal_over="answer").for_run(16, 5).anneal_steps == 5
    assert Keyformer(anneal_over="answer").for_run(16).anneal_steps == 16  # length unknown: the budget
    assert Keyformer(anneal_steps=40).for_run(16, 5).anneal_steps == 40  # explicit wins
    with pytest.raises(ConfigError, match=r"keyformer.anneal_over: expected one of \('budget', 'answer'\)"):
        Keyformer(anneal_over="steps")
    assert cfg.for_run(16).tau(mx.array([0, 8, 16, 30])).tolist() == pytest.approx([1.0, 1.5, 2.0, 2.0])
    assert cfg.tau(mx.array([128])).item() == pytest.approx(1.5)  # drop-in default: mlx-lm's 256 tokens
    assert cfg.label() == "keyformer budget=0.6 tau=1.0..2.0"  # the run's length is not a knob


@pytest.mark.parametrize("protocol", ["query_aware", "query_agnostic"])
def test_tau_counts_generated_tokens_only_under_both_protocols(tiny_llama, monkeypatch, protocol):
    # under query_agnostic the context is compressed, then the question (10 tokens) appended: its
    # queries use tau_init, and the schedule starts at the first answer token, as under query_aware
    # (it started at the end of the context, so the question used it up: tau_end for every answer step)
    from kvcompress.runner import derive_cache, prefill

    used = []
    real = Keyformer._tau_at
    monkeypatch.setattr(Keyformer, "_tau_at", lambda self, cache, q: used.append((cache.layer, real(self, cache, q)))
                        or used[-1][1])
    model, T, question = tiny_llama, 50, 10
    prompt = mx.random.randint(0, 128, (1, T), key=mx.random.key(3))
    cfg = Keyformer(budget=16, recent=2).for_run(8)  # an 8-token answer budget
    compressed = T - question if protocol == "query_agnostic" else T
    prefilled, _, _ = prefill(model, prompt[0, :compressed].tolist(), record_queries=True)
    caches = derive_cache(model, cfg, prefilled)
    if protocol == "query_agnostic":
        used.clear()
        model(prompt[:, compressed:], cache=caches)
        taus = [np.array(tau) for layer, tau in used if layer == 0]
        assert np.concatenate(taus).ravel().tolist() == [1.0] * question
    assert caches[0].answer_start == T
    used.clear()
    token = prompt[:, -1:]
    for _ in range(10):
        token = mx.argmax(model(token, cache=caches)[:, -1:], axis=-1)
    answer_taus = [tau for layer, tau in used if layer == 0]
    assert answer_taus == pytest.approx([1.0 + t / 8 for t in range(9)] + [2.0])


def test_tau_end_changes_decode_scores():
    from test_eviction import Drive

    scores = {}
    for tau_end in (1.0, 2.0):
        cfg = Keyformer(budget=16, recent=2, tau_end=tau_end).for_run(8)
        drive = Drive(cfg, B=1, H=2, rep=2, D=8, T=32, steps=8, seed=4)
        drive.prefill()
        prompt_scores = np.array(drive.cache.scores)
        for p in range(32, 40):
            drive.feed(p)
        scores[tau_end] = (prompt_scores, np.array(drive.cache.scores), np.array(drive.cache.positions))
    np.testing.assert_array_equal(scores[1.0][0], scores[2.0][0])  # the prompt is scored at tau_init
    assert not np.allclose(scores[1.0][1], scores[2.0][1])  # decode steps anneal differently


def test_embedded_model_stream_generate_drop_in():
    model, tok = kvcompress.load_model()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    full = "".join(r.text for r in stream_generate(model, tok, prompt, max_tokens=8))
    same = kvcompress.make_cache(model, "keyformer", budget=4096)
    assert "".join(r.text for r in stream_generate(model, tok, prompt, max_tokens=8, prompt_cache=same)) == full
    assert "Paris" in full
    squeezed = kvcompress.make_cache(model, "keyformer", budget=0.5)
    text = "".join(r.text for r in stream_generate(model, tok, prompt, max_tokens=8, prompt_cache=squeezed))
    assert squeezed[0].tokens_kept == squeezed[0].capacity == round(0.5 * squeezed[0].prompt_len)
    assert squeezed[5].offset in (len(prompt) + 7, len(prompt) + 8) and text  # mlx-lm may feed the last token
    assert squeezed[0].live_kv_bytes == squeezed[0].capacity * 3 * (64 * 4 * 2 + 4 + 4)


def test_fused_noise_matches_the_plain_chain():
    # the GPU path (one compiled kernel) against the op-by-op chain; run here on the CPU's compiler
    keys = mx.broadcast_to(mx.arange(300, dtype=mx.int32), (2, 300))
    heads = mx.arange(4, dtype=mx.uint32).reshape(2, 2)
    plain = gumbel_noise(7, 3, heads, mx.array([10, 11, 12]), keys, fused=False)
    fused = gumbel_noise(7, 3, heads, mx.array([10, 11, 12]), keys, fused=True)
    assert mx.allclose(fused, plain, rtol=1e-6, atol=1e-6).item()


def test_noise_is_finite_at_the_top_hash_value():
    # (seed 0, layer 0, head 0, query 83, key 5285) hashes to the top 24-bit value, whose u rounded
    # to 1 in float32: zeta was +inf and that softmax row NaN. One draw in 2^24 does: a 2048-token
    # prompt of the Llama-3.1-8B shape left NaN scores in 2-3 of a layer's 8 KV-head rows
    heads = mx.zeros((1, 1), mx.uint32)
    for fused in (False, True):
        top = gumbel_noise(0, 0, heads, mx.array([83]), mx.array([[5285]]), fused=fused).item()
        assert top == pytest.approx(-np.log(-np.log1p(-(2.0**-24))), rel=1e-4)  # u = 1 - 2^-24: ~16.6


def test_decode_tau_on_the_host_is_the_array_tau_bit_for_bit():
    """A decode step computes tau on the host (no MLX ops); it must be the float32 value `tau` gives,
    and dividing by it the same division."""
    from types import SimpleNamespace

    x = mx.random.normal((3, 4, 1, 50), key=mx.random.key(1)) * 7
    for cfg in (Keyformer(), Keyformer(tau_init=0.7, tau_end=3.3, anneal_steps=37), Keyformer(tau_init=2, tau_end=1).for_run(100),
                Keyformer(tau_init=1e-3, tau_end=17.25, anneal_steps=3)):
        cache = SimpleNamespace(answer_start=1000, position=None)
        for p in (990, 999, 1000, 1001, 1002, 1017, 1036, 1037, 1099, 1100, 1101, 1300, 100000):
            host = cfg._step_tau(cache, p)
            want = cfg.tau(mx.array([p - 1000], mx.int32))
            assert isinstance(host, float) and np.float32(host) == np.array(want)[0] and float(np.float32(host)) == host
            assert mx.array_equal(x / host, x / want[:, None]).item()
            cache.position = p + 1  # the newest token sits at position - 1: what the transform sees at decode
            assert cfg._tau_at(cache, mx.array([p], mx.int32)) == host
