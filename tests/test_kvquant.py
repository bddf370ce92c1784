"""KVQuant: the RoPE inverse, the calibration and codes against a plain NumPy reference on random
inputs, the dense-and-sparse outliers, attention over what the codes stand for, resident bytes,
save/load, and the embedded model."""

from __future__ import annotations

import copy
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import save_prompt_cache

import kvcompress
from kvcompress.attention import reference_attention
from kvcompress.errors import ConfigError
from kvcompress.methods import method_config
from kvcompress.methods.quantization.kvquant import KVQuantCache, kmeans_1d
from model_fixtures import next_token_kl

B, H, D, BASE = 1, 2, 64, 10000.0


# -- the NumPy reference: KVQuant's quantizer written out plainly, float64 ---------------------------


def np_kmeans(x: np.ndarray, levels: int) -> np.ndarray:
    """1-D k-means of x [n]: init at the (k + 1/2) / levels order statistics, Lloyd until still (<= 50)."""
    ordered = np.sort(x)
    centroids = ordered[np.minimum(np.floor((np.arange(levels) + 0.5) / levels * len(x)).astype(int), len(x) - 1)]
    for _ in range(50):
        cell = (x[:, None] > (centroids[1:] + centroids[:-1])[None] / 2).sum(1)
        updated = np.array([x[cell == k].mean() if np.any(cell == k) else centroids[k] for k in range(levels)])
        if np.array_equal(updated, centroids):
            break
        centroids = updated
    return centroids


def np_books(normal: np.ndarray, inside: np.ndarray, bits: int, codebook: str) -> np.ndarray:
    """Codebooks [Hb, Db, 2^bits] (float16) of normalized entries [B, H, n, D] inside [-1, 1]."""
    if codebook == "layer":
        return np_kmeans(normal[inside], 2**bits).astype(np.float16)[None, None]
    return np.stack([np.stack([np_kmeans(normal[:, h, :, d][inside[:, h, :, d]], 2**bits) for d in range(D)])
                     for h in range(H)]).astype(np.float16)


def np_code(normal: np.ndarray, book: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The nearest codebook entry [B, H, n, D] to each clipped normalized entry, and where the two
    nearest are within 1e-4 of a tie (float32 and float64 may pick either there)."""
    book = book.astype(np.float64)[None, :, None]  # [1, Hb, 1, Db, K]
    distance = np.abs(np.clip(normal, -1, 1)[..., None] - book)
    index = np.argmin(distance, axis=-1)
    two = np.sort(distance, axis=-1)[..., :2]
    tie = two[..., 1] - two[..., 0] < 1e-4
    return np.take_along_axis(np.broadcast_to(book, (*normal.shape, book.shape[-1])), index[..., None], -1)[..., 0], tie


def np_value_split(v: np.ndarray, fraction: float):
    each = math.ceil(fraction / 2 * v.shape[-1])
    s = np.sort(v, axis=-1)
    lo, hi = s[..., each], s[..., -1 - each]
    zero = ((hi + lo) / 2).astype(np.float16).astype(np.float64)
    half = ((hi - lo) / 2).astype(np.float16).astype(np.float64)
    outlier = (v < lo[..., None]) | (v > hi[..., None])
    return zero, half, outlier


def np_kvquant(pre_calib, v_calib, pre, v, key_bits, value_bits, fraction, codebook):
    """Calibrate on (pre_calib, v_calib), then what the codes of (pre, v) stand for: pre-RoPE keys and
    values [B, H, n, D] with their outliers in float16, and the key outlier mask."""
    x = pre_calib.transpose(1, 3, 0, 2).reshape(H * D, -1)
    lower, upper = np.quantile(x, fraction / 2, axis=-1), np.quantile(x, 1 - fraction / 2, axis=-1)
    zero = ((upper + lower) / 2).reshape(H, D).astype(np.float16).astype(np.float64)[None, :, None]
    half = ((upper - lower) / 2).reshape(H, D).astype(np.float16).astype(np.float64)[None, :, None]
    normal = (pre_calib - zero) / half
    k_book = np_books(normal, np.abs(normal) <= 1, key_bits, codebook)
    v_zero, v_half, v_out = np_value_split(v_calib, fraction)
    v_book = np_books((v_calib - v_zero[..., None]) / v_half[..., None], ~v_out, value_bits, codebook)

    normal = (pre - zero) / half
    k_out = np.abs(normal) > 1
    k_dense, k_tie = np_code(normal, k_book)
    keys = np.where(k_out, pre.astype(np.float16), k_dense * half + zero)
    v_zero, v_half, v_out = np_value_split(v, fraction)
    v_dense, v_tie = np_code((v - v_zero[..., None]) / v_half[..., None], v_book)
    values = np.where(v_out, v.astype(np.float16), v_dense * v_half[..., None] + v_zero[..., None])
    return keys, values, k_out, k_book, v_book, (k_tie & ~k_out) | (v_tie & ~v_out)


def np_rope(x: np.ndarray, start: int = 0) -> np.ndarray:
    """Non-traditional RoPE of x [B, H, n, D] at positions start.."""
    angle = (start + np.arange(x.shape[2]))[:, None] * BASE ** (-np.arange(0, D, 2) / D)[None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x1 * np.sin(angle) + x2 * np.cos(angle)], -1)


def random_kv(T: int, seed: int = 0):
    """Pre-RoPE keys with per-channel offsets and scales and a few large entries (as real keys'
    outlier channels), values with a few large entries: float32 [B, H, T, D]."""
    rng = np.random.default_rng(seed)
    scale, offset = np.exp(rng.standard_normal((1, H, 1, D))), 2 * rng.standard_normal((1, H, 1, D))
    pre = rng.standard_normal((B, H, T, D)) * scale + offset
    pre += 8 * (rng.random((B, H, T, D)) < 0.003) * rng.standard_normal((B, H, T, D))
    v = rng.standard_normal((B, H, T, D)) + 6 * (rng.random((B, H, T, D)) < 0.01)
    return pre.astype(np.float32), v.astype(np.float32)


def filled(T=56, prompt=48, key_bits=3, value_bits=3, fraction=0.01, residual=0, n_sink=1, codebook="layer", seed=0):
    """A cache fed `prompt` tokens in one call, then the rest one at a time (as decoding)."""
    pre, v = random_kv(T, seed)
    rope = nn.RoPE(D, base=BASE)
    keys = rope(mx.array(pre))  # post-RoPE at positions 0..T-1, as mlx-lm hands them to a cache
    cache = KVQuantCache(key_bits, value_bits, fraction, residual, n_sink, codebook, rope)
    cache.update_and_fetch(keys[:, :, :prompt], mx.array(v[:, :, :prompt]))
    for t in range(prompt, T):
        cache.update_and_fetch(keys[:, :, t : t + 1], mx.array(v[:, :, t : t + 1]))
    cache._fresh = None  # no call pending: every token attends through what the cache holds
    return cache, pre, v, keys


# -- tests --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("traditional, dims", [(False, D), (True, D), (False, 24)])
def test_the_models_rope_is_inverted_to_float_error(traditional, dims):
    """Keys come post-RoPE at known positions; rotating back with the rotations read off the module
    gives the pre-RoPE keys (partial rotary too), and rotating again gives the module's own output."""
    pre = mx.random.normal((1, 2, 300, D), key=mx.random.key(0)) * 3
    rope = nn.RoPE(dims, traditional=traditional, base=BASE)
    cache = KVQuantCache(rope=rope)
    post = rope(pre, offset=7)
    back = cache._rotate(post, 7, -1)
    assert float(mx.abs(back - pre).max()) < 2e-5
    assert float(mx.abs(cache._rotate(back, 7, 1) - post).max()) < 2e-5


def test_kmeans_by_prefix_sums_equals_the_plain_assign_and_average_form():
    rng = np.random.default_rng(3)
    groups = [np.clip(rng.standard_normal(n) * 0.5, -1, 1) for n in (1, 5, 100, 3000)] + [rng.random(400) ** 3]
    for bits in (2, 3, 4):
        for got, x in zip(kmeans_1d(groups, 2**bits), groups):
            np.testing.assert_allclose(got, np_kmeans(x, 2**bits), atol=1e-12)
            assert np.all(np.diff(got) >= -1e-12)  # ascending (equal where a group has fewer entries than codes)


@pytest.mark.parametrize("key_bits, value_bits, codebook, residual",
                         [(2, 2, "layer", 0), (3, 3, "layer", 0), (4, 4, "layer", 0), (4, 2, "channel", 0),
                          (3, 3, "channel", 8)])
def test_calibration_and_codes_match_the_numpy_reference(key_bits, value_bits, codebook, residual):
    """Calibrated on the prompt's non-sink tokens (pre-RoPE keys recovered from the post-RoPE ones),
    every later token coded with the same thresholds and codebooks: the keys (rotated at their
    positions), values, codebooks and sparse outliers equal the plain NumPy pipeline's."""
    n_sink, prompt, T = 1, 48, 56
    cache, pre, v, _ = filled(T, prompt, key_bits, value_bits, 0.01, residual, n_sink, codebook)
    calib = slice(n_sink, prompt)  # every non-sink token of the prompt's call, its residual included
    coded = slice(n_sink, T - residual)
    keys, values, k_out, k_book, v_book, tie = np_kvquant(
        pre[:, :, calib].astype(np.float64), v[:, :, calib].astype(np.float64), pre[:, :, coded].astype(np.float64),
        v[:, :, coded].astype(np.float64), key_bits, value_bits, 0.01, codebook)
    np.testing.assert_allclose(np.array(cache.calib["k_book"]), k_book, atol=2e-3)
    np.testing.assert_allclose(np.array(cache.calib["v_book"]), v_book, atol=2e-3)
    assert cache.n_coded == T - residual - n_sink and int(cache.k_out_index.size) == int(k_out.sum())
    got_pre, got_v = cache.dequantize_coded()
    assert tie.mean() < 2e-3  # a near-tie between two codes: float32 and float64 may each pick either
    np.testing.assert_allclose(np.array(got_pre)[~tie], keys[~tie], atol=2e-3)
    np.testing.assert_allclose(np.array(got_v)[~tie], values[~tie], atol=2e-3)
    # what attention sees: sink and residual as they came, coded keys rotated at their positions
    all_keys, all_values = cache.dequantized()
    expected = np.concatenate([np_rope(pre[:, :, :n_sink]), np_rope(keys, n_sink),
                               np_rope(pre[:, :, T - residual :], T - residual)], 2)
    exact = np.ones(expected.shape, bool)
    exact[:, :, coded] = ~tie.any(-1, keepdims=True)  # RoPE mixes a tied entry into its pair: leave the token out
    np.testing.assert_allclose(np.array(all_keys)[exact], expected[exact], atol=3e-3)
    np.testing.assert_allclose(np.array(all_values[:, :, coded])[~tie], values[~tie], atol=2e-3)
    np.testing.assert_array_equal(np.array(all_values[:, :, :n_sink]), v[:, :, :n_sink])


def test_outliers_are_the_papers_share_and_kept_exactly_in_float16():
    """On a long prompt, per-channel thresholds at the 0.5% / 99.5% quantiles leave ~1% of the key
    entries sparse; each value vector keeps its largest and smallest entry (ceil(0.005 * 64) each).
    Outliers come back as their float16 values; the dense part is within its codes' reach."""
    cache, pre, v, _ = filled(T=1201, prompt=1201, key_bits=4, value_bits=4)
    share = int(cache.k_out_index.size) / (1200 * H * D)
    assert 0.009 < share < 0.012, share
    assert cache.rows["v_out_channels"].shape[-1] == 2
    keys, values = (np.array(a) for a in cache.dequantize_coded())
    index = np.array(cache.k_out_index)
    token_major = pre[:, :, 1:].transpose(2, 0, 1, 3).reshape(-1)
    np.testing.assert_array_equal(keys.transpose(2, 0, 1, 3).reshape(-1)[index], token_major[index].astype(np.float16))
    assert np.all(values.max(-1) == v[:, :, 1:].max(-1).astype(np.float16))
    assert np.all(values.min(-1) == v[:, :, 1:].min(-1).astype(np.float16))
    # no outliers: every entry coded (out-of-range ones clipped to the extreme codes)
    plain, _, _, _ = filled(T=60, prompt=48, fraction=0.0)
    assert int(plain.k_out_index.size) == 0 and plain.rows["v_out_channels"].shape[-1] == 0


@pytest.mark.parametrize("residual, n_sink", [(0, 1), (8, 4), (0, 0)])
def test_attention_equals_the_reference_over_what_the_cache_holds(residual, n_sink):
    cache, _, _, _ = filled(residual=residual, n_sink=n_sink)
    keys, values = cache.dequantized()
    q = mx.random.normal((1, 6, 5, D), key=mx.random.key(9))
    for mask in ("causal", None):
        out = cache.attention(q, cache, cache, 0.125, mask)
        assert float(mx.abs(out - reference_attention(q, keys, values, 0.125, mask)).max()) < 1e-4
    # a call's own tokens attend exactly: a 3-token chunk over what is held and itself
    k_new = mx.random.normal((1, 2, 3, D), key=mx.random.key(11))
    v_new = mx.random.normal((1, 2, 3, D), key=mx.random.key(12))
    cache.update_and_fetch(k_new, v_new)
    after_k, after_v = cache.dequantized()  # the chunk is held for later calls
    assert after_k.shape[2] == 59 and cache.offset == 59
    # tokens held before keep what they stood for, except those this call pushed out of the residual
    kept = 56 - residual
    assert mx.array_equal(after_k[:, :, :kept], keys[:, :, :kept])
    assert mx.array_equal(after_v[:, :, :kept], values[:, :, :kept])
    out = cache.attention(q[:, :, :3], cache, cache, 0.125, "causal")
    ref = reference_attention(q[:, :, :3], mx.concatenate([after_k[:, :, :56], k_new], axis=2),
                              mx.concatenate([after_v[:, :, :56], v_new], axis=2), 0.125, "causal")
    assert float(mx.abs(out - ref).max()) < 1e-4
    keys, values = after_k, after_v
    sinks = mx.array([0.5, -1.0, 2.0, 0.0, 1.0, -0.5])  # GPT-OSS's extra logit per query head
    out = cache.attention(q[:, :, -1:], cache, cache, 0.125, None, sinks)
    ref = reference_attention(q[:, :, -1:], keys, values, 0.125, None, sinks)
    assert float(mx.abs(out - ref).max()) < 1e-4


def test_resident_bytes_are_codes_scales_codebooks_outliers_sinks_and_residual():
    cache, _, _, _ = filled(T=300, prompt=260, key_bits=3, value_bits=2, residual=8, n_sink=1, codebook="layer")
    n = 300 - 8 - 1
    per_token_head = 64 * 3 // 8 + 64 * 2 // 8 + 2 + 2 + 2 * (1 + 2)  # key codes, value codes, value zero/half, 2 outliers
    calibration = 2 * H * D * 2 + 2 * (8 + 4)  # key zero/half per channel; the two codebooks (float16)
    key_outliers = int(cache.k_out_index.size) * (4 + 2)
    full_precision = (1 + 8) * H * D * 4 * 2  # sink and residual keys and values, float32
    assert cache.live_kv_bytes == B * H * n * per_token_head + calibration + key_outliers + full_precision
    assert cache.rows["k_codes"].shape[2] > n  # decoding allocates rows ahead; they hold no token
    channel, _, _, _ = filled(T=300, prompt=260, key_bits=3, value_bits=2, residual=8, codebook="channel")
    assert channel.live_kv_bytes - int(channel.k_out_index.size) * 6 == (
        cache.live_kv_bytes - key_outliers + H * D * (8 + 4) * 2 - 2 * (8 + 4))


def test_config_validates_and_saves_and_loads(tmp_path):
    for params, fragment in (({"bits": 5}, "kvquant.bits: expected one of 2, 3, 4"),
                             ({"outlier_fraction": 0.6}, "kvquant.outlier_fraction: expected a number in [0, 0.5)"),
                             ({"residual": -1}, "kvquant.residual"), ({"n_sink": 1.5}, "kvquant.n_sink"),
                             ({"codebook": "token"}, "kvquant.codebook: expected one of 'layer', 'channel'")):
        with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
            method_config("kvquant", **params)
    assert method_config("kvquant").label() == "kvquant bits=3"
    cache, _, _, _ = filled(residual=4, n_sink=2)
    save_prompt_cache(str(tmp_path / "c.safetensors"), [cache])
    (loaded,) = kvcompress.load_prompt_cache(str(tmp_path / "c.safetensors"))
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(3))
    with pytest.raises(RuntimeError, match="needs the model's RoPE"):
        loaded.attention(q, None, None, 0.125, None)
    loaded.rope = cache.rope  # what kvcompress.load_prompt_cache(path, model) gives back
    assert mx.array_equal(loaded.attention(q, None, None, 0.125, None), cache.attention(q, None, None, 0.125, None))
    assert loaded.live_kv_bytes == cache.live_kv_bytes and loaded.offset == cache.offset


def test_a_deep_copy_continues_as_the_original():
    """The runner copies a compressed cache (copy.deepcopy) to answer several ways from one prompt."""
    cache, _, _, _ = filled(residual=4)
    twin = copy.deepcopy(cache)
    k, v = mx.random.normal((1, 2, 1, D), key=mx.random.key(5)), mx.random.normal((1, 2, 1, D), key=mx.random.key(6))
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(7))
    outs = []
    for c in (cache, twin):
        c.update_and_fetch(k, v)
        outs.append(c.attention(q, c, c, 0.125, None))
    assert mx.array_equal(*outs) and twin.live_kv_bytes == cache.live_kv_bytes and twin.dtype == mx.float32


@pytest.mark.slow
def test_kvquant_on_the_embedded_model_tracks_the_full_cache_closer_than_kivi(embedded):
    """KL(full || method) of the next token after a 250-token prompt held compressed (the protocol of
    TurboQuant's figures in docs/methods.md). KIVI keeps its last 128 tokens in full precision by
    default; here both hold every prompt token but the sink as codes (KIVI residual=32, the least)."""
    def kl(method, **params):
        return next_token_kl(*embedded, method, **params)

    kvquant = {bits: kl("kvquant", bits=bits) for bits in (3, 4)}
    kivi = {bits: kl("kivi", bits=bits, residual=32) for bits in (3, 4)}
    assert kvquant[4] < kvquant[3] < 0.1, kvquant
    assert kvquant[3] < kivi[3], (kvquant, kivi)
