"""KIVI decode attention's CPU kernel (kvcompress/kernels/kivi_attention_cpu.py) against the MLX
reference: code widths x group sizes x head sizes x rows x masks, codes or residual only on a side,
the AVX2 loops and the portable ones (what a CPU without AVX2 runs), and a KIVI cache decoding the
embedded model with the kernel as with the reference."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)

import itertools

import mlx.core as mx
import pytest

from kvcompress.kernels import dispatch
from kvcompress.kernels.kivi_attention import decode_attention_reference, random_case
from kvcompress.kernels.kivi_attention_cpu import decode_attention_cpu, supported

CASES = [(kb, vb, 32, 64, 3, 1, 640, 572) for kb, vb in itertools.product([2, 4, 8], [2, 4, 8])] + [
    (4, 2, 64, 128, 8, 2, 640, 640),   # 8 rows: 4 heads x 2 positions, causal
    (2, 4, 128, 128, 4, 4, 640, 500),  # G 128, 4 causal positions
    (8, 8, 32, 32, 1, 1, 640, 0),      # no value codes yet
    (2, 2, 32, 64, 5, 1, 0, 572),      # no key codes yet (keys quantize R at a time)
    (4, 4, 32, 256, 2, 1, 672, 700),   # D 256; every value a code, the residual keys only
]


def rel_l2(a, b):
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


@pytest.mark.parametrize("simd", [True, False], ids=["avx2", "portable"])
@pytest.mark.parametrize("kb, vb, G, D, M, L, n_k, n_v", CASES)
def test_cpu_kernel_matches_the_reference(kb, vb, G, D, M, L, n_k, n_v, simd):
    q, keys, values = random_case(kb, vb, G, D, M, L, mx.float32, seed=kb * 10 + vb + M, T=700, n_k=n_k, n_v=n_v)
    causal = L > 1
    assert supported(q, keys, G)
    got = decode_attention_cpu(q, keys, values, D**-0.5, causal, kb, vb, G, simd=simd)
    want = decode_attention_reference(q, keys, values, D**-0.5, "causal" if causal else None, kb, vb, G)
    assert got.shape == want.shape and rel_l2(got, want) < 1e-5  # measured 6e-7 to 2e-6: float32 sums


def test_cpu_kernel_takes_a_batch():
    from kvcompress.kernels.kivi_attention import PackedSide

    a, b = (random_case(4, 2, 32, 64, 3, 1, mx.float32, seed=seed) for seed in (1, 2))
    cat = lambda x, y: mx.concatenate([x, y], axis=0)  # noqa: E731
    q = cat(a[0], b[0])
    keys, values = (PackedSide(tuple(cat(x, y) for x, y in zip(a[i].packed, b[i].packed)), a[i].n_packed,
                               cat(a[i].residual, b[i].residual)) for i in (1, 2))
    got = decode_attention_cpu(q, keys, values, 0.125, False, 4, 2, 32)
    assert got.shape == (2, 6, 1, 64)
    assert rel_l2(got, decode_attention_reference(q, keys, values, 0.125, None, 4, 2, 32)) < 1e-5


def test_cpu_kernel_reads_only_the_used_rows_of_spare_value_capacity():
    q, keys, values = random_case(4, 4, 32, 64, 3, 1, mx.float32, T=500, n_k=384, n_v=372)
    spare = tuple(mx.concatenate([a, mx.full((1, 2, 40, a.shape[3]), 7, dtype=a.dtype)], axis=2) for a in values.packed)
    padded = type(values)(spare, values.n_packed, values.residual)
    a = decode_attention_cpu(q, keys, values, 0.125, False, 4, 4, 32)
    b = decode_attention_cpu(q, keys, padded, 0.125, False, 4, 4, 32)
    assert mx.array_equal(a, b).item()


def test_kivi_cache_decodes_the_same_tokens_with_the_cpu_kernel(embedded, monkeypatch):
    # greedy decoding of the embedded model through KIVI caches: the kernel (the CPU default) and the
    # reference (forced) pick the same tokens, with logits within float32 summation differences
    from kvcompress.attention import install
    from kvcompress.methods import method_config

    if dispatch.gpu_backend() is not None:
        pytest.skip("CPU-only check")
    install()  # mlx-lm's attention calls reach the caches' own attention
    model, tokenizer = embedded
    prompt = mx.array(tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 24))

    def greedy(steps=12):
        cache = method_config("kivi", bits=4, residual=32).make_cache(model)
        logits = model(prompt[None], cache=cache)[:, -1]
        tokens, rows = [], []
        for _ in range(steps):
            token = mx.argmax(logits, axis=-1)
            tokens.append(token.item())
            logits = model(token[:, None], cache=cache)[:, -1]
            rows.append(logits)
        return tokens, mx.concatenate(rows)

    dispatch.reset_paths()
    tokens, logits = greedy()
    assert dispatch.paths_used()["kivi_decode_attention/cpu/float32"] == "fused"
    monkeypatch.setenv(dispatch.ENV, "reference")
    ref_tokens, ref_logits = greedy()
    assert tokens == ref_tokens
    assert rel_l2(logits, ref_logits) < 1e-4


def test_the_kernel_leaves_the_process_floating_point_mode_alone():
    # a library built with -ffast-math sets flush-to-zero for the whole process when it is loaded
    # (seen: hypothesis refused to draw subnormal floats in a later test); the kernel flushes
    # denormals during its own calls only
    import numpy as np

    from kvcompress.kernels.kivi_attention_cpu import library

    library(True), library(False)
    q, keys, values = random_case(4, 4, 32, 64, 3, 1, mx.float32)
    decode_attention_cpu(q, keys, values, 0.125, False, 4, 4, 32)
    tiny = np.float32(1e-40)  # subnormal
    assert tiny * np.float32(1.0) != 0 and (mx.array(tiny) * 1.0).item() != 0
