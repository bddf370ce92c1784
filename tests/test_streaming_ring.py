"""StreamingLLM's ring order (kvcompress/methods/eviction/base.py, `_ring_slot`): an exact-position,
unpadded cache evicts the oldest non-sink token, whose slot the host tracks as a Python int. Every
test runs the ring beside the kernel path (`ring_order = False`: `evict_slot` and index-array
scatters) and asserts that everything observable is bit-identical, step by step."""

import tempfile

import kvcompress
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from kvcompress.methods import REGISTRY, method_config
from kvcompress.methods.eviction.base import Eviction, EvictionCache
from model_fixtures import TwinCaches


BASE = 20000.0


def kernel_path(caches):
    for c in caches:
        c.ring_order = False
    return caches


def assert_same(ring: EvictionCache, kernel: EvictionCache):
    """Everything a caller can observe of two caches, bit for bit."""
    for name in ("keys", "values", "scores", "positions"):  # the slots in use of each buffer
        assert mx.array_equal(getattr(ring, name), getattr(kernel, name)).item(), name
    assert mx.array_equal(ring.kept_positions(), kernel.kept_positions()).item()
    for a, b in zip(ring.held_kv(), kernel.held_kv()):
        assert mx.array_equal(a, b).item()
    assert ring.tokens_kept == kernel.tokens_kept and ring.live_kv_bytes == kernel.live_kv_bytes
    assert (ring.offset, ring.position, ring.length) == (kernel.offset, kernel.position, kernel.length)
    assert [r.tolist() for r in ring.kept_rows()] == [r.tolist() for r in kernel.kept_rows()]
    assert ring.meta_state == kernel.meta_state


def test_streaming_scores_are_positions():
    # what the ring writes for a new token's score (a Python float) is what score_new gives
    for name, cls in REGISTRY.items():
        if issubclass(cls, Eviction) and cls.score_is_position:
            cfg = method_config(name)
            assert cfg.decode == "fixed" and cfg.positions == "exact"
            positions = mx.array([[0, 5, 2**24 - 1, 2**24 + 1, 2**31 - 2]], mx.int32)
            scores = cfg.score_new(None, None, positions)
            assert mx.array_equal(scores, mx.array([[float(p) for p in positions.tolist()[0]]], mx.float32)).item()
    assert method_config("streaming").score_is_position and not method_config("h2o").score_is_position


class Layer(TwinCaches):
    """One layer fed random post-RoPE keys, values and queries, twice: ring and kernel path."""

    def __init__(self, budget, n_sink, B=1, H=3, rep=2, D=16, seed=0):
        self.cfg = method_config("streaming", budget=budget, n_sink=n_sink)
        rope = nn.RoPE(D, base=BASE)
        self.ring = EvictionCache(self.cfg, 0, 1, H, D, rope, D**-0.5)
        self.kernel = kernel_path([EvictionCache(self.cfg, 0, 1, H, D, rope, D**-0.5)])[0]
        super().__init__(self.ring, self.kernel, B, H, rep, D, seed)

    def feed(self, S=1):
        outs = super().feed(S)
        assert mx.array_equal(*outs).item()
        assert_same(self.ring, self.kernel)


@pytest.mark.parametrize("n_sink", [0, 1, 4])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("prompt", [40, 10, 3])  # a budget of 16 below the prompt, above it (fills up first)
def test_ring_equals_kernel_path_step_by_step(n_sink, B, prompt):
    layer = Layer(16, n_sink, B=B, seed=n_sink + 10 * B + prompt)
    layer.feed(prompt - 1)  # drop-in: the prompt, then its last token alone
    layer.feed()
    ring = layer.ring
    for _ in range(60):
        layer.feed()
        if ring.length == ring.capacity + 1:  # evicting: the host knows the free slot
            assert isinstance(ring.free, int) and not isinstance(layer.kernel.free, int)
            assert np.all(np.array(layer.kernel.free) == ring.free)
    assert isinstance(ring.free, int)
    # a multi-token call mid-decode appends its tokens without eviction (the first into the free
    # slot, the rest in new slots), and decoding then keeps that count: the ring is derived anew
    held = ring.tokens_kept
    layer.feed(5)
    assert ring.free is None and ring.tokens_kept == held + 5 == ring.held_limit
    for _ in range(20):
        layer.feed()
    assert isinstance(ring.free, int)


@pytest.mark.parametrize("state", ["rows differ", "scores differ"])
def test_ring_falls_back_to_the_kernel_where_it_does_not_hold(state):
    # states the ring cannot serve (as a loaded file might hold): rows with their slots in different
    # orders (no one slot to evict), scores that are not the positions. The ring is refused once
    # and the kernel path runs, with the same results
    layer = Layer(12, 2, H=2, seed=3)
    layer.feed(29)
    layer.feed()
    for c in (layer.ring, layer.kernel):
        if state == "rows differ":
            order = mx.array([[0, 1, *range(2, 12)], [0, 1, *range(11, 1, -1)]])  # row 1: non-sink slots reversed
            take = lambda a: mx.take_along_axis(a, order[..., None] if a.ndim == 3 else order, axis=1)  # noqa: E731
            c._set(take(c.keys), take(c.values), take(c.scores), take(c.positions))
        else:
            c._set(c.keys, c.values, c.scores + 0.5, c.positions)
    for _ in range(15):
        layer.feed()
    assert layer.ring._ring_checked and layer.ring._ring is None
    assert not isinstance(layer.ring.free, int)


def test_ring_writes_every_buffer_in_place():
    # no index arrays and no lazy read of the positions: all four buffers stay put step after step
    layer = Layer(16, 4, seed=1)
    layer.feed(39)
    layer.feed()
    c = layer.ring
    addresses = []
    for _ in range(10):
        layer.feed()
        buffers = (c._keys, c._values, c._positions, c._scores)
        addresses.append([np.asarray(a).__array_interface__["data"][0] for a in buffers])
    assert all(a == addresses[1] for a in addresses[1:])


def op_count(arrays: list[mx.array]) -> int:
    """MLX operations in the not yet evaluated graph behind `arrays` (nodes of `mx.export_to_dot`)."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return f.read().count("shape=rectangle")


def test_ring_step_builds_fewer_mlx_ops():
    layer = Layer(64, 4, H=8, rep=4, D=128, seed=2)
    layer.feed(199)
    layer.feed()
    layer.feed()  # both evicting now; the ring derived
    k, v, q = layer.normal(8, 1), layer.normal(8, 1), layer.normal(32, 1)
    counts = []
    for c in (layer.ring, layer.kernel):
        keys, values = c.update_and_fetch(k, v)
        out = c.attention(q, keys, values, scale=128**-0.5, mask=None)
        arrays = [out, c._keys, c._values, c._positions, c._scores] + ([c.free] if isinstance(c.free, mx.array) else [])
        counts.append(op_count(arrays))
        mx.eval(arrays)
    ring_ops, kernel_ops = counts
    assert ring_ops < kernel_ops, counts


# ---------------------------------------------------------------------------------------------
# through an mlx-lm model: drop-in prefill, batch > 1, save / load mid-decode


def decode_both(model, ring, kernel, tokens, steps):
    """Greedy decoding from `tokens` [B, 1] through both cache lists, asserting the logits and the
    caches equal every step; (the last token, the logits of every step)."""
    logits = []
    for _ in range(steps):
        a, b = model(tokens, cache=ring), model(tokens, cache=kernel)
        assert mx.array_equal(a, b).item()
        for r, k in zip(ring, kernel):
            assert_same(r, k)
        logits.append(a)
        tokens = mx.argmax(a[:, -1:], axis=-1)
    return tokens, logits


@pytest.mark.parametrize("B,n_sink,budget", [(1, 4, 24), (2, 4, 24), (2, 0, 24), (1, 4, 100)])
def test_ring_equals_kernel_path_in_a_model(tiny_llama, B, n_sink, budget):
    model, T = tiny_llama, 60
    prompt = mx.random.randint(0, 128, (B, T), key=mx.random.key(7))
    cfg = method_config("streaming", budget=budget, n_sink=n_sink)
    ring, kernel = cfg.make_cache(model), kernel_path(cfg.make_cache(model))
    for caches in (ring, kernel):  # drop-in, in chunks: prompt[:-1], then the last token alone
        for start in range(0, T - 1, 16):
            model(prompt[:, start : min(T - 1, start + 16)], cache=caches)
    decode_both(model, ring, kernel, prompt[:, -1:], 60)
    assert all(isinstance(c.free, int) for c in ring)


def test_ring_save_and_load_mid_decode_continues_identically(tiny_llama, tmp_path):
    model, T = tiny_llama, 50
    prompt = mx.random.randint(0, 128, (1, T), key=mx.random.key(8))
    cfg = method_config("streaming", budget=20, n_sink=4)
    ring, kernel = cfg.make_cache(model), kernel_path(cfg.make_cache(model))
    for caches in (ring, kernel):
        model(prompt[:, :-1], cache=caches)
    tokens, _ = decode_both(model, ring, kernel, prompt[:, -1:], 7)
    saved = {}
    for name, caches in (("ring", ring), ("kernel", kernel)):
        saved[name] = str(tmp_path / f"{name}.safetensors")
        save_prompt_cache(saved[name], caches)
    a, b = mx.load(saved["ring"]), mx.load(saved["kernel"])  # the same arrays in the file
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    continued = []
    for load in (load_prompt_cache, lambda p: kvcompress.load_prompt_cache(p, model)):
        loaded = load(saved["ring"])
        assert all(isinstance(c, EvictionCache) and c.ring_order for c in loaded)
        continued.append(decode_both(model, loaded, kernel_path(load(saved["kernel"])), tokens, 12)[1])
        assert all(isinstance(c.free, int) for c in loaded)  # the ring derived again after the load
    continued.append(decode_both(model, ring, kernel, tokens, 12)[1])  # as if never saved
    for logits in continued[:-1]:
        assert all(mx.array_equal(a, b).item() for a, b in zip(logits, continued[-1]))
