"""The decode-step eviction (kvcompress/kernels/evict.py): `evict_one` (compact positions) and
`evict_slot` (exact positions, one pass).

The references are checked against plain per-row loops and RoPE algebra on CPU. The fused kernels
run only on a GPU: tests/test_evict_gpu.py checks them bit-exact against these references there
(skipped on CPU), benchmarks/evict_gpu.py times them.
"""

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvcompress.kernels import evict as kernel
from kvcompress.adapter import rope_rotations


def _inputs(R, n, D, seed):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((R, n, D)).astype(np.float32)
    values = rng.standard_normal((R, n, D)).astype(np.float32)
    scores = rng.random((R, n)).astype(np.float32)
    positions = np.tile(np.arange(n, dtype=np.int32) * 2 + 5, (R, 1))
    return keys, values, scores, positions


@pytest.mark.parametrize("n_sink,recent", [(0, 0), (2, 3), (4, 10)])
def test_reference_matches_per_row_loop(n_sink, recent):
    R, n, D = 6, 24, 8
    keys, values, scores, positions = _inputs(R, n, D, seed=n_sink + recent)
    scores[1, :] = 0.25  # an all-tie row: the first evictable slot goes
    out = kernel.evict_one_reference(*(mx.array(a) for a in (keys, values, scores, positions, scores)), n_sink, recent)
    for r in range(R):
        candidates = list(range(n_sink, n - recent))
        j = min(candidates, key=lambda i: (scores[r, i], i))
        assert int(out[4][r]) == j
        keep = [i for i in range(n) if i != j]
        np.testing.assert_array_equal(np.array(out[0][r]), keys[r, keep])
        np.testing.assert_array_equal(np.array(out[1][r]), values[r, keep])
        np.testing.assert_array_equal(np.array(out[2][r]), scores[r, keep])
        np.testing.assert_array_equal(np.array(out[3][r]), positions[r, keep])
    assert int(out[4][1]) == n_sink


def test_protected_slots_survive_even_with_lowest_scores():
    R, n, D = 2, 12, 4
    keys, values, _, positions = _inputs(R, n, D, seed=1)
    evict_by = np.ones((R, n), np.float32)
    evict_by[:, :2] = -5.0  # sinks score lowest
    evict_by[:, -3:] = -5.0  # so does the recent window
    evict_by[:, 6] = 0.5
    out = kernel.evict_one_reference(*(mx.array(a) for a in (keys, values, evict_by, positions, evict_by)), 2, 3)
    assert out[4].tolist() == [6, 6]


@pytest.mark.parametrize("traditional", [False, True])
def test_compact_rotation_moves_shifted_keys_one_position_back(traditional):
    # keys rotated at slot positions; after evicting slot j, slot i >= j must equal the raw key
    # rotated at i (one less than before), computed by the model's RoPE module itself
    R, n, D = 3, 16, 8
    rope = nn.RoPE(D, traditional=traditional, base=777.0)
    raw = mx.random.normal((R, 1, n, D), key=mx.random.key(3))
    rotated = rope(raw)[:, 0]  # slot i at position i
    scores = mx.random.uniform(shape=(R, n), key=mx.random.key(4))
    positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (R, n))
    cos, sin = rope_rotations(rope, D, 2)
    out = kernel.evict_one_reference(rotated, rotated, scores, positions, scores, 1, 2, (cos[1], sin[1]), traditional)
    for r in range(R):
        keep = [i for i in range(n) if i != int(out[4][r])]
        expected = rope(raw[r : r + 1, :, keep])[0, 0]  # survivors at contiguous positions 0..n-2
        np.testing.assert_allclose(np.array(out[0][r]), np.array(expected), atol=2e-5)
        np.testing.assert_array_equal(np.array(out[1][r]), np.array(rotated[r, keep]))  # values untouched


def test_rope_rotations_read_the_models_base():
    rope = nn.RoPE(16, base=123456.0)
    cos, sin = rope_rotations(rope, 16, 5)
    theta = 123456.0 ** (-np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(np.array(cos), np.cos(np.arange(5)[:, None] * theta), atol=1e-6)
    np.testing.assert_allclose(np.array(sin), np.sin(np.arange(5)[:, None] * theta), atol=1e-6)


def test_evict_one_goes_through_the_kernel_dispatch_and_records_its_path():
    from kvcompress.kernels import dispatch

    keys, values, scores, positions = (mx.array(a) for a in _inputs(2, 10, 8, seed=0))
    dispatch.reset_paths()
    out = kernel.evict_one(keys, values, scores, positions, scores, 1, 2)
    ref = kernel.evict_one_reference(keys, values, scores, positions, scores, 1, 2)
    assert all(mx.array_equal(a, b).item() for a, b in zip(out, ref))
    backend = dispatch.gpu_backend()  # on a GPU the fused kernel runs once its self-test passed
    assert dispatch.paths_used() == {f"evict_one/{backend or 'cpu'}/float32": "fused" if backend else "reference"}


# ---------------------------------------------------------------------------------------------
# one pass (exact positions): which slot goes, slots in any order


def _slot_inputs(R, n, seed, ties):
    rng = np.random.default_rng(seed)
    evict_by = rng.random((R, n)).astype(np.float32)
    if ties:
        evict_by = np.floor(evict_by * 4).astype(np.float32)
    positions = np.stack([rng.permutation(n) * 3 + 1 for _ in range(R)]).astype(np.int32)  # out of order
    return evict_by, positions


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("n_sink,recent", [(0, 0), (2, 5), (4, 40)])
def test_evict_slot_reference_matches_a_plain_loop(ties, n_sink, recent):
    R, n = 7, 61
    evict_by, positions = _slot_inputs(R, n, seed=n_sink + recent + ties, ties=ties)
    recent_start = 3 * n + 1 - 3 * recent  # the newest `recent` positions (stride 3)
    slot = kernel.evict_slot_reference(mx.array(evict_by), mx.array(positions), n_sink, recent_start)
    for r in range(R):
        evictable = [i for i in range(n) if n_sink <= positions[r, i] < recent_start]
        want = min(evictable, key=lambda i: (evict_by[r, i], positions[r, i]))  # ties: the earliest token
        assert int(slot[r]) == want


def test_evict_slot_picks_the_token_evict_one_drops_when_slots_are_in_order():
    keys, values, scores, positions = (mx.array(a) for a in _inputs(5, 40, 8, seed=4))
    scores = mx.floor(scores * 3)  # ties
    dropped = kernel.evict_one_reference(keys, values, scores, positions, scores, 3, 6)[4]
    # positions are 2i + 5: sinks are slots < 3, the recent window the last 6 slots
    slot = kernel.evict_slot_reference(scores, positions, 2 * 3 + 5, 2 * (40 - 6) + 5)
    assert slot.tolist() == dropped.tolist()


def test_evict_slot_goes_through_the_kernel_dispatch_and_records_its_path():
    from kvcompress.kernels import dispatch

    evict_by, positions = (mx.array(a) for a in _slot_inputs(3, 20, seed=1, ties=True))
    dispatch.reset_paths()
    assert mx.array_equal(kernel.evict_slot(evict_by, positions, 2, 50), kernel.evict_slot_reference(evict_by, positions, 2, 50)).item()
    gpu = dispatch.gpu_backend()
    assert dispatch.paths_used() == {f"evict_slot/{gpu or 'cpu'}/float32": "fused" if gpu else "reference"}
