"""The scoring methods' one-pass decode step (kvcompress/kernels/scored_attention.py and
EvictionCache._scored_step): on a CPU the step through the kernels' MLX reference against the
cache's plain path, and on a GPU the fused kernels against the reference (skipped on CPU; run on
the H200 with scripts/gpu_tests.sh)."""

import os
import warnings

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import numpy as np
import pytest

from kvcompress.kernels import dispatch
from kvcompress.kernels.evict import evict_slot_reference
from kvcompress.kernels import scored_attention as kernel
from kvcompress.methods import method_config
from kvcompress.methods.eviction import base as eviction
from kvcompress.methods.eviction.base import EvictionCache
from model_fixtures import TwinCaches

GPU = dispatch.gpu_backend()
needs_gpu = pytest.mark.skipif(GPU is None, reason="needs a CUDA or Metal GPU (the fused kernels run only there)")


@pytest.fixture
def on_cpu():
    """The CPU as default device (on a GPU machine too: the kernels' reference is what runs there)."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


class Layer(TwinCaches):
    """One layer fed the same random post-RoPE tokens twice: the plain step and `_scored_step`."""

    def __init__(self, method, budget=24, B=1, H=2, G=3, D=32, seed=0, **params):
        self.cfg = method_config(method, budget=budget, **params)
        self.plain = EvictionCache(self.cfg, 0, 1, H, D, None, D**-0.5)
        self.plain.fuse_scores = False
        self.scored = EvictionCache(self.cfg, 0, 1, H, D, None, D**-0.5)
        self.scored.fuse_scores = True
        super().__init__(self.plain, self.scored, B, H, G, D, seed)


@pytest.mark.parametrize("method, params", [("h2o", {}), ("h2o", {"recent": 4}), ("tova", {}),
                                            ("keyformer", {}), ("keyformer", {"noise": "frozen", "tau_end": 3.0}),
                                            ("keyformer", {"score": "proxy"})])
@pytest.mark.parametrize("B", [1, 2])
def test_scored_step_equals_plain_step_on_cpu(method, params, B, on_cpu):
    """Through the MLX reference the one-pass step computes what the plain step does, in the same
    operations: the same outputs, scores and evictions, step by step."""
    layer = Layer(method, B=B, seed=B + len(params), **params)
    layer.feed(39)  # drop-in: the prompt, then its last token alone
    layer.feed()
    for _ in range(40):
        plain, scored = layer.feed()
        np.testing.assert_allclose(np.array(scored), np.array(plain), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.array(layer.scored.scores), np.array(layer.plain.scores), rtol=1e-6, atol=1e-9)
        assert np.array_equal(np.array(layer.scored.kept_positions()), np.array(layer.plain.kept_positions()))
    assert layer.scored.tokens_kept == 24


def test_scored_step_runs_where_the_kernels_apply(monkeypatch):
    """Head dims the kernels do not cover (not a multiple of 32) keep SDPA for the output and the
    MLX ops for the scores: the same results as the plain step within SDPA's rounding."""
    calls = []
    scored_step = EvictionCache._scored_step

    def counted(self, *args):
        calls.append(1)
        return scored_step(self, *args)

    monkeypatch.setattr(EvictionCache, "_scored_step", counted)
    for D, expected in ((32, True), (16, False)):
        calls.clear()
        layer = Layer("h2o", D=D, seed=D)
        layer.feed(39)
        layer.feed()
        for _ in range(10):
            plain, scored = layer.feed()
            np.testing.assert_allclose(np.array(scored), np.array(plain), rtol=1e-5, atol=1e-6)
            assert np.array_equal(np.array(layer.scored.kept_positions()), np.array(layer.plain.kept_positions()))
        assert bool(calls) == expected


def test_keyformer_hands_its_noise_to_the_kernels(monkeypatch):
    """Keyformer's step gives the kernels its noise (the scores' softmax in the same launches) unless
    it scores with the proxy; the CPU runs the kernels' reference, equal to the plain step above."""
    seen = []
    original = eviction.scored_attention

    def spy(*args):
        seen.append(args[6])  # (q, keys, values, n, scale, scores, noise, evict)
        return original(*args)

    monkeypatch.setattr(eviction, "scored_attention", spy)
    for params, noisy in (({}, True), ({"noise": "frozen"}, True), ({"score": "proxy"}, False)):
        seen.clear()
        layer = Layer("keyformer", seed=7, **params)
        layer.feed(39)
        layer.feed()  # the prompt's last token
        layer.feed()
        layer.feed()
        assert len(seen) == 2 and all((noise is not None) == noisy for noise in seen)
        if noisy:
            position, query = layer.scored.position - 1, seen[-1].query_position
            assert query == (None if params else position) and seen[-1].tau == layer.cfg._step_tau(layer.scored, position)


def test_the_scored_step_picks_the_slot_itself(monkeypatch):
    """H2O and Keyformer (scores final after the step's launch) get the slot to evict from the same
    launch, not from a separate `evict_slot`; TOVA (scores averaged over the batch's heads after it)
    still calls it."""
    calls = []
    evict_slot = eviction.evict_slot
    monkeypatch.setattr(eviction, "evict_slot", lambda *args: calls.append(1) or evict_slot(*args))
    for method, separate in (("h2o", False), ("keyformer", False), ("tova", True)):
        layer = Layer(method, seed=3)
        layer.plain.fuse_scores = True  # both caches take the scored step here
        layer.feed(39)
        layer.feed()
        calls.clear()
        for _ in range(5):
            layer.feed()
        assert bool(calls) == separate, method
        assert isinstance(layer.scored.free, mx.array) and layer.scored.tokens_kept == 24


def test_reference_noise_is_keyformers():
    """The reference's noisy softmax is Keyformer's transform: (logits + zeta) / tau, zeta from
    counter_hash for (stream, query position, key position)."""
    from kvcompress.kernels.counter_hash import gumbel_noise_from_streams

    q, keys, values, _ = kernel.random_case(3, 4, 32, 50, 64, mx.float32, seed=5)
    noise = kernel.random_noise(3, 4, 64, seed=6)
    _, logits, sums, _ = kernel.scored_attention_reference(q, keys, values, 50, 0.2, mx.zeros((3, 50)), noise)
    zeta = gumbel_noise_from_streams(noise.streams, mx.array([noise.query_position]), noise.positions[:, :50])
    want = mx.softmax((logits[:, :, None] + zeta) / noise.tau, axis=-1, precise=True).sum(axis=(1, 2))
    np.testing.assert_allclose(np.array(sums), np.array(want), rtol=1e-6)


def test_plain_scores_only_for_unaltered_attention():
    """H2O's scores are the attention itself (added in the kernel's launch); Keyformer's noise and
    TOVA's replacement are not."""
    def plain(method):
        return EvictionCache(method_config(method, budget=8), 0, 1, 1, 16, None, 0.25)._plain_scores()

    assert plain("h2o") and not plain("keyformer")


def test_reference_contract():
    q, keys, values, scores = kernel.random_case(3, 4, 32, 50, 64, mx.float32, seed=3)
    out, logits, sums, slot = kernel.scored_attention_reference(q, keys, values, 50, 0.2, scores)
    assert slot is None and out.shape == (3, 4, 32) and logits.shape == (3, 4, 50) and sums.shape == (3, 50)
    alone = kernel.scored_attention_reference(q, keys, values, 50, 0.2)[2]
    assert mx.array_equal(sums, scores + alone).item()
    np.testing.assert_allclose(np.array(alone), np.array(mx.softmax(logits, axis=-1).sum(axis=1)), rtol=1e-5)
    np.testing.assert_allclose(np.array(alone.sum(axis=1)), 4.0, rtol=1e-5)  # G heads' probabilities
    # the spare slots past n are never read
    spoiled = mx.concatenate([keys[:, :50], mx.full((3, 14, 32), mx.nan)], axis=1)
    again = kernel.scored_attention_reference(q, spoiled, values, 50, 0.2, scores)
    assert all(mx.array_equal(a, b).item() for a, b in zip((out, logits, sums), again[:3]))
    # with `evict`: the slot evict_slot picks by the new scores, whose score then starts over at 0
    positions = kernel.random_noise(3, 4, 64, seed=4).positions
    chosen = kernel.scored_attention_reference(q, keys, values, 50, 0.2, scores, evict=kernel.EvictAt(positions, 3, 60))
    slot = chosen[3]
    assert mx.array_equal(slot, evict_slot_reference(sums, positions[:, :50], 3, 60)).item()
    zeroed = np.array(sums)
    zeroed[np.arange(3), np.array(slot)] = 0.0
    assert np.array_equal(np.array(chosen[2]), zeroed) and (zeroed > 0).sum() == 3 * 49


# -- GPU --------------------------------------------------------------------------------------------

TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}


def reference_f32(q, keys, values, n, scale, scores, noise=None):
    """(out, logits, sums) of the reference in float32 on the CPU."""
    with mx.stream(mx.cpu):  # float32 on the CPU: a GPU matmul may round through TF32
        want = kernel.scored_attention_reference(q.astype(mx.float32), keys.astype(mx.float32),
                                                 values.astype(mx.float32), n, scale, scores, noise)[:3]
        mx.eval(want)
    return want


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("G, D", [(1, 32), (3, 64), (2, 96), (4, 128), (8, 128), (5, 256)])
@pytest.mark.parametrize("accumulate, noise, evicts", [(False, None, False), (True, None, False), (True, None, True),
                                                     (True, "redraw", True), (True, "frozen", False)])
def test_fused_matches_reference(dtype, G, D, accumulate, noise, evicts):
    sizes = [(1, 1, 1, None), (3, 77, 256, None), (8, 1000, 1280, 7)]
    if dtype == mx.float16 and (G, D) == (4, 128):  # the Llama-3.1-8B shape at 16k kept slots
        sizes.append((8, 16385, 16640, None))
    for i, (R, n, allocated, blocks) in enumerate(sizes):
        q, keys, values, scores = kernel.random_case(R, G, D, n, allocated, dtype, seed=i)
        given = scores if accumulate else None
        # the positions buffer may be longer than the keys' (the cache aligns only keys and values)
        positions = kernel.random_noise(R, G, allocated + 3, noise == "redraw", seed=i)
        gumbel = None if noise is None else positions
        evict = kernel.EvictAt(positions.positions, 1, allocated - 2) if evicts else None
        got = kernel.scored_attention_fused(q, keys, values, n, D**-0.5, given, gumbel, evict, GPU, blocks=blocks)
        want = reference_f32(q, keys, values, n, D**-0.5, given, gumbel)
        assert got[0].dtype == dtype and got[1].shape == (R, G, n) and got[2].shape == (R, n)
        if evicts:  # exactly the slot evict_slot picks by the kernel's own scores; its score then 0
            want = (*want[:2], kernel.checked_slot(got[2], got[3], want[2], evict, f"slot R={R} n={n}"))
        got = got[:3]
        # float32 rounding of sums over up to 16k slots (the reference's own as much as the kernel's)
        for what, a, b, tol in zip(("output", "logits", "sums"), got, want, (TOLERANCE[dtype], 1e-5, 1e-5)):
            dispatch.assert_close(a, b, max(tol, 5e-5 if n > 4096 else 0), f"{what} R={R} n={n}")


@needs_gpu
def test_dispatch_picks_the_kernel_and_falls_back(monkeypatch):
    q, keys, values, scores = kernel.random_case(2, 4, 64, 300, 512, mx.float16, seed=9)
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    kernel.scored_attention(q, keys, values, 300, 0.125, scores)
    assert dispatch.paths_used() == {f"scored_attention/{GPU}/float16": "fused"}
    monkeypatch.setattr(kernel, "_ATTEND_BODY", kernel._ATTEND_BODY.replace("params[0];", "params[0] * 1.5f;"))
    monkeypatch.setattr(kernel, "_kernels", {})
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = kernel.scored_attention(q, keys, values, 300, 0.125, scores)
    assert any("scored_attention" in str(w.message) for w in caught)
    assert dispatch.paths_used() == {f"scored_attention/{GPU}/float16": "reference"}
    want = kernel.scored_attention_reference(q, keys, values, 300, 0.125, scores)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got[:3], want[:3]))
    dispatch.forget_verdicts()


@needs_gpu
@pytest.mark.parametrize("method", ["h2o", "tova", "keyformer"])
def test_gpu_cache_step_close_to_plain_step(method):
    """The cache on a GPU with the kernels against the plain step (float32, TF32 off in conftest):
    outputs and scores within float32 rounding, the same evictions (random scores do not tie that close)."""
    assert os.environ.get("MLX_ENABLE_TF32") == "0"
    layer = Layer(method, budget=48, H=2, G=4, D=64, seed=4)
    layer.feed(95)
    layer.feed()
    for _ in range(30):
        plain, scored = layer.feed()
        dispatch.assert_close(scored, plain, 1e-5, f"{method} output")
        dispatch.assert_close(layer.scored.scores, layer.plain.scores, 1e-5, f"{method} scores")
        assert np.array_equal(np.array(layer.scored.kept_positions()), np.array(layer.plain.kept_positions()))


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("noise", [None, "redraw"])
@pytest.mark.parametrize("vec, unroll", [(False, 8), (True, 8), (False, 4)])
def test_attend_variants_match_reference(dtype, noise, vec, unroll):
    """`attend` with a load per channel (not VEC_LOADS) or 8 slots per warp step (MAX_UNROLL 4 by
    default): the variants benchmarks/scored_attention_speed.py times against the defaults."""
    for i, (R, G, D, n, allocated) in enumerate([(3, 4, 128, 77, 256), (8, 4, 128, 16385, 16640), (2, 3, 64, 1000, 1024),
                                                 (2, 8, 256, 500, 512)]):
        q, keys, values, scores = kernel.random_case(R, G, D, n, allocated, dtype, seed=i)
        gumbel = None if noise is None else kernel.random_noise(R, G, allocated, seed=i)
        got = kernel.scored_attention_fused(q, keys, values, n, D**-0.5, scores, gumbel, backend=GPU, vec_loads=vec,
                                            max_unroll=unroll)[:3]
        want = reference_f32(q, keys, values, n, D**-0.5, scores, gumbel)
        for what, a, b, tol in zip(("output", "logits", "sums"), got, want, (TOLERANCE[dtype], 1e-5, 1e-5)):
            dispatch.assert_close(a, b, max(tol, 5e-5 if n > 4096 else 0), f"{what} R={R} n={n}")
