"""KIVI decode attention on codes (kvcompress/kernels/kivi_attention.py): the MLX reference against
an independent dequantize-then-attend, the dispatch on CPU, and on a GPU the fused kernel against the
reference over bits x head_dim x rows x masks x dtypes, plus the fallback when the kernel source is
broken. GPU cases skip on CPU; run them on the H200 with scripts/gpu_tests.sh."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)

import warnings

import mlx.core as mx
import pytest

from kvcompress.attention import reference_attention
from kvcompress.kernels import dispatch, kivi_attention
from kvcompress.kernels.kivi_attention import (
    PackedSide,
    decode_attention,
    decode_attention_fused,
    decode_attention_reference,
    fused_supported,
    random_case,
)

GPU = dispatch.gpu_backend()
needs_gpu = pytest.mark.skipif(GPU is None, reason="needs a CUDA or Metal GPU (the fused kernel runs only there)")


def dequantize_then_attend(q, keys: PackedSide, values: PackedSide, scale, mask, kb, vb, G):
    """float32 attention over explicitly dequantized keys and values (independent of the kernel
    module), on the CPU: a GPU matmul may round float32 through TF32."""
    with mx.stream(mx.cpu):
        out = _dequantize_then_attend(q, keys, values, scale, mask, kb, vb, G)
        mx.eval(out)
    return out


def _dequantize_then_attend(q, keys: PackedSide, values: PackedSide, scale, mask, kb, vb, G):
    k, v = [keys.residual.astype(mx.float32)], [values.residual.astype(mx.float32)]
    if keys.n_packed:
        n = keys.n_packed
        codes, scales, zeros = keys.packed
        kd = mx.dequantize(codes[..., : n * kb // 32], scales[..., : n // G], zeros[..., : n // G], group_size=G, bits=kb)
        k.insert(0, kd.swapaxes(-1, -2).astype(mx.float32))
    if values.n_packed:
        n = values.n_packed
        v.insert(0, mx.dequantize(*(a[:, :, :n] for a in values.packed), group_size=G, bits=vb).astype(mx.float32))
    return reference_attention(q.astype(mx.float32), mx.concatenate(k, 2), mx.concatenate(v, 2), scale, mask)


def rel_l2(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


@pytest.mark.parametrize("kb,vb,D,M,L,n_k,n_v", [
    (2, 2, 64, 3, 1, 640, 572), (4, 2, 128, 4, 1, 256, 0), (8, 4, 64, 6, 2, 640, 640),
    (3, 3, 64, 1, 1, 320, 300), (2, 8, 32, 8, 2, 0, 0),
])
def test_reference_equals_dequantize_then_attend(kb, vb, D, M, L, n_k, n_v):
    q, keys, values = random_case(kb, vb, 32, D, M, L, mx.float32, seed=kb + vb + M, T=700, n_k=n_k, n_v=n_v)
    mask = "causal" if L > 1 else None
    out = decode_attention_reference(q, keys, values, D**-0.5, mask, kb, vb, 32)
    want = dequantize_then_attend(q, keys, values, D**-0.5, mask, kb, vb, 32)
    # on a GPU the reference's float32 matmuls round like TF32 (seen on the H200: up to 4e-4)
    assert out.shape == q.shape and rel_l2(out, want) < (1e-5 if GPU is None else 1e-3)


def test_reference_reads_only_the_used_rows_of_spare_capacity():
    q, keys, values = random_case(2, 2, 32, 64, 4, 1, mx.float32, T=500, n_k=384, n_v=372)
    spare = tuple(mx.concatenate([a, mx.full((1, 2, 40, a.shape[3]), 7, dtype=a.dtype)], axis=2) for a in values.packed)
    padded = PackedSide(spare, values.n_packed, values.residual)
    a = decode_attention_reference(q, keys, values, 0.125, None, 2, 2, 32)
    b = decode_attention_reference(q, keys, padded, 0.125, None, 2, 2, 32)
    assert mx.array_equal(a, b).item()


def test_fused_coverage():
    q, keys, values = random_case(2, 4, 32, 128, 4, 1, mx.float16)
    assert fused_supported(q, keys, values, None, 2, 4)
    assert not fused_supported(q, keys, values, None, 3, 4)  # 3-bit codes straddle words
    assert not fused_supported(q, keys, values, mx.zeros((1, 1)), 2, 4)  # array masks: reference
    q9, k9, v9 = random_case(2, 2, 32, 64, 9, 1, mx.float16)
    assert not fused_supported(q9, k9, v9, None, 2, 2)  # more than 8 rows per KV head
    q32, k32, v32 = random_case(2, 2, 32, 64, 4, 1, mx.float32)
    mixed = PackedSide(k32.packed, k32.n_packed, k32.residual.astype(mx.float16))
    assert not fused_supported(q32, mixed, v32, None, 2, 2)  # one dtype for everything
    q96, k96, v96 = random_case(2, 2, 32, 96, 4, 1, mx.float16)
    assert not fused_supported(q96, k96, v96, None, 2, 2)  # D / 8 channel groups must divide a warp


def test_cpu_dispatch_runs_the_cpu_kernel_after_its_self_test_and_records_it(monkeypatch):
    if GPU is not None:
        pytest.skip("CPU-only check")
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    q, keys, values = random_case(2, 2, 32, 64, 3, 1, mx.float32)
    out = decode_attention(q, keys, values, 0.125, None, 2, 2, 32)
    assert rel_l2(out, decode_attention_reference(q, keys, values, 0.125, None, 2, 2, 32)) < 1e-5
    assert dispatch.paths_used() == {"kivi_decode_attention/cpu/float32": "fused"}
    # what the kernel does not cover, and a forced reference, run the reference and say so
    dispatch.reset_paths()
    q16, k16, v16 = random_case(2, 2, 32, 64, 3, 1, mx.float16)
    out = decode_attention(q16, k16, v16, 0.125, None, 2, 2, 32)
    assert mx.array_equal(out, decode_attention_reference(q16, k16, v16, 0.125, None, 2, 2, 32)).item()
    assert dispatch.paths_used() == {"kivi_decode_attention/cpu/float16": "reference"}
    monkeypatch.setenv(dispatch.ENV, "reference")
    dispatch.reset_paths()
    out = decode_attention(q, keys, values, 0.125, None, 2, 2, 32)
    assert mx.array_equal(out, decode_attention_reference(q, keys, values, 0.125, None, 2, 2, 32)).item()
    assert dispatch.paths_used() == {"kivi_decode_attention/cpu/float32": "reference"}


# --- GPU: fused kernel vs reference -------------------------------------------------------------

TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}


# (key bits, value bits, head_dim, rows M, query positions L): each is a separately compiled kernel
# (seconds of NVRTC each on the H200), so fp16 covers every axis and the other dtypes one case
CASES = {
    mx.float16: [(2, 2, 128, 4, 1), (4, 4, 128, 4, 1), (4, 2, 128, 4, 1), (8, 8, 64, 6, 2), (2, 4, 64, 3, 1)],
    mx.bfloat16: [(2, 2, 128, 8, 2)],
    mx.float32: [(4, 2, 128, 1, 1)],
}
# (T, key codes, value codes): under one tile, tile boundaries, residual-only tails, no value codes
SHAPES = [(100, 64, 0), (700, 640, 572), (1024, 896, 896), (2053, 2048, 1925), (300, 256, 172)]


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_fused_matches_reference(dtype):
    for i, (kb, vb, D, M, L) in enumerate(CASES[dtype]):
        for j, (T, n_k, n_v) in enumerate(SHAPES):
            q, keys, values = random_case(kb, vb, 32, D, M, L, dtype, seed=10 * i + j, T=T, n_k=n_k, n_v=n_v)
            mask = "causal" if L > 1 else None
            want = dequantize_then_attend(q, keys, values, D**-0.5, mask, kb, vb, 32)
            for tpb in (1, 3):
                got = decode_attention_fused(q, keys, values, D**-0.5, L > 1, kb, vb, 32, GPU, tiles_per_block=tpb)
                err = rel_l2(got, want)
                assert got.dtype == dtype and err <= TOLERANCE[dtype], (kb, vb, D, M, L, T, tpb, err)


@needs_gpu
def test_fused_group_sizes_and_long_context():
    for G in (64, 128):
        q, keys, values = random_case(2, 4, G, 128, 4, 1, mx.float16, seed=G, T=5000, n_k=4992 // G * G, n_v=4872)
        got = decode_attention_fused(q, keys, values, 128**-0.5, False, 2, 4, G, GPU)
        want = dequantize_then_attend(q, keys, values, 128**-0.5, None, 2, 4, G)
        assert rel_l2(got, want) <= 2e-3


# the tensor-core kernel (kivi_attention_mma.py: CUDA, fp16, 2/4-bit codes) over its template axes,
# the scalar kernel taking the tokens after its last whole step
MMA_CASES = [(2, 2, 32, 128, 4, 1), (4, 4, 32, 128, 4, 1), (2, 4, 64, 128, 4, 2), (4, 2, 128, 128, 1, 1),
             (2, 2, 32, 64, 3, 1), (4, 4, 64, 64, 8, 1)]


@pytest.mark.skipif(GPU != "cuda", reason="needs CUDA (the tensor-core kernel is CUDA only)")
@pytest.mark.parametrize("kb, vb, G, D, M, L", MMA_CASES)
def test_tensor_cores_match_dequantize_then_attend(kb, vb, G, D, M, L):
    from kvcompress.kernels import kivi_attention_mma

    T, n_k, n_v = 5000, 4992 // G * G, 4872
    q, keys, values = random_case(kb, vb, G, D, M, L, mx.float16, seed=kb + 3 * vb + D + M, T=T, n_k=n_k, n_v=n_v)
    assert kivi_attention_mma.tokens_covered(n_k, n_v, T, L, L > 1) == 4864
    mask = "causal" if L > 1 else None
    want = dequantize_then_attend(q, keys, values, D**-0.5, mask, kb, vb, G)
    for spw, one_launch in ((1, False), (5, False), (5, True)):
        got = decode_attention_fused(q, keys, values, D**-0.5, L > 1, kb, vb, G, GPU, tensor_cores=True,
                                     steps_per_warp=spw, one_launch=one_launch)
        assert got.dtype == mx.float16 and rel_l2(got, want) <= 1e-3, (kb, vb, G, D, M, L, spw, rel_l2(got, want))


@needs_gpu
def test_dispatch_uses_the_fused_kernel_after_its_self_test(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    q, keys, values = random_case(2, 2, 32, 128, 4, 1, mx.float16, seed=5)
    out = decode_attention(q, keys, values, 128**-0.5, None, 2, 2, 32)
    assert dispatch.paths_used() == {f"kivi_decode_attention/{GPU}/float16": "fused"}
    assert rel_l2(out, dequantize_then_attend(q, keys, values, 128**-0.5, None, 2, 2, 32)) <= 2e-3


@needs_gpu
def test_broken_kernel_source_falls_back_to_the_reference(monkeypatch):
    # a kernel that compiles but writes a wrong partial output: the self-test must catch it
    attr = "CUDA_ATTN_SOURCE" if GPU == "cuda" else "METAL_ATTN_SOURCE"
    broken = getattr(kivi_attention, attr).replace("o_part[out_base * D + i] = sc[i];", "o_part[out_base * D + i] = 0.5f * sc[i];")
    assert broken != getattr(kivi_attention, attr)
    monkeypatch.setattr(kivi_attention, attr, broken)
    monkeypatch.setattr(kivi_attention, "_kernels", {})
    monkeypatch.delenv(dispatch.ENV, raising=False)
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    q, keys, values = random_case(4, 4, 32, 64, 4, 1, mx.float16, seed=6)
    with pytest.warns(RuntimeWarning, match="kivi_decode_attention .* failed its self-test"):
        out = decode_attention(q, keys, values, 0.125, None, 4, 4, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the second call is silent
        out2 = decode_attention(q, keys, values, 0.125, None, 4, 4, 32)
    want = decode_attention_reference(q, keys, values, 0.125, None, 4, 4, 32)
    assert mx.array_equal(out, want).item() and mx.array_equal(out2, want).item()
    assert dispatch.paths_used() == {f"kivi_decode_attention/{GPU}/float16": "reference"}
    # a source that does not compile at all is caught the same way
    monkeypatch.setattr(kivi_attention, attr, broken + "\n this is not C++;")
    monkeypatch.setattr(kivi_attention, "_kernels", {})
    dispatch.forget_verdicts()
    with pytest.warns(RuntimeWarning, match="failed its self-test"):
        out3 = decode_attention(q, keys, values, 0.125, None, 4, 4, 32)
    assert mx.array_equal(out3, want).item()
    dispatch.forget_verdicts()
