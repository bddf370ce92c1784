"""Prompt scoring in bounded memory (kvcompress/methods/eviction/scoring/prompt_scores.py): tiled == untiled."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.kernels import dispatch
from kvcompress.kernels import prompt_scores as prompt_kernels
from kvcompress.methods.eviction.scoring import prompt_scores
from kvcompress.kernels.counter_hash import gumbel_noise
from kvcompress.methods.eviction.scoring.prompt_scores import accumulated_attention, accumulated_attention_reference


def _inputs(R, G, L, n, D, seed):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((R, G, L, D), key=k1), mx.random.normal((R, n, D), key=k2) * 2.0


def _keyformer_like(logits, query_positions, key_positions):
    R, G = logits.shape[:2]
    heads = mx.arange(R * G, dtype=mx.uint32).reshape(R, G)
    noise = gumbel_noise(3, 1, heads, query_positions, mx.broadcast_to(key_positions[None], (1, key_positions.shape[0])))
    return (logits + noise) / 1.5


@settings(max_examples=40, deadline=None)
@given(
    R=st.integers(1, 3), G=st.integers(1, 3), n=st.integers(1, 70), queries=st.floats(0.0, 1.0),
    q_tile=st.integers(1, 20), k_tile=st.integers(1, 40), noisy=st.booleans(), seed=st.integers(0, 99),
)
def test_tiled_equals_untiled(R, G, n, queries, q_tile, k_tile, noisy, seed):
    L = max(1, round(queries * n))  # the last L positions are queries (a prompt chunk)
    q, k = _inputs(R, G, L, n, 8, seed)
    transform = _keyformer_like if noisy else None
    tiled = accumulated_attention(q, k, 0.35, transform, tile=(q_tile, k_tile))
    np.testing.assert_allclose(np.array(tiled), np.array(accumulated_attention_reference(q, k, 0.35, transform)),
                               rtol=2e-5, atol=2e-5)
    assert tiled.sum().item() == pytest.approx(R * G * L, rel=1e-4)  # every query's softmax sums to 1


def test_default_tiles_never_build_the_square_matrix(monkeypatch):
    monkeypatch.setattr(prompt_scores, "TILE_ELEMENTS", 1 << 20)  # 4 MiB tiles (CPU budget)
    monkeypatch.setattr(prompt_scores, "GPU_TILE_ELEMENTS", 1 << 20)  # and the GPU's
    R, G, T = 2, 2, 4096
    q, k = _inputs(R, G, T, T, 16, 0)
    mx.eval(q, k)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    scores = accumulated_attention(q, k, 0.25)
    mx.eval(scores)
    square = R * G * T * T * 4  # 256 MiB of float32 probabilities
    tile = R * G * 64 * T * 4  # one pass, 64 query rows (4 MiB): a few temporaries of two tiles at most
    assert mx.get_peak_memory() - base < min(square / 8, 6 * tile)
    np.testing.assert_allclose(np.array(scores).sum(), R * G * T, rtol=1e-4)


def _keyformer_scorer_transform(T):
    """Keyformer's transform as the eviction cache passes it during a T-token prefill."""
    import mlx.nn as nn

    from kvcompress.methods.eviction.base import EvictionCache
    from kvcompress.methods.eviction.keyformer import Keyformer

    config = Keyformer(budget=0.5, seed=5)
    cache = EvictionCache(config, 3, 8, 2, 8, nn.RoPE(8), 8**-0.5)
    cache.position = T

    def transform(logits, query_positions, key_positions):
        return config.transform(cache, logits, query_positions, key_positions[None])

    return transform


@pytest.mark.parametrize("transform", ["none", "keyformer_like", "keyformer"])
@pytest.mark.parametrize("tile", [None, (7, 64), (5, 13), (64, 9), (1, 70)])
def test_compiled_path_equals_plain_and_reference(monkeypatch, transform, tile):
    # the GPU path (the per-element chain as one compiled kernel, row widths in steps) on the CPU's
    # compiler: ragged query and key tiles, one pass ((7, 64): a tile's rows fit until they see more
    # than 64 keys) and two passes, widths rounded past the visible keys and clamped to the prompt
    monkeypatch.setattr(prompt_scores, "WIDTH_STEP", 16)
    R, G, L, n = 2, 3, 50, 70
    q, k = _inputs(R, G, L, n, 8, 11)
    f = {"none": None, "keyformer_like": _keyformer_like, "keyformer": _keyformer_scorer_transform(n)}[transform]
    want = np.array(accumulated_attention_reference(q, k, 0.35, f))
    plain = np.array(accumulated_attention(q, k, 0.35, f, tile=tile, fused=False))
    fused = np.array(accumulated_attention(q, k, 0.35, f, tile=tile, fused=True))
    np.testing.assert_allclose(plain, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(fused, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(fused.sum(), R * G * L, rtol=1e-5)


def test_default_tiles_one_pass_when_rows_fit_two_passes_when_not(monkeypatch):
    assert prompt_scores.tile_shape(32, 2048, 32768, 1 << 24) == (16, 32768)  # 32k, Llama-3.1-8B: 16 rows
    assert prompt_scores.tile_shape(32, 2048, 32768, 1 << 26) == (64, 32768)  # GPU budget
    assert prompt_scores.tile_shape(32, 10, 100, 1 << 24) == (10, 100)  # a short chunk: one tile
    assert prompt_scores.tile_shape(4, 300, 5000, 1 << 12) == (1, 2048)  # no row fits: key tiles
    # a budget too small for one row: two passes over KEY_TILE keys, same numbers
    monkeypatch.setattr(prompt_scores, "TILE_ELEMENTS", 4 * 40)
    monkeypatch.setattr(prompt_scores, "KEY_TILE", 16)
    q, k = _inputs(2, 2, 30, 70, 8, 2)
    assert prompt_scores.tile_shape(4, 30, 70, 4 * 40) == (2, 16)
    for f in (None, _keyformer_like):
        np.testing.assert_allclose(np.array(accumulated_attention(q, k, 0.5, f)),
                                   np.array(accumulated_attention_reference(q, k, 0.5, f)), rtol=2e-5, atol=2e-5)


def test_half_precision_inputs_score_in_float32():
    # the product runs in the model's dtype (as folded_logits), the softmax and the sums in float32
    q, k = _inputs(2, 2, 40, 96, 16, 4)
    q16, k16 = q.astype(mx.float16), k.astype(mx.float16)
    for fused in (False, True):
        scores = accumulated_attention(q16, k16, 0.25, _keyformer_like, tile=(8, 96), fused=fused)
        assert scores.dtype == mx.float32
        want = accumulated_attention_reference(q16, k16, 0.25, _keyformer_like)
        np.testing.assert_allclose(np.array(scores), np.array(want), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(dispatch.gpu_backend() is None, reason="needs a CUDA or Metal GPU (the default path compiles there)")
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("tile", [None, (64, 1024)])
def test_gpu_default_path_equals_plain_and_reference(monkeypatch, dtype, tile):
    # the GPU default: compiled chain, row widths in WIDTH_STEP steps; None: GPU tiles shrunk so the
    # call takes 45 one-pass tiles (the last ragged); (64, 1024): two passes over ragged key tiles.
    # Llama-3.1-8B head shape.
    monkeypatch.setattr(prompt_scores, "GPU_TILE_ELEMENTS", 32 * 100 * 1024)
    R, G, L, n = 8, 4, 1500, 3000
    # the default tiles made explicit: H2O's sum without a tile takes the prompt kernels on CUDA
    tile = tile or prompt_scores.tile_shape(R * G, L, n, prompt_scores.GPU_TILE_ELEMENTS)
    q, k = _inputs(R, G, L, n, 128, 9)
    q, k = q.astype(dtype), k.astype(dtype)
    for f in (None, _keyformer_scorer_transform(n)):
        fused = np.array(accumulated_attention(q, k, 128**-0.5, f, tile=tile))
        plain = np.array(accumulated_attention(q, k, 128**-0.5, f, tile=tile, fused=False))
        assert np.isfinite(fused).all()
        # the same half-precision logits both ways: float32 rounding apart
        np.testing.assert_allclose(fused, plain, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(fused.sum(), R * G * L, rtol=1e-4)
        # the reference takes the product the other way round (keys @ q^T): a logit may round to a
        # neighbouring half-precision value, so only close
        want = np.array(accumulated_attention_reference(q, k, 128**-0.5, f))
        np.testing.assert_allclose(fused, want, rtol=2e-2, atol=2e-2)


# -- H2O's prompt scores on tensor cores (kvcompress/kernels/prompt_scores.py; CUDA only) -------------

needs_cuda = pytest.mark.skipif(dispatch.gpu_backend() != "cuda", reason="needs a CUDA GPU (tensor-core kernels)")


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("noise", [None, "redraw", "frozen"])
@pytest.mark.parametrize("R, G, L, n, D", [(8, 4, 1500, 1500, 128), (8, 4, 700, 3000, 128), (3, 3, 77, 200, 64),
                                           (2, 5, 300, 301, 16)])
def test_gpu_prompt_kernels_equal_the_mlx_tiles(dtype, noise, R, G, L, n, D):
    """The kernels against the MLX tiles (`tile` keeps a call on them) for a whole prompt and for a
    later prefill chunk (L < n), plain (H2O) and with Keyformer's noise: both round the logits to
    the dtype, in other summation orders."""
    q, k = _inputs(R, G, L, n, D, 11)
    q, k = q.astype(dtype), k.astype(dtype)
    gumbel = None if noise is None else prompt_kernels.random_noise(R, G, L, n, noise == "redraw", seed=L)
    got = prompt_kernels.accumulated_attention_fused(q, k, D**-0.5, gumbel)
    tiles = accumulated_attention(q, k, D**-0.5, None if gumbel is None else gumbel.apply, tile=(64, n))
    assert got.dtype == mx.float32 and got.shape == (R, n)
    np.testing.assert_allclose(np.array(got.sum(axis=1)), G * L, rtol=1e-4)  # every query's probabilities
    dispatch.assert_close(got, tiles, 2e-3 if dtype == mx.float16 else 1e-2, "scores")


@needs_cuda
def test_h2o_prompt_takes_the_kernels_on_cuda():
    q, k = _inputs(2, 4, 200, 200, 64, 12)
    q, k = q.astype(mx.float16), k.astype(mx.float16)
    dispatch.reset_paths()
    with_kernels = accumulated_attention(q, k, 0.125)
    assert dispatch.paths_used() == {"prompt_scores/cuda/float16": "fused"}
    dispatch.assert_close(with_kernels, accumulated_attention(q, k, 0.125, None, tile=(32, 200)), 2e-3, "scores")
    dispatch.reset_paths()
    accumulated_attention(q, k, 0.125, _keyformer_like)  # a transform: the MLX tiles
    assert "prompt_scores/cuda/float16" not in dispatch.paths_used()


@pytest.mark.parametrize("params", [{}, {"noise": "frozen"}, {"tau_init": 0.7, "tau_end": 2.0}])
def test_keyformer_hands_the_kernels_its_own_transform(params):
    """What Keyformer gives the prompt kernels (noise streams, redraw, each query's tau) is its
    `transform`: the kernels' reference with it equals the MLX tiles' reference with the transform,
    here for a later chunk of a prompt (queries 60..99 of 100) in layer 2."""
    from kvcompress.methods import method_config
    from kvcompress.methods.eviction.base import EvictionCache

    cfg = method_config("keyformer", budget=64, **params)
    cache = EvictionCache(cfg, 2, 4, 2, 32, None, 32**-0.5)
    cache.position = cache.length = 100  # the prompt so far, all kept; prompt_len unset: still prefilling
    q, k = _inputs(2, 3, 40, 100, 32, 13)
    noise = cfg.prompt_kernel_noise(cache, 2, 3, 40)

    def transform(logits, query_positions, key_positions):
        return cfg.transform(cache, logits, query_positions, key_positions[None])

    want = accumulated_attention_reference(q, k, 32**-0.5, transform)
    np.testing.assert_allclose(np.array(prompt_kernels.accumulated_attention_reference(q, k, 32**-0.5, noise)),
                               np.array(want), rtol=1e-5, atol=1e-6)
    assert method_config("keyformer", budget=64, score="proxy").prompt_kernel_noise(cache, 2, 3, 40) is None


@pytest.mark.parametrize("redraw", [True, False])
def test_prompt_noise_is_a_tile_transform(redraw):
    """`PromptNoise.apply` in the MLX tiles (tiles of 7 queries: each takes its own temperatures)
    equals the kernels' reference with the same noise, a later chunk (queries 50..79 of 80)."""
    q, k = _inputs(2, 3, 30, 80, 16, 14)
    noise = prompt_kernels.random_noise(2, 3, 30, 80, redraw, seed=4)
    tiled = accumulated_attention(q, k, 0.25, noise.apply, tile=(7, 16))
    np.testing.assert_allclose(np.array(tiled), np.array(prompt_kernels.accumulated_attention_reference(q, k, 0.25, noise)),
                               rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="noise.first"):  # noise for other positions: refused before any launch
        prompt_kernels.accumulated_attention_fused(q, k, 0.25, noise._replace(first=0))
