"""Prompt scoring in bounded memory (kvcompress/methods/prompt_scores.py): tiled == untiled."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.methods import prompt_scores
from kvcompress.methods.counter_hash import gumbel_noise
from kvcompress.methods.prompt_scores import accumulated_attention, accumulated_attention_reference


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
    monkeypatch.setattr(prompt_scores, "TILE_ELEMENTS", 1 << 20)  # 4 MiB tiles
    R, G, T = 2, 2, 4096
    q, k = _inputs(R, G, T, T, 16, 0)
    mx.eval(q, k)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    scores = accumulated_attention(q, k, 0.25)
    mx.eval(scores)
    square = R * G * T * T * 4  # 256 MiB of float32 probabilities
    assert mx.get_peak_memory() - base < square / 8
    np.testing.assert_allclose(np.array(scores).sum(), R * G * T, rtol=1e-4)
