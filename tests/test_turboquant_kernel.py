"""TurboQuant decode attention on codes (kvcompress/kernels/turboquant_attention.py): the MLX reference
against an independent attention over the dequantized tokens, the log-sum-exp merge of the fresh
tokens, coverage and the dispatch on CPU, and on a GPU the fused kernel against the reference over
bits x head_dim x rows x lengths, the cache's decode steps through the kernel against the reference,
and the fallback when the kernel source is broken. GPU cases skip on CPU; run them on the H200 with
scripts/gpu_tests.sh. The kernel body itself runs on this CPU in tests/test_kernel_sources.py (CUDA)
and tests/test_metal_on_cpu.py (Metal)."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)

import warnings

import mlx.core as mx
import pytest

from kvcompress.attention import reference_attention
from kvcompress.kernels import dispatch, turboquant_attention
from kvcompress.kernels.turboquant_attention import (
    Coded,
    attention_on_codes_fused,
    attention_on_codes_reference,
    fused_supported,
    with_fresh_tokens,
)
from kvcompress.methods.quantization.turboquant import TurboQuantCache, random_case

GPU = dispatch.gpu_backend()
needs_gpu = pytest.mark.skipif(GPU is None, reason="needs a CUDA or Metal GPU (the fused kernel runs only there)")


def rel_l2(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def dequantized_attention(q, keys: Coded, values: Coded, n, scale):
    """Softmax attention over the held tokens dequantized (Codec.dequantize: what the codes stand for,
    keys with the QJL term's dequantization), and its log-sum-exp, on the CPU in float32."""
    with mx.stream(mx.cpu):
        k = keys.codec.dequantize({name: a[:, :, :n] for name, a in keys.arrays.items()})
        v = values.codec.dequantize({name: a[:, :, :n] for name, a in values.arrays.items()})
        lse = mx.logsumexp((q @ k.swapaxes(-1, -2)) * scale, axis=-1)
        out = reference_attention(q, k, v, scale, None)
        mx.eval(out, lse)
    return out, lse


@pytest.mark.parametrize("key_bits, value_bits, D, M, qjl", [(4, 3, 64, 4, True), (2, 4, 128, 1, True),
                                                             (3, 2, 32, 8, False)])
def test_reference_equals_attention_over_the_dequantized_tokens(key_bits, value_bits, D, M, qjl):
    q, keys, values, n = random_case(key_bits, value_bits, D, M, qjl, seed=key_bits + D)
    out, lse = attention_on_codes_reference(q, keys, values, n, D**-0.5)
    want_out, want_lse = dequantized_attention(q, keys, values, n, D**-0.5)
    assert out.shape == (1, 2, M, D) and lse.shape == (1, 2, M)
    assert rel_l2(out, want_out) < (1e-5 if GPU is None else 1e-3)
    assert float(mx.abs(lse - want_lse).max()) < 1e-4


def test_fresh_tokens_merge_into_one_softmax():
    """Held tokens' (output, lse) merged with the fresh tokens equals one softmax over all of them,
    causal among the fresh ones (2 query positions, 3 fresh tokens, rows rep-major)."""
    k1, k2, k3 = mx.random.split(mx.random.key(4), 3)
    k, v = mx.random.normal((1, 2, 50, 32), key=k1), mx.random.normal((1, 2, 50, 32), key=k2)
    q = mx.random.normal((1, 2, 6, 32), key=k3)  # 3 query heads a KV head x 2 positions
    held = mx.softmax((q @ k[:, :, :47].swapaxes(-1, -2)) * 0.2, axis=-1) @ v[:, :, :47]
    lse = mx.logsumexp((q @ k[:, :, :47].swapaxes(-1, -2)) * 0.2, axis=-1)
    got = with_fresh_tokens(held, lse, q, k[:, :, 47:], v[:, :, 47:], 0.2, 2, True)
    # the reference over the model's layout: [1, 6 query heads, 2 positions, 32], bottom-right causal
    queries = q.reshape(1, 2, 3, 2, 32).reshape(1, 6, 2, 32)
    want = reference_attention(queries, mx.repeat(k, 3, axis=1), mx.repeat(v, 3, axis=1), 0.2, "causal")
    assert float(mx.abs(got.reshape(1, 6, 2, 32) - want).max()) < 1e-5
    # without the mask every fresh token is seen
    got = with_fresh_tokens(held, lse, q, k[:, :, 47:], v[:, :, 47:], 0.2, 2, False)
    want = mx.softmax((q @ k.swapaxes(-1, -2)) * 0.2, axis=-1) @ v
    assert float(mx.abs(got - want).max()) < 1e-5


def test_fused_coverage():
    q, keys, values, n = random_case(4, 4, 64, 4, seed=2, T=40)
    assert fused_supported(q, keys, values, n)
    assert not fused_supported(q, None, values, n)  # a fractional width: two codecs
    assert not fused_supported(mx.zeros((1, 2, 9, 64)), keys, values, n)  # more than 8 rows a KV head
    assert not fused_supported(q, keys, values, 0)  # nothing held
    q96, k96, v96, n96 = random_case(4, 4, 96, 4, seed=2, T=40)
    assert not fused_supported(q96, k96, v96, n96)  # not whole slices of 32 channels
    cache = TurboQuantCache(2.5, 4, 0)
    cache.update_and_fetch(mx.random.normal((1, 2, 8, 64)), mx.random.normal((1, 2, 8, 64)))
    assert cache.key_side.coded(cache.arrays) is None and cache.value_side.coded(cache.arrays) is not None


def decode_steps(key_bits, value_bits, D, G, steps=3, prompt=300, L=1, mask=None, dtype=mx.float32, seed=0):
    """A cache filled with a prompt, then `steps` decode calls (L tokens each, G query heads a KV
    head): each call's output."""
    H = 2
    cache = TurboQuantCache(key_bits, value_bits, seed)
    k = mx.random.normal((1, H, prompt + steps * L, D), key=mx.random.key(seed))
    v = mx.random.normal((1, H, prompt + steps * L, D), key=mx.random.key(seed + 1))
    cache.update_and_fetch(k[:, :, :prompt].astype(dtype), v[:, :, :prompt].astype(dtype))
    cache._fresh = None
    outs = []
    for s in range(steps):
        lo = prompt + s * L
        cache.update_and_fetch(k[:, :, lo : lo + L].astype(dtype), v[:, :, lo : lo + L].astype(dtype))
        q = mx.random.normal((1, H * G, L, D), key=mx.random.key(seed + 10 + s)).astype(dtype)
        outs.append(cache.attention(q, cache, cache, D**-0.5, mask))
        mx.eval(outs[-1])
    return outs


def test_cpu_decode_records_the_reference_and_prefill_nothing():
    if GPU is not None:
        pytest.skip("CPU-only check")
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    cache = TurboQuantCache(4, 4, 0)
    cache.update_and_fetch(mx.random.normal((1, 2, 20, 64)), mx.random.normal((1, 2, 20, 64)))
    cache.attention(mx.random.normal((1, 6, 20, 64)), cache, cache, 0.125, "causal")  # a prompt chunk
    assert dispatch.paths_used() == {}
    decode_steps(4, 4, 64, 3, steps=1, prompt=20)
    assert dispatch.paths_used() == {"turboquant_decode_attention/cpu/float32": "reference"}


# --- GPU: fused kernel vs reference -------------------------------------------------------------

# (key bits, value bits, head_dim, rows M, QJL): each a separately compiled kernel; every code width
# (1..4 key code bits, 2..4 value bits), every head dim, 1 / 4 / 8 rows
CASES = [(4, 4, 128, 4, True), (2, 2, 128, 4, True), (3, 3, 128, 8, True), (4, 3, 64, 1, True),
         (4, 2, 64, 4, False), (3, 4, 32, 8, False), (2, 3, 128, 1, False)]
LENGTHS = [1, 127, 300, 2053]  # one token, under one tile, tile boundaries, many blocks


@needs_gpu
@pytest.mark.parametrize("key_bits, value_bits, D, M, qjl", CASES)
def test_fused_matches_reference(key_bits, value_bits, D, M, qjl):
    for T in LENGTHS:
        q, keys, values, n = random_case(key_bits, value_bits, D, M, qjl, seed=T + D, T=T, heads=3)
        want_out, want_lse = dequantized_attention(q, keys, values, n, D**-0.5)
        for tpb in (None, 1, 3):
            out, lse = attention_on_codes_fused(q, keys, values, n, D**-0.5, GPU, tiles_per_block=tpb)
            assert rel_l2(out, want_out) <= 1e-4, (key_bits, value_bits, D, M, qjl, T, tpb, rel_l2(out, want_out))
            assert float(mx.abs(lse - want_lse).max()) <= 1e-3, (key_bits, value_bits, D, M, qjl, T, tpb)


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("key_bits, value_bits, D, G, L", [(4, 4, 128, 4, 1), (3, 2, 64, 3, 1), (2, 4, 128, 4, 2)])
def test_cache_decode_through_the_kernel_equals_the_reference(monkeypatch, dtype, key_bits, value_bits, D, G, L):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    mask = "causal" if L > 1 else None
    fused = decode_steps(key_bits, value_bits, D, G, L=L, mask=mask, dtype=dtype, prompt=1500)
    assert dispatch.paths_used() == {f"turboquant_decode_attention/{GPU}/{str(dtype).split('.')[-1]}": "fused"}
    monkeypatch.setenv(dispatch.ENV, "reference")
    plain = decode_steps(key_bits, value_bits, D, G, L=L, mask=mask, dtype=dtype, prompt=1500)
    for a, b in zip(fused, plain):
        assert a.dtype == dtype and rel_l2(a, b) <= (2e-3 if dtype == mx.float16 else 1e-2)


@needs_gpu
def test_broken_kernel_source_falls_back_to_the_reference(monkeypatch):
    # a kernel that compiles but drops the QJL term: the self-test must catch it
    attr = "CUDA_ATTN_SOURCE" if GPU == "cuda" else "METAL_ATTN_SOURCE"
    broken = getattr(turboquant_attention, attr).replace("(dot[m][i] + rn[i] * qj[m][i])", "dot[m][i]")
    assert broken != getattr(turboquant_attention, attr)
    monkeypatch.setattr(turboquant_attention, attr, broken)
    monkeypatch.setattr(turboquant_attention, "_kernels", {})
    monkeypatch.delenv(dispatch.ENV, raising=False)
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    with pytest.warns(RuntimeWarning, match="turboquant_decode_attention .* failed its self-test"):
        out = decode_steps(4, 4, 128, 4, steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the next calls are silent
        out += decode_steps(4, 4, 128, 4, steps=1)
    monkeypatch.setenv(dispatch.ENV, "reference")
    want = decode_steps(4, 4, 128, 4, steps=1)[0]
    assert all(mx.array_equal(o, want).item() for o in out)
    assert dispatch.paths_used() == {f"turboquant_decode_attention/{GPU}/float32": "reference"}
    dispatch.forget_verdicts()
