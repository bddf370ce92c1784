"""Keyformer / H2O (kvcompress/methods/keyformer.py): config, positions, prefill, drop-in, batching."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step, stream_generate
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from kvcompress.attention import install
from kvcompress.methods.base import ConfigError
from kvcompress.methods.keyformer import H2O, Keyformer, KeyformerCache, gumbel_noise
from kvcompress.runner import derive_cache, prefill

BASE = 20000.0  # an unusual RoPE base: a hard-coded 10000 anywhere would break these tests


# ---------------------------------------------------------------------------------------------
# config


@pytest.mark.parametrize(
    "params,field",
    [
        (dict(budget=0), "budget"),
        (dict(budget=1.5), "budget"),
        (dict(budget=10, n_sink=4, recent=6), "budget"),  # budget <= sinks + recent
        (dict(budget=10, recent=0.9, n_sink=1), "budget"),
        (dict(recent=1.0), "recent"),
        (dict(recent=-1), "recent"),
        (dict(n_sink=-1), "n_sink"),
        (dict(tau_init=-0.5), "tau_init"),
        (dict(tau_end=-1.0), "tau_end"),
        (dict(tau_init=0.0, tau_end=2.0), "tau_end"),
        (dict(tau_init=float("nan")), "tau_init"),
        (dict(anneal_steps=0), "anneal_steps"),
        (dict(score="key"), "score"),
        (dict(noise="fresh"), "noise"),
        (dict(positions="relative"), "positions"),
        (dict(seed=-3), "seed"),
    ],
)
def test_invalid_config_names_the_field(params, field):
    with pytest.raises(ConfigError, match=rf"keyformer\.{field}"):
        Keyformer(**params)


def test_h2o_is_the_tau_zero_ablation_and_columns():
    assert H2O().grid_columns() == {"budget": 0.6, "bits": None, "tau_init": 0.0, "tau_end": 0.0}
    assert Keyformer(budget=256).grid_columns() == {"budget": 256.0, "bits": None, "tau_init": 1.0, "tau_end": 2.0}
    with pytest.raises(ConfigError, match=r"h2o\.tau_init"):
        H2O(tau_init=1.0)
    assert Keyformer.needs_queries and H2O.needs_queries


def test_fractional_budget_too_small_for_the_prompt_is_rejected_before_work():
    cfg = Keyformer(budget=0.1, n_sink=4, recent=4)
    cache = KeyformerCache(cfg, 0, 2, 8, nn.RoPE(8, base=BASE), 8**-0.5)
    k = mx.zeros((1, 2, 50, 8))
    with pytest.raises(ConfigError, match=r"keyformer\.budget.*50-token prompt"):
        cache.from_prefill(k, k, mx.zeros((1, 4, 50, 8)))
    assert cfg.resolve(1000) == (100, 4)
    assert Keyformer().resolve(1000) == (600, 180)  # paper defaults: 60% of the prompt, w = 30%


def test_tau_schedule_anneals_over_decode_steps():
    cfg = Keyformer(tau_init=1.0, tau_end=2.0, anneal_steps=100)
    taus = cfg.tau(mx.array([-50, 0, 50, 100, 400])).tolist()
    assert taus == pytest.approx([1.0, 1.0, 1.5, 2.0, 2.0])


def test_noise_is_gumbel_and_differs_by_layer_head_step():
    keys = mx.broadcast_to(mx.arange(4000, dtype=mx.int32), (2, 4000))
    g = gumbel_noise(7, 3, mx.arange(2, dtype=mx.uint32), mx.array([10, 11]), keys)  # [2, 2, 4000]
    assert abs(g.mean().item() - 0.5772) < 0.05 and abs(g.std().item() - 1.2825) < 0.05
    assert not mx.allclose(g[0], g[1]).item()  # heads differ
    assert not mx.allclose(g[:, 0], g[:, 1]).item()  # steps differ
    other_layer = gumbel_noise(7, 4, mx.arange(2, dtype=mx.uint32), mx.array([10, 11]), keys)
    assert not mx.allclose(g, other_layer).item()
    again = gumbel_noise(7, 3, mx.arange(2, dtype=mx.uint32), mx.array([11]), keys)
    assert mx.array_equal(again[:, 0], g[:, 1]).item()  # a value depends only on its coordinates


# ---------------------------------------------------------------------------------------------
# exact and compact positions against attention recomputed from scratch


def rope_at(x, pos):
    """Rotate x [n, D] (float64) at positions pos [n]: non-traditional RoPE with base BASE."""
    D = x.shape[-1]
    theta = BASE ** (-np.arange(0, D, 2) / D)
    angle = np.asarray(pos, np.float64)[:, None] * theta
    x1, x2 = x[:, : D // 2], x[:, D // 2 :]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x1 * np.sin(angle) + x2 * np.cos(angle)], axis=1)


class Drive:
    """Feeds random pre-RoPE queries/keys/values through a cache the way a model layer does."""

    def __init__(self, cfg, B=1, H=2, rep=2, D=16, T=64, steps=10, seed=0):
        rng = np.random.default_rng(seed)
        total = T + steps
        self.B, self.H, self.rep, self.D, self.T = B, H, rep, D, T
        self.K = rng.standard_normal((B, H, total, D)).astype(np.float32)
        self.V = rng.standard_normal((B, H, total, D)).astype(np.float32)
        self.Q = rng.standard_normal((B, H * rep, total, D)).astype(np.float32)
        self.rope = nn.RoPE(D, base=BASE)
        self.scale = D**-0.5
        self.cache = KeyformerCache(cfg, 1, H, D, self.rope, self.scale)

    def prefill(self):
        T = self.T
        k = self.rope(mx.array(self.K[:, :, :T]))
        q = self.rope(mx.array(self.Q[:, :, :T]))
        self.cache.from_prefill(k, mx.array(self.V[:, :, :T]), q)

    def step(self, p):
        """Decode the token at true position p; returns (output, kept positions before eviction)."""
        c = self.cache
        k = self.rope(mx.array(self.K[:, :, p : p + 1]), offset=c.offset)
        q = self.rope(mx.array(self.Q[:, :, p : p + 1]), offset=c.offset)
        c.update_and_fetch(k, mx.array(self.V[:, :, p : p + 1]))
        kept = np.array(c.positions)
        out = c.attention(q, None, None, scale=self.scale, mask=None)
        return np.array(out), kept

    def multi(self, p, S):
        """Feed the S tokens at p..p+S-1 in one call (mask from make_mask); (output, kept positions)."""
        c = self.cache
        mask = c.make_mask(S, return_array=True)
        k = self.rope(mx.array(self.K[:, :, p : p + S]), offset=c.offset)
        q = self.rope(mx.array(self.Q[:, :, p : p + S]), offset=c.offset)
        c.update_and_fetch(k, mx.array(self.V[:, :, p : p + S]))
        kept = np.array(c.positions)
        return np.array(c.attention(q, None, None, scale=self.scale, mask=mask)), kept

    def reference(self, p, kept, compact):
        """Attention of the query at true position p over the kept tokens up to p, all rotated at
        their claimed positions (true positions, or slot indices in compact mode)."""
        out = np.zeros((self.B, self.H * self.rep, 1, self.D))
        for b in range(self.B):
            for h in range(self.H):
                P = kept[b * self.H + h]
                claimed = np.arange(len(P)) if compact else P
                visible = P <= p
                keys = rope_at(self.K[b, h, P[visible]].astype(np.float64), claimed[visible])
                for r in range(self.rep):
                    qh = h * self.rep + r
                    q = rope_at(self.Q[b, qh, p : p + 1].astype(np.float64), claimed[P == p])
                    logits = (q @ keys.T)[0] * self.scale
                    w = np.exp(logits - logits.max())
                    out[b, qh, 0] = (w / w.sum()) @ self.V[b, h, P[visible]]
        return out


@pytest.mark.parametrize("positions", ["exact", "compact"])
def test_positions_match_recomputed_attention_after_long_prompt_and_decode(positions):
    T, steps, budget = 128, 120, 32  # prompt 4x the budget, then 120 decode steps
    cfg = Keyformer(budget=budget, recent=0.25, n_sink=2, positions=positions, anneal_steps=steps)
    drive = Drive(cfg, B=1, H=2, rep=2, D=16, T=T, steps=steps + 4, seed=11)
    drive.prefill()
    c = drive.cache
    assert c.tokens_kept == budget and c.offset == (T if positions == "exact" else budget)
    evicted_interior = False
    for p in range(T, T + steps):
        out, kept = drive.step(p)
        np.testing.assert_allclose(out, drive.reference(p, kept, positions == "compact"), atol=2e-4, rtol=1e-3)
        assert c.tokens_kept == budget
        evicted_interior |= not set(kept[0]) - set(np.array(c.positions[0])) <= {kept[0][2]}
    assert c.offset == (T + steps if positions == "exact" else budget)
    out, kept = drive.multi(T + steps, 4)  # a multi-token call after decoding started
    for i in range(4):
        ref = drive.reference(T + steps + i, kept, positions == "compact")
        np.testing.assert_allclose(out[:, :, i : i + 1], ref, atol=2e-4, rtol=1e-3)
    assert c.tokens_kept == budget and c.position == T + steps + 4
    assert evicted_interior  # evictions happened in the middle, not just FIFO
    P = np.array(c.positions)
    assert (P[:, :2] == [0, 1]).all()  # sinks kept
    assert (P[:, -8:] == np.arange(T + steps - 4, T + steps + 4)).all()  # recent window kept
    assert (np.diff(P, axis=1) > 0).all()  # temporal order


# ---------------------------------------------------------------------------------------------
# per-head reference loop (tests only) and batched == looped


class LoopKeyformer:
    """Keyformer for one row (one batch element, one KV head), written plainly, token by token."""

    def __init__(self, cfg, drive, b, h):
        self.cfg, self.d, self.b, self.h = cfg, drive, b, h
        self.row = b * drive.H + h
        self.positions, self.scores = [], []

    def _increments(self, p, tau):
        """Score added to each kept key by the query at true position p (kept includes p)."""
        cfg, d = self.cfg, self.d
        P = self.positions
        compact = cfg.positions == "compact"
        claimed = list(range(len(P))) if compact else P
        keys = rope_at(d.K[self.b, self.h, P].astype(np.float64), claimed)
        if cfg.score == "proxy":
            logits = keys[-1:] @ keys.T * d.scale
        else:
            rows = [d.Q[self.b, self.h * d.rep + r, p : p + 1] for r in range(d.rep)]
            logits = np.concatenate([rope_at(q.astype(np.float64), [claimed[-1]]) for q in rows]) @ keys.T * d.scale
        if cfg.score == "attention" and cfg.tau_init > 0:
            step = None if cfg.noise == "frozen" else mx.array([p])
            noise = np.array(gumbel_noise(cfg.seed, 1, mx.array([self.row], mx.uint32), step, mx.array([P])))[0, 0]
            logits = (logits + noise) / tau
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        return (w / w.sum(axis=1, keepdims=True)).sum(axis=0)

    def _evict_by(self, p, tau):
        if self.cfg.score != "proxy" or self.cfg.tau_init == 0:
            return list(self.scores)
        step = None if self.cfg.noise == "frozen" else mx.array([p])
        noise = np.array(gumbel_noise(self.cfg.seed, 1, mx.array([self.row], mx.uint32), step, mx.array([self.positions])))[0, 0]
        return [s + tau * g for s, g in zip(self.scores, noise)]

    def run(self, T, steps, capacity, recent):
        cfg = self.cfg
        for p in range(T):  # prompt: keep everything, tau_init
            self.positions.append(p)
            self.scores.append(0.0)
            self.scores = list(np.array(self.scores) + self._increments(p, cfg.tau_init))
        if T > capacity:
            by = self._evict_by(T - 1, cfg.tau_init)
            n = len(by)
            protected = [i for i in range(n) if i < cfg.n_sink or i >= n - recent]
            others = sorted((i for i in range(n) if i not in protected), key=lambda i: (-by[i], i))
            keep = sorted(protected + others[: capacity - len(protected)])
            self.positions = [self.positions[i] for i in keep]
            self.scores = [self.scores[i] for i in keep]
        for p in range(T, T + steps):
            tau = float(cfg.tau(mx.array(p - T)))
            self.positions.append(p)
            self.scores.append(0.0)
            self.scores = list(np.array(self.scores) + self._increments(p, tau))
            if len(self.positions) > capacity:
                by = self._evict_by(p, tau)
                n = len(by)
                j = min(range(cfg.n_sink, n - recent), key=lambda i: (by[i], i))
                del self.positions[j], self.scores[j]
        return self.positions, self.scores


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    rep=st.sampled_from([1, 3]),
    T=st.integers(6, 40),
    steps=st.integers(1, 12),
    budget=st.integers(4, 24),
    n_sink=st.integers(0, 2),
    recent=st.integers(0, 2),
    tau=st.sampled_from([(0.0, 0.0), (1.0, 2.0), (0.5, 0.5)]),
    score=st.sampled_from(["attention", "proxy"]),
    noise=st.sampled_from(["redraw", "frozen"]),
    positions=st.sampled_from(["exact", "compact"]),
    seed=st.integers(0, 1000),
)
def test_batched_equals_per_head_loop(B, H, rep, T, steps, budget, n_sink, recent, tau, score, noise, positions, seed):
    assume(budget > n_sink + recent)
    cfg = Keyformer(
        budget=budget, n_sink=n_sink, recent=recent, tau_init=tau[0], tau_end=tau[1], anneal_steps=5,
        score=score, noise=noise, positions=positions, seed=seed,
    )
    drive = Drive(cfg, B=B, H=H, rep=rep, D=8, T=T, steps=steps, seed=seed)
    drive.prefill()
    for p in range(T, T + steps):
        drive.step(p)
    c = drive.cache
    for b in range(B):
        for h in range(H):
            loop_positions, loop_scores = LoopKeyformer(cfg, drive, b, h).run(T, steps, budget, recent)
            r = b * H + h
            assert np.array(c.positions[r]).tolist() == loop_positions
            np.testing.assert_allclose(np.array(c.scores[r]), loop_scores, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# drop-in through mlx-lm


@pytest.fixture(scope="module")
def tiny_llama():
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128, rope_theta=BASE,
    )
    model = llama.Model(args)
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape, key=mx.random.key(5)) * 0.1, model.parameters()))
    mx.eval(model.parameters())
    install()
    return model


def test_chunked_prefill_keeps_the_same_set_as_one_shot(tiny_llama):
    model, T = tiny_llama, 80
    prompt = mx.random.randint(0, 128, (1, T), key=mx.random.key(9))
    cfg = Keyformer(budget=24, n_sink=1, recent=0.25)
    prefilled, _, _ = prefill(model, prompt[0].tolist(), record_queries=True)  # the runner's path
    runner = derive_cache(model, cfg, prefilled)
    for chunk in (16, T - 1):  # mlx-lm style: prompt[:-1] in chunks, then the last token alone
        drop_in = cfg.make_cache(model)
        for start in range(0, T - 1, chunk):
            model(prompt[:, start : min(T - 1, start + chunk)], cache=drop_in)
        model(prompt[:, T - 1 :], cache=drop_in)
        for a, b in zip(runner, drop_in):
            assert b.tokens_kept == 24 and b.offset == T
            assert np.array(a.positions).tolist() == np.array(b.positions).tolist()
            np.testing.assert_allclose(np.array(a.scores), np.array(b.scores), rtol=1e-4)


def _greedy(model, prompt, cache, n=16):
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=cache, prefill_step_size=16)]


def test_budget_above_context_equals_full_cache(tiny_llama):
    prompt = mx.random.randint(0, 128, (50,), key=mx.random.key(2))
    full = _greedy(tiny_llama, prompt, [KVCache() for _ in tiny_llama.layers])
    for cfg in (Keyformer(budget=100), H2O(budget=100), Keyformer(budget=100, positions="compact", score="proxy")):
        assert _greedy(tiny_llama, prompt, cfg.make_cache(tiny_llama)) == full


def test_embedded_model_stream_generate_drop_in():
    model, tok = kvcompress.load_model()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    full = "".join(r.text for r in stream_generate(model, tok, prompt, max_tokens=8))
    same = kvcompress.make_cache(model, "keyformer", budget=4096)
    assert "".join(r.text for r in stream_generate(model, tok, prompt, max_tokens=8, prompt_cache=same)) == full
    assert "Paris" in full
    squeezed = kvcompress.make_cache(model, "keyformer", budget=0.5)
    text = "".join(r.text for r in stream_generate(model, tok, prompt, max_tokens=8, prompt_cache=squeezed))
    assert squeezed[0].tokens_kept == squeezed[0].capacity == round(0.5 * squeezed[0].prompt_len)
    assert squeezed[5].offset in (len(prompt) + 7, len(prompt) + 8) and text  # mlx-lm may feed the last token
    assert squeezed[0].live_kv_bytes == squeezed[0].capacity * 3 * (64 * 4 * 2 + 4 + 4)
