"""The decoding wrapper: every N steps the generated tokens are cut to target_size by the scorer's
ranking (checked against plain NumPy scores), so at most target_size + N generated tokens are held;
the prompt keeps what its budget gave it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvcompress import make_cache
from kvcompress.errors import ConfigError
from kvcompress.methods import method_config
from kvcompress.methods.eviction.decoding import DecodingCache

B, H, G, D = 2, 2, 2, 8


def softmax(x):
    w = np.exp(x - x.max(axis=-1, keepdims=True))
    return w / w.sum(axis=-1, keepdims=True)


def keydiff(keys):  # [n, D] -> [n]: minus the cosine to the mean unit key
    unit = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
    anchor = unit.mean(axis=0)
    return -(unit @ (anchor / np.linalg.norm(anchor)))


def knorm(keys):
    return -np.linalg.norm(keys, axis=-1)


class Layer:
    """One DecodingCache fed random post-RoPE keys, values and queries, as mlx-lm's attention calls it."""

    def __init__(self, cfg, seed=0):
        self.cache = DecodingCache(cfg, 0, 1, H, D, nn.RoPE(D), D**-0.5)
        self.rng = np.random.default_rng(seed)
        self.K, self.Q = {}, {}

    def feed(self, start, S=1):
        k = self.rng.standard_normal((B, H, S, D)).astype(np.float32)
        q = self.rng.standard_normal((B, H * G, S, D)).astype(np.float32)
        for i in range(S):
            self.K[start + i], self.Q[start + i] = k[:, :, i], q[:, :, i]
        keys, values = self.cache.update_and_fetch(mx.array(k), mx.array(k))
        self.cache.attention(mx.array(q), keys, values, D**-0.5, None)


@pytest.mark.parametrize("scorer,score", [("keydiff", keydiff), ("knorm", knorm), ("tova", None)])
def test_generated_tokens_are_cut_to_the_target_every_interval_by_the_scorers_ranking(scorer, score):
    T, interval, target = 20, 5, 3
    cfg = method_config("decoding", scorer=scorer, budget=0.5, compression_interval=interval, target_size=target)
    layer = Layer(cfg)
    layer.feed(0, T - 1)
    layer.feed(T - 1)  # the prompt's last token alone completes it: cut to 10 by the scorer
    c = layer.cache
    prompt_kept = [row.tolist() for row in c.kept_rows()]
    assert all(len(row) == 10 for row in prompt_kept) and c.answer_start == T
    held_generated = []
    for p in range(T, T + 4 * interval):
        before = [row.tolist() for row in c.kept_rows()]
        layer.feed(p)
        generated = p + 1 - T
        rows = [row.tolist() for row in c.kept_rows()]
        held_generated.append(len(rows[0]) - 10)
        for r, row in enumerate(rows):
            assert row[:10] == prompt_kept[r]  # the prompt as its budget left it
        if generated % interval:
            continue
        # a compression: every held token scored as the scorer scores a prompt, the best `target` kept
        for r, row in enumerate(rows):
            b, h = divmod(r, H)
            candidates = [q for q in before[r] if q >= T] + [p]
            keys = np.stack([layer.K[q][b, h] for q in before[r] + [p]])
            if scorer == "tova":  # the newest query's attention, averaged over the batch element's heads
                probs = []
                for hh in range(H):
                    held = before[b * H + hh] + [p]
                    hk = np.stack([layer.K[q][b, hh] for q in held])
                    query = [layer.Q[p][b, hh * G + g] for g in range(G)]
                    probs.append(np.mean([softmax(hk @ q * D**-0.5) for q in query], axis=0))
                scores = np.mean(probs, axis=0)
            else:
                scores = score(keys)
            generated_scores = scores[-len(candidates):]
            best = sorted(np.array(candidates)[np.argsort(-generated_scores, kind="stable")[:target]].tolist())
            assert row[10:] == best, (scorer, p, r)
    # at most target + interval generated tokens, down to target at every interval-th step
    assert max(held_generated) == target + interval - 1
    assert held_generated[interval - 1 :: interval] == [target] * 4


def test_drop_in_decoding_holds_at_most_target_plus_interval_generated_tokens(tiny_llama):
    prompt = mx.random.randint(0, 128, (1, 40), key=mx.random.key(4))
    interval, target = 4, 40  # above SnapKV's protected window of 32
    caches = make_cache(tiny_llama, "decoding", scorer="snapkv", compression_interval=interval, target_size=target)
    tiny_llama(prompt[:, :-1], cache=caches)
    logits = tiny_llama(prompt[:, -1:], cache=caches)
    held = []  # generated tokens held after each step (the prompt's 40 are all kept at budget 1.0)
    for _ in range(70):
        logits = tiny_llama(mx.argmax(logits[:, -1:], axis=-1), cache=caches)
        held.append([c.tokens_kept - 40 for c in caches])
    assert all(h == [min(step + 1, h[0])] * 3 for step, h in enumerate(held))  # every layer alike
    counts = [h[0] for h in held]
    assert counts[:target] == list(range(1, target + 1)) and max(counts) == target + interval - 1
    assert all(counts[step] == target for step in range(target, 70) if (step + 1) % interval == 0)
    # resident: the held tokens' keys, values and positions, nothing more (no scores between cuts)
    for c in caches:
        assert c.scores is None and c.live_kv_bytes == (c.keys.nbytes + c.values.nbytes + c.positions.nbytes)
        assert c.keys.shape[1] == c.tokens_kept == 40 + counts[-1]


def test_bad_settings_are_refused_before_any_work():
    with pytest.raises(ConfigError, match=r"decoding\.scorer: expected one of \('snapkv'"):
        method_config("decoding", scorer="h2o")
    with pytest.raises(ConfigError, match=r"decoding\.compression_interval"):
        method_config("decoding", compression_interval=0)
    with pytest.raises(ConfigError, match=r"decoding\.target_size"):
        method_config("decoding", target_size=1.5)
    # SnapKV protects its last 32 tokens: a target inside that window could not be met
    with pytest.raises(ConfigError, match=r"decoding\.target_size: expected more than the scorer's protected window"):
        method_config("decoding", scorer="snapkv", budget=100, target_size=32)
