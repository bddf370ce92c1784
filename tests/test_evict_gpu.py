"""The fused decode-step eviction kernel (kvcompress/kernels/evict.py) on a GPU: bit-exact against
the MLX reference, chosen by the dispatch after its self-test, and the fallback when its source is
broken. Skipped on CPU; run on the H200 with scripts/gpu_tests.sh."""

import warnings

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import pytest

from kvcompress.kernels import dispatch
from kvcompress.kernels import evict as kernel

GPU = dispatch.gpu_backend()
needs_gpu = pytest.mark.skipif(GPU is None, reason="needs a CUDA or Metal GPU (the fused kernel runs only there)")


def case(R, n, D, dtype, seed, compact=False):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    keys = mx.random.normal((R, n, D), key=k1).astype(dtype)
    values = mx.random.normal((R, n, D), key=k2).astype(dtype)
    scores = mx.floor(mx.random.uniform(shape=(R, n), key=k3) * 16)  # many ties: the lowest-index rule
    positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32) * 2 + 7, (R, n))
    rotation = None
    if compact:
        theta = 100000.0 ** (-mx.arange(0, D, 2, dtype=mx.float32) / D)
        rotation = (mx.cos(theta), mx.sin(theta))
    return keys, values, scores, positions, scores, rotation


def same(a, b) -> bool:
    return all(x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item() for x, y in zip(a, b))


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("compact", [False, True])
def test_fused_is_bit_exact(dtype, compact):
    for i, (R, n, D, n_sink, recent) in enumerate([(3, 77, 36, 2, 5), (8, 1000, 64, 4, 16), (32, 4096, 128, 4, 64)]):
        keys, values, scores, positions, evict_by, rotation = case(R, n, D, dtype, seed=i, compact=compact)
        args = (keys, values, scores, positions, evict_by, n_sink, recent, rotation, False)
        assert same(kernel.evict_one_fused(*args, backend=GPU), kernel.evict_one_reference(*args)), (R, n, D)


@needs_gpu
def test_dispatch_uses_the_fused_kernel_after_its_self_test(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    keys, values, scores, positions, evict_by, _ = case(4, 300, 64, mx.float16, seed=3)
    got = kernel.evict_one(keys, values, scores, positions, evict_by, 2, 8)
    assert dispatch.paths_used() == {f"evict_one/{GPU}/float16": "fused"}
    assert same(got, kernel.evict_one_reference(keys, values, scores, positions, evict_by, 2, 8))


@needs_gpu
def test_broken_kernel_source_falls_back_to_the_reference(monkeypatch):
    attr = "CUDA_SOURCE" if GPU == "cuda" else "METAL_SOURCE"
    good = getattr(kernel, attr)
    broken = good.replace("evicted_out[row] = evicted;", "evicted_out[row] = evicted + 1;")
    assert broken != good
    keys, values, scores, positions, evict_by, _ = case(4, 300, 64, mx.float16, seed=4)
    want = kernel.evict_one_reference(keys, values, scores, positions, evict_by, 2, 8)
    monkeypatch.delenv(dispatch.ENV, raising=False)
    for source in (broken, broken + "\n this is not C++;"):  # wrong output, then no compile at all
        monkeypatch.setattr(kernel, attr, source)
        monkeypatch.setattr(kernel, "_kernels", {})
        dispatch.forget_verdicts()
        dispatch.reset_paths()
        with pytest.warns(RuntimeWarning, match="evict_one .* failed its self-test"):
            got = kernel.evict_one(keys, values, scores, positions, evict_by, 2, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once: the second call is silent
            again = kernel.evict_one(keys, values, scores, positions, evict_by, 2, 8)
        assert same(got, want) and same(again, want)
        assert dispatch.paths_used() == {f"evict_one/{GPU}/float16": "reference"}
    dispatch.forget_verdicts()


# ---------------------------------------------------------------------------------------------
# evict_slot (exact positions, one pass): slots in any order, ties to the lowest true position


def slot_case(R, n, seed):
    k1, k2 = mx.random.split(mx.random.key(seed), 2)
    evict_by = mx.floor(mx.random.uniform(shape=(R, n), key=k1) * 16)  # many ties: the lowest-position rule
    positions = (mx.argsort(mx.random.uniform(shape=(R, n), key=k2), axis=1) * 3 + 1).astype(mx.int32)  # shuffled
    return evict_by, positions


@needs_gpu
@pytest.mark.parametrize("R,n", [(1, 5), (3, 77), (32, 8193), (64, 1025)])
def test_evict_slot_fused_is_bit_exact(R, n):
    evict_by, positions = slot_case(R, n, seed=R + n)
    for n_sink, recent in ((0, 0), (4, n // 3)):
        recent_start = 3 * n + 1 - 3 * recent  # the newest `recent` positions
        got = kernel.evict_slot_fused(evict_by, positions, n_sink, recent_start, backend=GPU)
        assert same([got], [kernel.evict_slot_reference(evict_by, positions, n_sink, recent_start)]), (R, n, n_sink)


@needs_gpu
def test_evict_slot_dispatch_uses_the_fused_kernel_and_falls_back_on_a_broken_one(monkeypatch):
    evict_by, positions = slot_case(8, 500, seed=5)
    want = kernel.evict_slot_reference(evict_by, positions, 2, 1200)
    monkeypatch.delenv(dispatch.ENV, raising=False)
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    assert same([kernel.evict_slot(evict_by, positions, 2, 1200)], [want])
    assert dispatch.paths_used() == {f"evict_slot/{GPU}/float32": "fused"}
    broken = kernel._SLOT_BODY.replace("slot_out[row] = best_slot[0];", "slot_out[row] = best_slot[0] + 1;")
    assert broken != kernel._SLOT_BODY
    monkeypatch.setattr(kernel, "_SLOT_BODY", broken)
    dispatch.clear_kernel_caches()  # rebuilt from the broken body
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    with pytest.warns(RuntimeWarning, match="evict_slot .* failed its self-test"):
        got = kernel.evict_slot(evict_by, positions, 2, 1200)
    assert same([got], [want])
    assert dispatch.paths_used() == {f"evict_slot/{GPU}/float32": "reference"}
    dispatch.forget_verdicts()
