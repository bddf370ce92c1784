"""KIVI quantize-and-pack (kvcompress/kernels/kivi_quant.py): semantics of the MLX reference, MLX
layout compatibility, and the GPU kernels bit-exact against the reference where a GPU exists.

On an H200: scripts/gpu_tests.sh."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)

import itertools

import mlx.core as mx
import numpy as np
import pytest

from kvcompress.kernels.kivi_quant import (
    gpu_backend,
    kernel_supported,
    pack_codes,
    quantize_pack,
    quantize_pack_kernel,
    quantize_pack_reference,
)


def numpy_kivi(x: np.ndarray, bits: int, G: int):
    """Independent float64-free restatement of the semantics, groups along the last axis."""
    levels = 2**bits - 1
    g = x.astype(np.float32).reshape(*x.shape[:-1], -1, G)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    scale = ((hi - lo) / np.float32(levels)).astype(x.dtype).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        codes = np.where(scale > 0, np.clip(np.rint((g - lo) / scale), 0, levels), 0)
    return codes.reshape(x.shape).astype(np.uint32), scale[..., 0], lo[..., 0]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_codes_is_mlx_layout(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2**bits, size=(3, 128)).astype(np.uint32)
    packed = pack_codes(mx.array(codes), bits)
    assert packed.shape == (3, 128 * bits // 32) and packed.dtype == mx.uint32
    ones, zeros = mx.ones((3, 4)), mx.zeros((3, 4))
    unpacked = mx.dequantize(packed, ones, zeros, group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(unpacked), codes.astype(np.float32))


@pytest.mark.parametrize("bits,G", list(itertools.product([2, 3, 4, 8], [32, 64, 128])))
def test_reference_matches_independent_statement(bits, G):
    rng = np.random.default_rng(10 * bits + G)
    x = (rng.standard_normal((2, 5, 256)) * rng.uniform(0.1, 10, size=(2, 5, 1))).astype(np.float32)
    packed, scales, zeros = quantize_pack_reference(mx.array(x), bits, G)
    codes, scale_np, lo_np = numpy_kivi(x, bits, G)
    np.testing.assert_array_equal(np.array(scales), scale_np)
    np.testing.assert_array_equal(np.array(zeros), lo_np)
    np.testing.assert_array_equal(np.array(packed), np.array(pack_codes(mx.array(codes), bits)))
    # dequantized error is at most half a step per group
    deq = np.array(mx.dequantize(packed, scales, zeros, group_size=G, bits=bits))
    step = np.repeat(scale_np, G, axis=-1)
    assert np.all(np.abs(deq - x) <= step / 2 + 1e-5 * np.abs(x).max())
    assert np.abs(deq - x).max() > 0  # it really is lossy


def test_round_half_to_even_and_constant_groups():
    # 2 bits, group [0, 3]: scale exactly 1, so x = k + 1/2 is a tie: codes round to even
    row = np.zeros(32, np.float32)
    row[:8] = [0.0, 3.0, 0.5, 1.5, 2.5, 1.0, 2.0, 0.5]
    x = mx.array(np.stack([row, np.full(32, 1.25, np.float32)]))  # second row constant
    packed, scales, zeros = quantize_pack_reference(x, 2, 32)
    codes = np.array(mx.dequantize(packed, mx.ones((2, 1)), mx.zeros((2, 1)), group_size=32, bits=2))
    np.testing.assert_array_equal(codes[0, :8], [0, 3, 0, 2, 2, 1, 2, 0])
    assert scales[1].item() == 0.0 and zeros[1].item() == 1.25
    np.testing.assert_array_equal(np.array(mx.dequantize(packed, scales, zeros, group_size=32, bits=2))[1], 1.25)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_stored_scale_in_input_dtype_is_the_one_codes_use(dtype):
    x = mx.random.normal((4, 64), key=mx.random.key(3)).astype(dtype)
    packed, scales, zeros = quantize_pack_reference(x, 4, 32)
    assert scales.dtype == dtype and zeros.dtype == dtype
    codes = mx.dequantize(packed, mx.ones((4, 2), dtype), mx.zeros((4, 2), dtype), group_size=32, bits=4)
    s = mx.repeat(scales.astype(mx.float32), 32, axis=-1)
    z = mx.repeat(zeros.astype(mx.float32), 32, axis=-1)
    expect = mx.clip(mx.round((x.astype(mx.float32) - z) / s), 0, 15)
    assert mx.array_equal(codes.astype(mx.float32), expect).item()


def test_per_channel_layout_feeds_quantized_matmul():
    # keys [B, H, T, D] -> K^T codes [B, H, D, T*b/32]; scores = q @ dequant(K^T) with transpose=False
    k = mx.random.normal((1, 3, 96, 64), key=mx.random.key(4))
    q = mx.random.normal((1, 3, 5, 64), key=mx.random.key(5))
    for bits in (2, 3, 4, 8):
        kt = quantize_pack_reference(k, bits, 32, per_channel=True)
        assert kt[0].shape == (1, 3, 64, 96 * bits // 32) and kt[1].shape == (1, 3, 64, 3)
        per_token = quantize_pack_reference(k.swapaxes(-1, -2), bits, 32)
        assert all(mx.array_equal(a, b).item() for a, b in zip(kt, per_token))
        scores = mx.quantized_matmul(q, *kt, transpose=False, group_size=32, bits=bits)
        ref = q @ mx.dequantize(*kt, group_size=32, bits=bits)
        if gpu_backend() is None:
            assert mx.allclose(scores, ref, atol=1e-4, rtol=1e-4).item()
        else:  # the GPU's float32 matmuls round like TF32 (H200: element errors ~3e-3 on scores ~10)
            assert (mx.linalg.norm(scores - ref) / mx.linalg.norm(ref)).item() < 2e-3


def test_bad_arguments_raise():
    x = mx.zeros((2, 64))
    with pytest.raises(ValueError, match="bits"):
        quantize_pack_reference(x, 5, 32)
    with pytest.raises(ValueError, match="group_size"):
        quantize_pack_reference(x, 2, 16)
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_pack_reference(mx.zeros((2, 48)), 2, 32)


def test_kernel_refuses_what_it_does_not_cover():
    # 3-bit codes straddle words; per channel a row must be whole 16-byte loads (fp16: 8 channels)
    assert not kernel_supported(mx.zeros((4, 64), mx.float16), 3, False)
    assert not kernel_supported(mx.zeros((64, 12), mx.float16), 2, True)
    assert kernel_supported(mx.zeros((64, 12), mx.float32), 2, True)
    with pytest.raises(ValueError, match="bits"):
        quantize_pack_kernel(mx.zeros((4, 64), mx.float16), 3, 32)


def test_dispatch_on_cpu_is_the_reference():
    x = mx.random.normal((2, 4, 64, 64), key=mx.random.key(6))
    if gpu_backend() is None:
        with mx.stream(mx.cpu):
            got = quantize_pack(x, 2, 32, per_channel=True)
        want = quantize_pack_reference(x, 2, 32, per_channel=True)
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))


# each (dtype, bits, G, layout) compiles a kernel (~1 s of NVRTC): fp16 covers them all, the other
# dtypes a few
GPU_CASES = {
    mx.float16: list(itertools.product([2, 4, 8], [32, 64, 128], [False, True])),
    mx.bfloat16: list(itertools.product([2, 4], [32, 128], [False, True])),
    mx.float32: list(itertools.product([2, 8], [32], [False, True])) + [(4, 128, True)],
}


@pytest.mark.skipif(gpu_backend() is None, reason="needs a CUDA or Metal GPU (run on the H200: scripts/gpu_tests.sh)")
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_gpu_kernel_bit_exact(dtype):
    for i, (bits, G, per_channel) in enumerate(GPU_CASES[dtype]):
        # per channel: whole and partial tiles of 32 channels x 4-8 groups; per token: odd row counts
        shapes = [(2, 3, 2 * G, 96), (1, 2, 9 * G, 40)] if per_channel else [(2, 3, 33, 256), (1, 1, 5, 3 * G)]
        for j, shape in enumerate(shapes):
            x = mx.random.normal(shape, key=mx.random.key(10 * i + j)) * 3
            x = mx.where(mx.arange(shape[-1]) % 7 == 0, mx.round(x * 2) / 2, x).astype(dtype)  # exact ties too
            got = quantize_pack_kernel(x, bits, G, per_channel, gpu_backend(), init_value=3.0)
            with mx.stream(mx.cpu):
                want = quantize_pack_reference(x, bits, G, per_channel)
                mx.eval(want)
            assert all(mx.array_equal(a, b).item() for a, b in zip(got, want)), (bits, G, per_channel, shape)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_reciprocal_code_rule_equals_division(bits):
    # the kernels' code rule: multiply by the reciprocal, divide only within 1e-4 of a half-integer;
    # restated in float32 numpy (IEEE, no FMA, like the GPU) it must give the division's codes
    rng = np.random.default_rng(10 + bits)
    levels = np.float32(2**bits - 1)
    for dtype in (np.float16, np.float32):
        x = (rng.standard_normal((4000, 32)) * rng.choice([1e-3, 1.0, 50.0], size=(4000, 1))).astype(dtype)
        x[::7] = np.round(x[::7] * 4) / 4  # values on a coarse grid: many exact half-integer quotients
        g = x.astype(np.float32)
        lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
        s = ((hi - lo) / levels).astype(dtype).astype(np.float32)
        ok = s > 0
        inv = np.where(ok, np.float32(1) / np.where(ok, s, 1), 0).astype(np.float32)
        d = (g - lo).astype(np.float32)
        fast = (d * inv).astype(np.float32)
        near_half = np.abs(fast - np.rint(fast)) > np.float32(0.4999)
        exact = (d / np.where(ok, s, 1)).astype(np.float32)
        rule = np.clip(np.rint(np.where(near_half, exact, fast)), 0, levels)
        want = np.clip(np.rint(exact), 0, levels)
        assert near_half.any()  # the fallback is exercised
        assert np.abs(fast - exact)[np.broadcast_to(ok, fast.shape)].max() < 3.1e-5  # the window's margin: > 3x
        assert np.array_equal(np.where(ok, rule, 0), np.where(ok, want, 0))
