"""QJL: the score estimator against a float64 NumPy reference (its exact formula on fixed inputs, its
unbiasedness over seeds), attention on the codes against attention over what they stand for, the
full-precision buffers, resident bytes, save/load, and the embedded model."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from kvcompress.attention import reference_attention
from kvcompress.errors import ConfigError
from kvcompress.methods import method_config
from kvcompress.methods.quantization import base
from kvcompress.methods.quantization.qjl import QjlCache, sketch, values_product
from model_fixtures import next_token_kl


def numpy_scores(q: np.ndarray, k: np.ndarray, S: np.ndarray, m: int, m_out: int, outliers: int, G: int) -> np.ndarray:
    """The paper's estimator with the reference code's outlier split, in float64, straight from its
    definition: q [M, D], k [n, D] (n a multiple of G), S [>= max(m, m_out), D] -> [M, n]."""
    out = np.empty((len(q), len(k)))
    for g in range(0, len(k), G):
        block = k[g:g + G]
        top = np.argsort(-np.linalg.norm(block, axis=0), kind="stable")[:outliers]
        mask = np.zeros(k.shape[1])
        mask[top] = 1
        for t, key in enumerate(block):
            k_in, k_out = key * (1 - mask), key * mask
            n_in = float(np.float16(np.linalg.norm(k_in)))  # stored in float16
            n_out = float(np.float16(np.linalg.norm(k_out)))
            s_in, s_out = np.where(S[:m] @ k_in >= 0, 1.0, -1.0), np.where(S[:m_out] @ k_out >= 0, 1.0, -1.0)
            out[:, g + t] = (math.sqrt(math.pi / 2) / m * n_in * ((S[:m] @ (q * (1 - mask)).T).T @ s_in)
                             + math.sqrt(math.pi / 2) / m_out * n_out * ((S[:m_out] @ (q * mask).T).T @ s_out))
    return out


def _keys(n: int, D: int = 64, seed: int = 0) -> mx.array:
    # channels 5 and 17 carry most of the mass, as a real model's outlier channels
    scale = mx.where((mx.arange(D) == 5) | (mx.arange(D) == 17), 6.0, 1.0)
    return mx.random.normal((1, 1, n, D), key=mx.random.key(seed)) * scale


@pytest.mark.parametrize("m,m_out", [(256, 256), (512, 128), (64, 96)])
def test_scores_are_the_papers_estimator_on_fixed_inputs(m, m_out):
    D, n = 64, 64
    k = _keys(n)
    cache = QjlCache(m, m_out, 8, 2, 32, 32, seed=3)
    cache.update_and_fetch(k, k)
    assert cache.n_keys == n  # two groups, quantized
    q = mx.random.normal((1, 1, 5, D), key=mx.random.key(7))
    got = np.array(cache.key_scores(q, n))[0, 0]
    S = np.asarray(cache.S).astype(np.float64)
    np.testing.assert_allclose(S[:m], sketch(m, D, 3), rtol=0)  # the seeded Gaussian
    want = numpy_scores(np.array(q[0, 0], np.float64), np.array(k[0, 0], np.float64), S, m, m_out, 8, 32)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_the_estimator_is_unbiased_over_seeds():
    """Over independent sketches the mean estimate of <q, k> is the true one for every key of a group
    (inliers and outliers alike); a single sketch is far off."""
    D, n, seeds = 64, 32, 400
    k = _keys(n)
    q = mx.random.normal((1, 1, 1, D), key=mx.random.key(2)) + 0.3 * k[:, :, :1]
    true = np.array(q[0, 0] @ k[0, 0].T)[0]
    estimates = []
    for seed in range(seeds):
        cache = QjlCache(64, 32, 4, 2, 32, 32, seed=seed)
        cache.update_and_fetch(k, k)
        estimates.append(np.array(cache.key_scores(q, n))[0, 0, 0])
    estimates = np.array(estimates)  # [seeds, n]
    standard_error = estimates.std(axis=0) / math.sqrt(seeds)
    assert np.all(np.abs(estimates.mean(axis=0) - true) < 4.5 * standard_error), (estimates.mean(0) - true) / standard_error
    assert np.abs(estimates[0] - true).max() > 10 * standard_error.max()


def _filled(T=300, D=64, H=2, buffer=128, prompt=250, seed=0):
    k = mx.random.normal((1, H, T, D), key=mx.random.key(seed))
    v = mx.random.normal((1, H, T, D), key=mx.random.key(seed + 1))
    cache = QjlCache(256, 128, 8, 2, 32, buffer, seed)
    cache.update_and_fetch(k[:, :, :prompt], v[:, :, :prompt])
    for t in range(prompt, T):  # the rest a token at a time, as decoding
        cache.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    cache._fresh = None  # no call pending
    return cache, k, v


def test_recent_tokens_stay_exact_and_older_ones_are_quantized_as_the_reference_code():
    cache, k, v = _filled(T=300, prompt=250)
    # keys: whole buffers of 128 (256 of 300); values: all but the last 128
    assert (cache.n_keys, cache.n_values) == (256, 172)
    keys, values = cache.dequantized()
    assert mx.array_equal(keys[:, :, 256:], k[:, :, 256:]) and mx.array_equal(values[:, :, 172:], v[:, :, 172:])
    assert float(mx.abs(values[:, :, :172] - v[:, :, :172]).max()) > 0.1  # 2-bit codes
    # bytes: per token and head, keys 256 + 128 sign bits and two float16 norms, a group's 8 uint8
    # channel indices, 2-bit values with a float32 scale and zero per 32 channels; the rest float32
    quantized_keys = 256 * 2 * (256 // 8 + 128 // 8 + 2 + 2) + 256 // 32 * 2 * 8
    quantized_values = 172 * 2 * (64 * 2 // 8 + 2 * 2 * 4)
    exact = (300 - 256 + 300 - 172) * 2 * 64 * 4
    sketch = 256 * 64 * 4  # the layer's S [m, D] float32, held beside the codes
    assert cache.live_kv_bytes == quantized_keys + quantized_values + exact + sketch


@pytest.mark.parametrize("chunk", [1, 30])  # 30: the call flushes a buffer holding 12 of its own tokens
def test_attention_on_the_codes_equals_attention_over_what_they_stand_for(chunk):
    cache, _, _ = _filled(T=84, prompt=64, buffer=32)
    keys, values = cache.dequantized()
    q = mx.random.normal((1, 6, 5, 64), key=mx.random.key(9))
    for mask in ("causal", None):
        out = cache.attention(q, cache, cache, 0.125, mask)
        ref = reference_attention(q, keys, values, 0.125, mask)
        assert float(mx.abs(out - ref).max()) < 1e-4
    # a call's own tokens attend exactly, even those it quantized for later calls; older tokens as
    # the cache holds them after the call (a value leaving the window is read from its codes)
    k_new = mx.random.normal((1, 2, chunk, 64), key=mx.random.key(11))
    v_new = mx.random.normal((1, 2, chunk, 64), key=mx.random.key(12))
    cache.update_and_fetch(k_new, v_new)
    assert chunk == 1 or cache.n_keys == 96 > 84  # the flush took 12 of the chunk's tokens
    keys, values = cache.dequantized()
    assert chunk == 1 or float(mx.abs(keys[:, :, 84:96] - k_new[:, :, :12]).max()) > 0.1
    out = cache.attention(q[:, :, :chunk], cache, cache, 0.125, "causal")
    ref = reference_attention(q[:, :, :chunk], mx.concatenate([keys[:, :, :84], k_new], axis=2),
                              mx.concatenate([values[:, :, :84], v_new], axis=2), 0.125, "causal")
    assert float(mx.abs(out - ref).max()) < 1e-4
    keys, values = cache.dequantized()
    sinks = mx.array([0.5, -1.0, 2.0, 0.0, 1.0, -0.5])  # GPT-OSS's extra logit per query head
    out = cache.attention(q[:, :, -1:], cache, cache, 0.125, None, sinks)
    ref = reference_attention(q[:, :, -1:], keys, values, 0.125, None, sinks)
    assert float(mx.abs(out - ref).max()) < 1e-4


@pytest.mark.parametrize("chunk", [16, 30])  # 30: the call flushes a buffer holding 12 of its own tokens
def test_the_prefill_path_equals_the_codes_path_on_the_same_cache(chunk, monkeypatch):
    """A prefill chunk dequantizes the quantized tokens once (in blocks of 40 rows here: one ends
    mid-group) and runs MLX's fused attention; on the same cache state and queries, that equals
    attention on the codes."""
    monkeypatch.setattr(base, "DEQUANTIZE_BLOCK", 40)
    cache, _, _ = _filled(T=84, prompt=64, buffer=32)
    k_new = mx.random.normal((1, 2, chunk, 64), key=mx.random.key(21))
    v_new = mx.random.normal((1, 2, chunk, 64), key=mx.random.key(22))
    cache.update_and_fetch(k_new, v_new)
    cache._fresh = None
    q = mx.random.normal((1, 6, chunk, 64), key=mx.random.key(23))
    sinks = mx.array([0.5, -1.0, 2.0, 0.0, 1.0, -0.5])
    for mask, sink in (("causal", None), (None, None), ("causal", sinks)):
        fast = cache.prefill_attention(q, k_new, v_new, 0.125, mask, sink)
        codes = cache.attention_on_codes(q, k_new, v_new, 0.125, mask, sink)
        assert float(mx.abs(fast - codes).max()) < 1e-4


def test_config_validates_and_saves_and_loads(tmp_path):
    with pytest.raises(ConfigError, match=r"qjl.sketch_dim: expected a positive multiple of 32"):
        method_config("qjl", sketch_dim=100)
    with pytest.raises(ConfigError, match=r"qjl.buffer: expected a positive multiple of group_size \(32\)"):
        method_config("qjl", buffer=40)
    with pytest.raises(ConfigError, match=r"qjl.value_bits: expected one of 2, 3, 4, 8"):
        method_config("qjl", value_bits=1)
    from arch_models import tiny_model

    model = tiny_model("llama")  # 32-dim heads
    with pytest.raises(ConfigError, match=r"qjl.group_size: expected a divisor of the model's value dim 32"):
        kvcompress.make_cache(model, "qjl", group_size=64, buffer=128)
    with pytest.raises(ConfigError, match=r"qjl.outliers: expected fewer than the model's head_dim 32"):
        kvcompress.make_cache(model, "qjl", outliers=32)
    assert method_config("qjl").grid_columns()["bits"] is None  # m / head_dim bits a key coordinate: no one width
    cache, _, _ = _filled(T=90, prompt=70, buffer=32)
    from mlx_lm.models.cache import save_prompt_cache

    save_prompt_cache(str(tmp_path / "c.safetensors"), [cache])
    (loaded,) = kvcompress.load_prompt_cache(str(tmp_path / "c.safetensors"))
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(3))
    assert mx.array_equal(loaded.attention(q, None, None, 0.125, None), cache.attention(q, None, None, 0.125, None))
    assert loaded.live_kv_bytes == cache.live_kv_bytes
    k, v = mx.random.normal((1, 2, 40, 64), key=mx.random.key(4)), mx.random.normal((1, 2, 40, 64), key=mx.random.key(5))
    for c in (cache, loaded):  # both go on the same way
        c.update_and_fetch(k, v)
    assert all(mx.array_equal(a, b) for a, b in zip(cache.dequantized(), loaded.dequantized()))


@pytest.mark.slow
def test_qjl_on_the_embedded_model_more_sketch_bits_track_the_full_cache_closer(embedded):
    """KL(full || qjl) of the next token after the 217-token prompt of benchmarks/quantizer_kl.py
    (keys: 128 as sign sketches; values: 88 as 2-bit codes; the rest exact), seeds 0-2: the paper's
    sketch sizes (measured median over seeds 0-4: 0.58) against 1024 bits a key (0.19)."""
    kl = {m: np.median([next_token_kl(*embedded, "qjl", sketch_dim=m, initial_sketch_dim=max(m, 512), seed=s)
                        for s in range(3)])
          for m in (256, 1024)}
    assert kl[256] < 1.0 and kl[1024] < kl[256], kl


@pytest.mark.parametrize("bits", [2, 4])
def test_values_product_paths_agree(bits):
    # CUDA's quantized_matmul lacks small transpose=False shapes: there the values are dequantized
    # first; both paths compute probs @ dequantize(codes) (random inputs, the failing GPU shape among them)
    for rows, n, d in [(2, 28, 32), (8, 300, 64), (1, 1, 128)]:
        keys = mx.random.split(mx.random.key(rows * n + d + bits), 2)
        probs = mx.softmax(mx.random.normal((2, 3, rows, n), key=keys[0]), axis=-1)
        codes, scales, zeros = mx.quantize(mx.random.normal((2, 3, n, d), key=keys[1]), group_size=32, bits=bits)
        fused = values_product(probs, codes, scales, zeros, 32, bits, fused=True)
        plain = values_product(probs, codes, scales, zeros, 32, bits, fused=False)
        reference = probs @ mx.dequantize(codes, scales, zeros, group_size=32, bits=bits)
        np.testing.assert_allclose(np.array(fused), np.array(reference), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.array(plain), np.array(reference))
