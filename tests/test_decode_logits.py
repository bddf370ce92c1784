"""A decode step's attention logits (kvcompress/kernels/decode_logits.py): the fused kernel against
the MLX matmul on random inputs (GPU only), the dispatch's choice, and what an eviction cache reads."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import pytest

from kvcompress.kernels import dispatch
from kvcompress.kernels.decode_logits import decode_logits, decode_logits_fused, decode_logits_reference
from kvcompress.methods.prompt_scores import folded_logits

GPU = dispatch.gpu_backend()
needs_gpu = pytest.mark.skipif(GPU is None, reason="needs a CUDA or Metal GPU (the fused kernel runs only there)")


def case(R, G, L, D, allocated, n, dtype, seed):
    k1, k2 = mx.random.split(mx.random.key(seed), 2)
    queries = (mx.random.normal((R, G, L, D), key=k1) * 2).astype(dtype)
    key_buffer = mx.random.normal((R, allocated, D), key=k2).astype(dtype)
    return queries, key_buffer


def test_reference_is_the_matmul_over_the_slots_in_use():
    queries, key_buffer = case(3, 4, 1, 64, 300, 257, mx.float32, 0)
    want = folded_logits(queries, key_buffer[:, :257], 0.125)
    assert mx.array_equal(decode_logits_reference(queries, key_buffer, 257, 0.125), want).item()
    if GPU is None:  # on CPU the dispatch runs the reference
        assert mx.array_equal(decode_logits(queries, key_buffer, 257, 0.125), want).item()


@needs_gpu
@pytest.mark.parametrize("R,G,L,D,allocated,n,dtype", [
    (8, 4, 1, 128, 16640, 16385, mx.float16),  # Llama-3.1-8B at a 32k context, 50% budget
    (3, 3, 1, 64, 512, 300, mx.float16),  # SmolLM2-135M's heads, a ragged last block
    (2, 8, 2, 128, 1024, 1000, mx.bfloat16),  # two query positions per head
    (4, 1, 1, 128, 768, 513, mx.float16),  # Keyformer's proxy: the new key as the one query
    (2, 4, 1, 64, 256, 256, mx.float32),
])
def test_fused_matches_the_matmul(R, G, L, D, allocated, n, dtype):
    queries, key_buffer = case(R, G, L, D, allocated, n, dtype, seed=n)
    got = decode_logits_fused(queries, key_buffer, n, D**-0.5, backend=GPU)
    want = decode_logits_reference(queries, key_buffer, n, D**-0.5)
    assert got.shape == want.shape == (R, G, L, n) and got.dtype == mx.float32
    # the same products summed in another order, each rounded to the key dtype: within one
    # rounding step of that dtype, and far closer in aggregate
    step = {mx.float16: 2**-10, mx.bfloat16: 2**-7, mx.float32: 2**-20}[dtype]
    assert mx.all(mx.abs(got - want) <= step * mx.maximum(mx.abs(want), 1.0)).item()
    dispatch.assert_close(got, want, 1e-3, "decode_logits")


@needs_gpu
def test_dispatch_chooses_the_kernel_after_its_selftest():
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    queries, key_buffer = case(8, 4, 1, 128, 4352, 4097, mx.float16, 1)
    decode_logits(queries, key_buffer, 4097, 128**-0.5)
    assert dispatch.paths_used() == {f"decode_logits/{GPU}/float16": "fused"}
