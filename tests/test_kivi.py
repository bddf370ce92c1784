"""KIVI with packed storage (kvcompress/methods/quantization/kivi.py): config, group-aligned flushes, attention on
codes, masks, trim, save/load, measured memory, drop-in generation and 8-bit quality on the
embedded model."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)

import gc

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.models import llama
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from kvcompress.attention import reference_attention
from kvcompress.embedded import essays_dir
from kvcompress.methods import REGISTRY, method_config
from kvcompress.errors import ConfigError
from kvcompress.methods.quantization.kivi import Kivi, KiviCache


def kv(T, H=2, D=64, seed=0, dtype=mx.float32):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((1, H, T, D), key=k1).astype(dtype), mx.random.normal((1, H, T, D), key=k2).astype(dtype)


def fill(cache, keys, values, chunks):
    """Feed keys/values [B, H, T, D] in chunks of the given sizes (must sum to T)."""
    start = 0
    for n in chunks:
        cache.update_and_fetch(keys[:, :, start : start + n], values[:, :, start : start + n])
        start += n
    assert start == keys.shape[2]
    return cache


def dequantized_view(cache, view):
    """Keys/values [B, H, T, D] of an attention view, dequantized here with mx.dequantize directly."""
    keys, values = view
    G, kb, vb = cache.group_size, cache.key_bits, cache.value_bits
    k, v = [keys.residual], [values.residual]
    if keys.n_packed:
        codes, scales, zeros = keys.packed
        n = keys.n_packed
        k.insert(0, mx.dequantize(codes[..., : n * kb // 32], scales[..., : n // G], zeros[..., : n // G],
                                  group_size=G, bits=kb).swapaxes(-1, -2))
    if values.n_packed:
        n = values.n_packed
        v.insert(0, mx.dequantize(*(a[:, :, :n] for a in values.packed), group_size=G, bits=vb))
    return mx.concatenate(k, axis=2), mx.concatenate(v, axis=2)


def tiny_llama(head_dim=64):
    args = llama.ModelArgs(
        model_type="llama", hidden_size=192, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128, head_dim=head_dim,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


# --- config -------------------------------------------------------------------------------------


def test_config_validation_names_the_field():
    for params, field in [
        ({"bits": 5}, "kivi.bits"), ({"key_bits": 6}, "kivi.key_bits"), ({"value_bits": 1}, "kivi.value_bits"),
        ({"group_size": 16}, "kivi.group_size"), ({"residual": -1}, "kivi.residual"), ({"residual": 1.5}, "kivi.residual"),
        ({"residual": 100}, "kivi.residual: expected a positive multiple of group_size"),
        ({"residual": 0}, "kivi.residual: expected a positive multiple of group_size"),
        ({"residual_policy": "fifo"}, "kivi.residual_policy"),
    ]:
        with pytest.raises(ConfigError, match=field):
            Kivi(**params)
    with pytest.raises(ConfigError, match="kivi.group_size: expected a divisor of the model's head_dim 64"):
        Kivi(group_size=128).make_cache(tiny_llama())
    assert REGISTRY["kivi"] is Kivi
    Kivi(residual=100, residual_policy="grouped")  # any residual with the grouped policy
    assert Kivi(residual_policy="grouped").label() == "kivi bits=2 residual_policy=grouped"


def test_grid_columns_and_bits():
    assert Kivi().grid_columns() == {"budget": None, "bits": 2.0, "tau_init": None, "tau_end": None}
    k4v2 = method_config("kivi", key_bits=4, value_bits=2)
    assert k4v2.grid_columns()["bits"] == 3.0
    cache = k4v2.make_cache(tiny_llama())
    c = cache[0]
    assert len(cache) == 2 and (c.key_bits, c.value_bits, c.group_size, c.residual, c.residual_policy) == (4, 2, 32, 128, "paper")


# --- flush semantics ----------------------------------------------------------------------------


def full_precision_counts(R, G, T, policy):
    """(keys, values) in full precision after T tokens: the paper's Algorithm 1, or the grouped policy."""
    if policy == "paper":
        return T % R, min(T, R)
    held = T - max(0, T - R) // G * G
    return held, held


@pytest.mark.parametrize("policy,R", [("paper", 32), ("paper", 64), ("grouped", 32), ("grouped", 40)])
def test_full_precision_counts_follow_the_policy_for_every_length(policy, R):
    # T = 1..3R, token by token, and each T also as one prefill
    G = 32
    keys, values = kv(3 * R, H=1, D=32, seed=11)
    by_token = KiviCache(2, 2, G, R, policy)
    for T in range(1, 3 * R + 1):
        by_token.update_and_fetch(keys[:, :, T - 1 : T], values[:, :, T - 1 : T])
        one_shot = fill(KiviCache(2, 2, G, R, policy), keys[:, :, :T], values[:, :, :T], [T])
        want = full_precision_counts(R, G, T, policy)
        for cache in (by_token, one_shot):
            assert (cache.keys.shape[2], cache.values.shape[2]) == want, (T, want)
            assert (cache.n_keys_quantized, cache.n_values_quantized) == (T - want[0], T - want[1])
            assert cache.offset == T and cache.n_keys_quantized % G == 0


@pytest.mark.parametrize("policy,residual", [("paper", 32), ("paper", 128), ("grouped", 0), ("grouped", 64), ("grouped", 100)])
def test_one_shot_and_token_by_token_quantize_identically(policy, residual):
    keys, values = kv(300, seed=1)
    one_shot = fill(KiviCache(4, 2, 32, residual, policy), keys, values, [300])
    by_token = fill(KiviCache(4, 2, 32, residual, policy), keys, values, [1] * 300)
    chunked = fill(KiviCache(4, 2, 32, residual, policy), keys, values, [7, 50, 1, 1, 90, 151])
    res_k, res_v = full_precision_counts(residual, 32, 300, policy)
    for cache in (one_shot, by_token, chunked):
        assert cache.offset == 300 and (cache.keys.shape[2], cache.values.shape[2]) == (res_k, res_v)
        for a, b in zip(cache.state[:8], one_shot.state[:8]):
            assert mx.array_equal(a, b).item()  # codes, scales, zeros and residual, bit for bit
    # the residual is the exact recent input, in full precision
    assert mx.array_equal(one_shot.keys, keys[:, :, 300 - res_k :]).item()
    assert mx.array_equal(one_shot.values, values[:, :, 300 - res_v :]).item()


def test_decode_writes_value_rows_in_place():
    keys, values = kv(400, H=2, seed=12)
    cache = fill(KiviCache(2, 2, 32, 128), keys[:, :, :300], values[:, :, :300], [300])
    assert cache.values_packed[0].shape[2] == 172  # a prefill allocates exactly
    fill(cache, keys[:, :, 300:], values[:, :, 300:], [1] * 100)
    assert cache.n_values_quantized == 272 and cache.values_packed[0].shape[2] == 172 + 1 + 256
    ref = fill(KiviCache(2, 2, 32, 128), keys, values, [400])
    for a, b in zip(cache.state[:8], ref.state[:8]):
        assert mx.array_equal(a, b).item()


def test_packed_shapes_and_dtypes():
    keys, values = kv(200, H=3, D=64, dtype=mx.float16)
    cache = fill(KiviCache(2, 4, 32, 64), keys, values, [200])  # keys: 192 codes, values: 136
    (kc, ks, kz), (vc, vs, vz) = cache.keys_packed, cache.values_packed
    assert kc.shape == (1, 3, 64, 192 * 2 // 32) and kc.dtype == mx.uint32  # K^T packed along tokens
    assert ks.shape == kz.shape == (1, 3, 64, 6) and ks.dtype == mx.float16
    assert vc.shape == (1, 3, 136, 64 * 4 // 32) and vs.shape == (1, 3, 136, 2)  # V packed along channels
    assert cache.keys.shape == (1, 3, 8, 64) and cache.values.shape == (1, 3, 64, 64)
    assert cache.keys.dtype == mx.float16


# --- attention on codes -------------------------------------------------------------------------


@pytest.mark.parametrize("kb,vb,policy", [(2, 2, "paper"), (4, 2, "paper"), (3, 3, "paper"), (8, 8, "grouped")])
def test_packed_attention_equals_dequantize_then_attend(kb, vb, policy):
    keys, values = kv(264, H=2, seed=2)
    cache = fill(KiviCache(kb, vb, 32, 64, policy), keys[:, :, :256], values[:, :, :256], [200, 56])
    q = mx.random.normal((1, 6, 8, 64), key=mx.random.key(3))  # GQA: 3 query heads per kv head
    # a prefill chunk of 8 tokens, causal (string and array forms), then a decode step
    view = cache.update_and_fetch(keys[:, :, 256:264], values[:, :, 256:264])
    k_ref, v_ref = dequantized_view(cache, view)
    assert k_ref.shape[2] == 264
    for mask in ("causal", create_causal_mask(8, 256), mx.where(create_causal_mask(8, 256), 0.0, -1e9)):
        out = cache.attention(q, *view, scale=0.125, mask=mask)
        ref = reference_attention(q, k_ref, v_ref, 0.125, mask)
        assert mx.allclose(out, ref, atol=2e-5, rtol=1e-4).item()
    k1, v1 = kv(1, H=2, seed=4)
    view = cache.update_and_fetch(k1, v1)
    assert view[0].n_packed + view[0].residual.shape[2] == 265  # a decode step sees the cache after its flush
    out = cache.attention(q[:, :, :1], *view, scale=0.125, mask=None)
    ref = reference_attention(q[:, :, :1], *dequantized_view(cache, view), 0.125, None)
    assert mx.allclose(out, ref, atol=2e-5, rtol=1e-4).item()
    # two query positions (speculative decoding): 6 rows per KV head, causal
    k2, v2 = kv(2, H=2, seed=9)
    view = cache.update_and_fetch(k2[:, :, :1], v2[:, :, :1])
    view = cache.update_and_fetch(k2[:, :, 1:], v2[:, :, 1:])
    out = cache.attention(q[:, :, :2], *view, scale=0.125, mask="causal")
    ref = reference_attention(q[:, :, :2], *dequantized_view(cache, view), 0.125, "causal")
    assert mx.allclose(out, ref, atol=2e-5, rtol=1e-4).item()
    # and quantization really changed the keys the queries saw (the test can fail)
    full = reference_attention(q[:, :, :1], mx.concatenate([keys, k1], 2), mx.concatenate([values, v1], 2), 0.125, None)
    assert mx.abs(out - full).max().item() > 1e-4


def test_make_mask_matches_offset():
    cache = fill(KiviCache(2, 2, 32, 32), *kv(100), [100])
    assert cache.make_mask(1) is None and cache.make_mask(5) == "causal"
    assert mx.array_equal(cache.make_mask(5, return_array=True), create_causal_mask(5, 100)).item()


# --- trim, state --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["paper", "grouped"])
@pytest.mark.parametrize("n", [20, 100, 300])
def test_trim_keeps_exact_prefix_and_the_policy_split(n, policy):
    keys, values = kv(300, seed=5)
    cache = fill(KiviCache(2, 2, 32, 64, policy), keys, values, [300])
    before_k, before_v = cache.dequantized()
    assert cache.trim(n) == n and cache.offset == 300 - n == cache.tokens_kept
    after_k, after_v = cache.dequantized()
    assert mx.array_equal(after_k, before_k[:, :, : 300 - n]).item()
    assert mx.array_equal(after_v, before_v[:, :, : 300 - n]).item()
    targets = cache.quantized_targets(300 - n)
    assert (cache.n_keys_quantized, cache.n_values_quantized) == targets and cache.n_keys_quantized % 32 == 0
    fill(cache, keys[:, :, 300 - n :], values[:, :, 300 - n :], [n])  # refill: the split of 300 tokens again
    assert cache.offset == 300 and (cache.n_keys_quantized, cache.n_values_quantized) == cache.quantized_targets(300)


def test_state_round_trips_through_prompt_cache_files(tmp_path):
    keys, values = kv(300, seed=6)
    caches = [fill(KiviCache(4, 2, 32, 128), keys, values, [300]), fill(KiviCache(2, 8, 64, 128), keys[:, :, :10], values[:, :, :10], [10]),
              fill(KiviCache(2, 2, 32, 40, "grouped"), keys, values, [299, 1])]
    path = str(tmp_path / "kivi.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    for a, b in zip(caches, loaded):
        assert type(b) is KiviCache and a.meta_state == b.meta_state
        assert (a.n_keys_quantized, a.n_values_quantized) == (b.n_keys_quantized, b.n_values_quantized)
        for x, y in zip(a.state, b.state):
            assert (x is None and y is None) or (mx.array_equal(x, y).item() if isinstance(x, mx.array) else x == y)
    k1, v1 = kv(1, seed=7)
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(8))
    outs = [c.attention(q, *c.update_and_fetch(k1, v1), scale=0.125, mask=None) for c in (caches[0], loaded[0])]
    assert mx.array_equal(*outs).item()


# --- memory: measured, not accounted ------------------------------------------------------------


def _build_measured(cache, T, H, D, dtype):
    """(live_kv_bytes, active-memory delta) after compressing a T-token prefill into `cache`."""
    gc.collect()
    # an empty allocator cache: a reused cached buffer may be larger than the array it holds
    mx.clear_cache()
    start = mx.get_active_memory()
    keys, values = kv(T, H=H, D=D, seed=9, dtype=dtype)
    if isinstance(cache, KVCache):
        cache.update_and_fetch(keys, values)
        arrays = cache.keys_and_values()
    else:
        cache.from_prefill(keys, values, None)
        arrays = cache.state[:8]
    mx.eval(arrays)
    del keys, values, arrays
    gc.collect()
    return mx.get_active_memory() - start


@pytest.mark.parametrize("bits,dtype,min_ratio", [(2, mx.float16, 4.5), (4, mx.float16, 2.9), (2, mx.float32, 6.0)])
def test_live_bytes_are_measured_and_small(bits, dtype, min_ratio):
    # one layer of the embedded model (3 kv heads, head_dim 64) at 4096 tokens, G = 32, R = 128
    T, H, D = 4096, 3, 64
    cache = KiviCache(bits, bits, 32, 128)
    delta = _build_measured(cache, T, H, D, dtype)
    arrays = [a for a in cache.state[:8] if a is not None]
    assert cache.live_kv_bytes == sum(a.nbytes for a in arrays)
    assert abs(delta - cache.live_kv_bytes) <= 0.02 * cache.live_kv_bytes + 16384  # MLX's own counter agrees
    full_bytes = 2 * T * H * D * dtype.size
    assert full_bytes / cache.live_kv_bytes >= min_ratio


def test_full_cache_measured_the_same_way():
    # control for the procedure above: a full cache (1024 tokens, a whole number of its 256-token
    # allocation steps) measures at exactly its two arrays' bytes
    delta = _build_measured(KVCache(), 1024, 3, 64, mx.float32)
    assert abs(delta - 2 * 1024 * 3 * 64 * 4) <= 16384


# --- real models ---------------------------------------------------------------------------------


def test_drop_in_generation_on_random_llama():
    model = tiny_llama()
    prompt = mx.array([i % 128 for i in range(150)])
    caches = kvcompress.make_cache(model, "kivi", bits=4, residual=32)
    from mlx_lm.generate import generate_step

    steps = list(generate_step(prompt, model, prompt_cache=caches, max_tokens=40))
    full = list(generate_step(prompt, model, prompt_cache=[KVCache() for _ in model.layers], max_tokens=2))
    # generate_step prefills prompt[:-1] first, so the last prompt token already sees 4-bit codes
    gap = mx.abs(steps[0][1] - full[0][1]).max().item()
    assert 0 < gap < 0.5
    offset = caches[0].offset  # generate_step runs one step ahead: 189 or 190
    assert len(steps) == 40 and offset in (189, 190)
    assert (caches[0].n_keys_quantized, caches[0].n_values_quantized) == (offset - offset % 32, offset - 32)
    assert caches[0].live_kv_bytes < 2 * offset * 2 * 64 * 4 / 2


@pytest.fixture(scope="module")
def embedded():
    return kvcompress.load_model("smollm2-135m")


def test_stream_generate_drop_in_on_embedded_model(embedded):
    model, tokenizer = embedded
    text = (essays_dir() / "avg.txt").read_text()[:1500] + "\n\nIn one sentence, the essay says"
    caches = kvcompress.make_cache(model, "kivi", bits=4, residual=64)
    out = list(mlx_lm.stream_generate(model, tokenizer, text, max_tokens=8, prompt_cache=caches))
    assert len(out) == 8 and caches[0].n_keys_quantized > 0 and caches[0].live_kv_bytes > 0


def test_kivi8_is_near_lossless_on_embedded_model(embedded):
    """Mean per-step KL(full || KIVI-8) over 64 teacher-forced decode steps after a 512-token prompt."""
    model, tokenizer = embedded
    tokens = tokenizer.encode((essays_dir() / "avg.txt").read_text())[: 512 + 64]
    full = [KVCache() for _ in model.layers]
    kvcompress.make_cache(model, "full")  # installs the attention hook
    logits = model(mx.array(tokens[:512])[None], cache=full)
    mx.eval(logits)
    kivi = Kivi(bits=8).make_cache(model)
    for cache, f in zip(kivi, full):
        cache.from_prefill(*f.keys_and_values(), None)
    assert (kivi[0].n_keys_quantized, kivi[0].n_values_quantized) == (512, 384)
    kls = []
    for t in tokens[512:]:
        x = mx.array([[t]])
        p = model(x, cache=full)[0, -1].astype(mx.float32)
        q = model(x, cache=kivi)[0, -1].astype(mx.float32)
        lp, lq = nn.log_softmax(p), nn.log_softmax(q)
        kls.append(mx.sum(mx.exp(lp) * (lp - lq)).item())
    mean_kl = sum(kls) / len(kls)
    assert 0 < mean_kl < 1e-3, mean_kl


# --- the decode step's own path (host cost: kvcompress/methods/quantization/kivi.py update_and_fetch) ---------


def _same_state(a, b):
    assert (a.offset, a.n_keys_quantized, a.n_values_quantized) == (b.offset, b.n_keys_quantized, b.n_values_quantized)
    for x, y in zip(a.state[:8], b.state[:8]):
        assert (x is None and y is None) or mx.array_equal(x, y).item()


@pytest.mark.parametrize("kb,vb,policy,residual", [(2, 2, "paper", 64), (4, 2, "paper", 32), (2, 4, "grouped", 40),
                                                   (4, 4, "grouped", 0)])
def test_decode_steps_equal_a_cache_built_from_scratch(kb, vb, policy, residual):
    """Token by token after a prefill (value flushes every step, key flushes every R steps): each
    step's attention output and dequantized() are bit for bit those of a cache given the same tokens
    in one chunk."""
    T0, steps = 150, 140
    keys, values = kv(T0 + steps, H=2, seed=21)
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(22))
    cache = fill(KiviCache(kb, vb, 32, residual, policy), keys[:, :, :T0], values[:, :, :T0], [T0])
    for t in range(T0 + 1, T0 + steps + 1):
        view = cache.update_and_fetch(keys[:, :, t - 1 : t], values[:, :, t - 1 : t])
        out = cache.attention(q, *view, scale=0.125, mask=None)
        if t % 11 and t % 32 not in (0, 1) and t != T0 + steps:  # check every 11th step and at flushes
            mx.eval(out, cache.state[:8])
            continue
        ref = fill(KiviCache(kb, vb, 32, residual, policy), keys[:, :, :t], values[:, :, :t], [t])
        _same_state(cache, ref)
        assert mx.array_equal(out, ref.attention(q, *ref._sides(), scale=0.125, mask=None)).item(), t
        for a, b in zip(cache.dequantized(), ref.dequantized()):
            assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("policy", ["paper", "grouped"])
def test_decode_after_trim_and_reload_equals_the_chunk_path(policy):
    keys, values = kv(330, H=2, seed=23)
    cache = fill(KiviCache(2, 2, 32, 64, policy), keys[:, :, :250], values[:, :, :250], [200] + [1] * 50)
    reloaded = KiviCache(2, 2, 32, 64, policy)  # restored mid-decode (codes written ahead are not saved)
    reloaded.state, reloaded.meta_state = cache.state, cache.meta_state
    for c in (cache, reloaded):
        fill(c, keys[:, :, 250:290], values[:, :, 250:290], [1] * 40)
    _same_state(cache, reloaded)
    assert cache.trim(47) == 47 and cache.offset == 243
    chunked = KiviCache(2, 2, 32, 64, policy)
    chunked.state, chunked.meta_state = cache.state, cache.meta_state  # as load_prompt_cache restores
    fill(cache, keys[:, :, 243:330], values[:, :, 243:330], [1] * 87)  # decode steps
    fill(chunked, keys[:, :, 243:330], values[:, :, 243:330], [87])  # one chunk: the general path
    _same_state(cache, chunked)
    q = mx.random.normal((1, 6, 1, 64), key=mx.random.key(24))
    k1, v1 = kv(1, H=2, seed=25)
    outs = [c.attention(q, *c.update_and_fetch(k1, v1), scale=0.125, mask=None) for c in (cache, chunked)]
    assert mx.array_equal(*outs).item()


@pytest.mark.parametrize("policy,residual", [("paper", 32), ("paper", 128), ("grouped", 32)])
def test_values_coded_ahead_leave_memory_and_results_as_before(policy, residual):
    """Decode quantizes held residual values ahead into the value buffer's spare rows (kivi.py
    `_code_ahead`); the buffer still grows exactly when and as it did when each value was quantized
    on leaving the residual (live_kv_bytes unchanged), and the state stays bit for bit that of a
    cache built from scratch, across several growths."""
    T0, steps = 40, 700
    keys, values = kv(T0 + steps, H=1, D=32, seed=26)
    cache = fill(KiviCache(2, 2, 32, residual, policy), keys[:, :, :T0], values[:, :, :T0], [T0])
    capacity = cache.n_values_quantized  # a prefill allocates exactly
    for t in range(T0 + 1, T0 + steps + 1):
        cache.update_and_fetch(keys[:, :, t - 1 : t], values[:, :, t - 1 : t])
        target_v = cache.quantized_targets(t)[1]
        if target_v > capacity:  # as the buffer grew before: the leaving values plus VALUE_ROWS_STEP spare
            capacity = target_v + (256 if capacity else 0)
        got = 0 if cache.values_packed is None else cache.values_packed[0].shape[2]
        assert got == capacity, t
        assert cache.n_values_quantized <= cache.n_values_coded <= max(capacity, cache.n_values_quantized)
        if t % 97 == 0 or t == T0 + steps:
            _same_state(cache, fill(KiviCache(2, 2, 32, residual, policy), keys[:, :, :t], values[:, :, :t], [t]))
    if policy == "paper":  # codes really were written ahead (the test can fail)
        assert cache.n_values_coded > cache.n_values_quantized
