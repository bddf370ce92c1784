"""DuoAttention: the on-the-fly head score against a NumPy reference, the head split, pattern files,
attention of both head kinds against plain attention over what each keeps, resident bytes at the
budget with the streaming heads' tokens freed, and a run on the embedded model."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvcompress import load_dataset, make_cache
from kvcompress.errors import ConfigError
from kvcompress.memory import live_kv_bytes
from kvcompress.methods import method_config
from kvcompress.methods.eviction.duoattention import DuoAttentionCache, area_scores, on_the_fly_scores
from kvcompress.runner import RunContext, run_sample

BASE = 10000.0


def np_rope(x, positions):
    """Non-traditional RoPE of x [..., L, D] at positions [L] (float64)."""
    D = x.shape[-1]
    angle = np.asarray(positions, np.float64)[:, None] * BASE ** (-np.arange(0, D, 2) / D)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x1 * np.sin(angle) + x2 * np.cos(angle)], axis=-1)


def softmax(x):
    w = np.exp(x - x.max(axis=-1, keepdims=True))
    return w / w.sum(axis=-1, keepdims=True)


def test_area_scores_match_a_numpy_reference():
    rng = np.random.default_rng(0)
    B, H, G, D, L = 2, 3, 2, 16, 50
    q = rng.standard_normal((B, H * G, D)).astype(np.float32)
    k = rng.standard_normal((B, H, D)).astype(np.float32)
    got = np.array(area_scores(mx.array(q), mx.array(k), nn.RoPE(D, base=BASE), D**-0.5, L))
    expected = np.zeros((B, H))
    for b in range(B):
        for h in range(H):
            keys = np_rope(np.repeat(k[b, h][None].astype(np.float64), L, 0), np.arange(L))  # [L, D]
            for g in range(G):
                last = np_rope(q[b, h * G + g][None].astype(np.float64), [L - 1])[0]
                p = softmax(keys @ last * D**-0.5)
                expected[b, h] += np.cumsum(p).mean() / G
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    # no RoPE: every key is the same vector, so attention is uniform: the area is (L + 1) / (2 L)
    flat = np.array(area_scores(mx.array(q), mx.array(k), None, D**-0.5, L))
    np.testing.assert_allclose(flat, (L + 1) / (2 * L), rtol=1e-5)


def test_streaming_heads_are_the_lowest_scores_over_all_layers_at_the_budgets_share():
    cfg = method_config("duoattention", budget=0.25, n_sink=4, recent=28)
    scores = [np.array([0.9, 0.1, 0.5]), np.array([0.2, 0.8, 0.3]), np.array([0.7, 0.05, 0.6])]
    T = 512  # C = 128, W = 32: s = 384 / 480 = 0.8 of 9 heads -> 7 stream
    got = np.concatenate(cfg.streaming_heads(scores, T))
    flat = np.concatenate(scores)
    assert got.sum() == round(0.8 * 9) == 7
    assert set(np.nonzero(got)[0]) == set(np.argsort(flat)[:7])
    assert not np.concatenate(method_config("duoattention", budget=600, n_sink=4, recent=28)
                              .streaming_heads(scores, T)).any()  # a budget above the prompt: all retrieve


def test_pattern_files_load_clipped_and_a_wrong_shape_is_refused(tiny_llama, tmp_path):
    # tiny_llama: 3 layers x 2 KV heads
    scores = np.array([[0.9, -0.2], [1.3, 0.4], [0.1, 0.6]])
    tsv, npy, js = tmp_path / "heads.tsv", tmp_path / "heads.npy", tmp_path / "heads.json"
    np.savetxt(tsv, scores, delimiter="\t")
    np.save(npy, scores)
    js.write_text(json.dumps(scores.tolist()))
    for path in (tsv, npy, js):
        caches = make_cache(tiny_llama, "duoattention", budget=0.5, n_sink=2, recent=6, pattern=str(path))
        np.testing.assert_allclose(np.stack(caches[0].scores), np.clip(scores, 0, 1))
    np.save(npy, scores[:2])
    with pytest.raises(ConfigError, match=r"duoattention\.pattern: .*shape .*\[3, 2\].*got shape \[2, 2\]"):
        make_cache(tiny_llama, "duoattention", budget=0.5, n_sink=2, recent=6, pattern=str(npy))
    with pytest.raises(ConfigError, match=r"duoattention\.pattern: expected an existing file"):
        method_config("duoattention", pattern=str(tmp_path / "missing.tsv"))
    with pytest.raises(ConfigError, match=r"duoattention\.pattern"):
        method_config("duoattention", pattern="heads.csv")
    with pytest.raises(ConfigError, match=r"duoattention\.recent"):
        method_config("duoattention", recent=0)
    with pytest.raises(ConfigError, match=r"duoattention\.budget.*128 \+ 256"):
        method_config("duoattention", budget=300)


def test_on_the_fly_scores_are_seeded_and_cached(tiny_llama):
    from kvcompress.adapter import model_layout

    targets = model_layout(tiny_llama).global_layers
    first = on_the_fly_scores(tiny_llama, targets)
    assert on_the_fly_scores(tiny_llama, targets) is first  # once per model
    assert [s.shape for s in first] == [(2,)] * 3 and all(np.isfinite(s).all() for s in first)


def _layer(H=4, G=2, D=8, n_sink=2, recent=5, budget=0.5, streams=(True, False, True, True)):
    cfg = method_config("duoattention", budget=budget, n_sink=n_sink, recent=recent)
    # scores that make exactly `streams` stream at this budget's share (checked below)
    scores = [np.array([0.0 if s else 1.0 for s in streams])]
    return cfg, DuoAttentionCache(cfg, scores, 0, H * G, H, D, nn.RoPE(D, base=BASE), D**-0.5)


def test_attention_of_each_head_kind_is_plain_attention_over_what_it_keeps():
    B, H, G, D, T, steps, n_sink, recent = 2, 4, 2, 8, 24, 12, 2, 5
    cfg, cache = _layer(H, G, D, n_sink, recent, budget=0.5)
    rng = np.random.default_rng(1)
    K = rng.standard_normal((B, H, T + steps, D)).astype(np.float32)
    V = rng.standard_normal((B, H, T + steps, D)).astype(np.float32)
    Q = rng.standard_normal((B, H * G, T + steps, D)).astype(np.float32)

    def feed(start, end):
        keys, values = cache.update_and_fetch(mx.array(K[:, :, start:end]), mx.array(V[:, :, start:end]))
        return np.array(cache.attention(mx.array(Q[:, :, start:end]), keys, values, D**-0.5, None))

    feed(0, 10)  # the prompt in two calls, its last token alone
    feed(10, T - 1)
    feed(T - 1, T)
    streams = cache.streams
    share = (T - 12) / (T - n_sink - recent)  # C = 12 of 24: round(share * 4) = 3 stream
    assert streams.tolist() == [True, False, True, True] and streams.sum() == round(share * H)
    for p in range(T, T + steps):
        out = feed(p, p + 1)
        for b in range(B):
            for qh in range(H * G):
                h = qh // G
                seen = np.arange(p + 1)
                if streams[h]:  # sinks + the `recent` held before this step + the current token
                    seen = seen[(seen < n_sink) | (seen >= p - recent)]
                probs = softmax(K[b, h, seen] @ Q[b, qh, p] * D**-0.5)
                np.testing.assert_allclose(out[b, qh, 0], probs @ V[b, h, seen], atol=1e-5)
    positions = np.array(cache.kept_positions()).reshape(B, H, -1)
    P = 2**31 - 1
    end = T + steps
    for h in range(H):
        held = positions[0, h][positions[0, h] != P]
        expected = list(range(n_sink)) + list(range(end - recent, end)) if streams[h] else list(range(end))
        assert sorted(held.tolist()) == expected


def test_resident_bytes_are_the_budget_and_the_streaming_heads_tokens_are_freed():
    B, H, G, D, T = 1, 30, 1, 64, 512
    for budget in (0.5, 0.25, 0.125, 0.0625):
        cfg = method_config("duoattention", budget=budget, n_sink=4, recent=12)
        scores = [np.random.default_rng(2).random(H)]
        cache = DuoAttentionCache(cfg, scores, 0, H * G, H, D, nn.RoPE(D, base=BASE), D**-0.5)
        rng = np.random.default_rng(3)
        k = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32))
        cache.from_prefill(k, k)
        full = 2 * k.nbytes
        ratio = cache.live_kv_bytes / full
        assert abs(ratio - budget) <= 0.05 * budget, (budget, ratio)
        # what is resident is what the state holds: no copy of the whole prompt stays behind
        held = sum(a.nbytes for a in cache.state if isinstance(a, mx.array))
        assert cache.prompt is None and held == cache.live_kv_bytes
        assert cache.tokens_kept == pytest.approx(budget * T, rel=0.05)


def test_drop_in_decoding_is_lossless_above_the_prompt_and_frees_memory_below(tiny_llama):
    prompt = mx.random.randint(0, 128, (1, 60), key=mx.random.key(4))

    def decode(caches, n=6):
        model = tiny_llama
        logits = model(prompt[:, :-1], cache=caches)
        logits = model(prompt[:, -1:], cache=caches)
        tokens = []
        for _ in range(n):
            token = mx.argmax(logits[:, -1:], axis=-1)
            tokens.append(int(token.item()))
            logits = model(token, cache=caches)
        return tokens

    full = make_cache(tiny_llama, "full")
    assert decode(make_cache(tiny_llama, "duoattention", budget=100, n_sink=2, recent=6)) == decode(full)
    half = make_cache(tiny_llama, "duoattention", budget=0.5, n_sink=2, recent=6)
    decode(half)
    assert any(c.streams.any() for c in half) and live_kv_bytes(half) < live_kv_bytes(full)


def test_the_runner_on_the_embedded_model(embedded):
    model, tokenizer = embedded
    params = {"task": "niah_single_2", "context_tokens": 256, "num_samples": 1, "seed": 0}
    sample = load_dataset("ruler", tokenizer=tokenizer, **params)[0]
    methods = [method_config("full"), method_config("duoattention", budget=0.25, n_sink=4, recent=12)]
    full, duo = run_sample(model, tokenizer, sample, methods, RunContext("smollm2-135m", "fp", "ruler", params, 4))
    assert duo.run["status"] == "ok", duo.run.get("error")
    ratio = duo.run["live_kv_bytes"] / full.run["live_kv_bytes"]
    # 90 KV heads: the streaming share rounds to a head; the streaming heads' scores and positions are resident
    print(f"duoattention 0.25 on the embedded model: live KV bytes / full = {ratio:.4f}")
    assert abs(ratio - 0.25) <= 0.05 * 0.25, ratio
    assert duo.run["config_label"] == "duoattention budget=0.25 n_sink=4 recent=12"
    assert duo.evidence and all(0.0 <= row["kept_mean"] <= 1.0 for row in duo.evidence)


def test_a_cache_saved_before_its_prompt_is_complete_loads_and_continues_the_same(tiny_llama, tmp_path):
    import kvcompress
    from mlx_lm.models.cache import save_prompt_cache

    prompt = mx.random.randint(0, 128, (1, 40), key=mx.random.key(6))
    caches = make_cache(tiny_llama, "duoattention", budget=0.5, n_sink=2, recent=6)
    tiny_llama(prompt[:, :-1], cache=caches)  # the prompt's last token not yet fed: no split yet
    mx.eval([c.state for c in caches])
    assert all(c.streams is None for c in caches)
    path = str(tmp_path / "duo.safetensors")
    save_prompt_cache(path, caches)
    loaded = kvcompress.load_prompt_cache(path, tiny_llama)
    a, b = tiny_llama(prompt[:, -1:], cache=caches), tiny_llama(prompt[:, -1:], cache=loaded)
    for _ in range(4):
        assert mx.array_equal(a, b).item()
        token = mx.argmax(a[:, -1:], axis=-1)
        a, b = tiny_llama(token, cache=caches), tiny_llama(token, cache=loaded)
    assert [c.streams.tolist() for c in loaded] == [c.streams.tolist() for c in caches]
    assert any(c.streams.any() for c in caches)
