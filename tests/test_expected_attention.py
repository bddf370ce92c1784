"""Expected Attention (kvcompress/methods/eviction/expected_attention.py): its config, the running query
moments a chunked prompt builds, and the bytes the prompt-time methods of issue 39 free.
Its selection against kvpress's formula: tests/test_reference_selection.py (real keys and queries)
and tests/test_eviction.py (random ones, a plain per-row loop)."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvcompress.datasets import load_dataset, prompt_tokens
from kvcompress.errors import ConfigError
from kvcompress.memory import live_kv_bytes
from kvcompress.methods import method_config
from kvcompress.methods.eviction.base import EvictionCache
from kvcompress.runner import derive_cache, prefill


@pytest.mark.parametrize("params, fragment", [
    ({"n_future_positions": 0}, "expected_attention.n_future_positions: expected an int >= 1, got 0"),
    ({"use_covariance": 1}, "expected_attention.use_covariance: expected true or false, got 1"),
    ({"use_vnorm": "yes"}, "expected_attention.use_vnorm: expected true or false"),
    ({"epsilon": -1.0}, "expected_attention.epsilon: expected a number >= 0, got -1.0"),
    ({"n_sink": -1}, "expected_attention.n_sink: expected an int >= 0"),
])
def test_bad_config_names_the_field_and_the_allowed_values(params, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        method_config("expected_attention", **params)


def test_defaults_are_kvpress_and_the_label_shows_what_differs():
    config = method_config("expected_attention")
    assert (config.budget, config.n_future_positions, config.n_sink, config.use_covariance, config.use_vnorm,
            config.epsilon) == (0.5, 512, 4, True, True, 0.01)
    assert config.needs_queries and not config.evicts_while_decoding
    assert method_config("expected_attention", budget=0.25, use_vnorm=False).label() == \
        "expected_attention budget=0.25 use_vnorm=False"


def test_chunked_query_moments_equal_the_whole_prompts():
    """The drop-in path sees the prompt in chunks; the merged moments equal those of all the queries
    after the sinks at once, and both equal NumPy's on the queries rotated back (float64)."""
    R, G, T, D = 2, 3, 70, 16
    rope = nn.RoPE(D, base=20000.0)
    config = method_config("expected_attention")
    raw = np.random.default_rng(0).standard_normal((R, G, T, D)).astype(np.float32)
    post = rope(mx.array(raw))  # post-RoPE at positions 0..T-1
    cache = EvictionCache(config, 0, 1, R, D, rope, D**-0.5)
    summaries = []
    for chunks in ([T], [3, 1, 30, 36]):  # the first chunk all sinks, then one straddling nothing
        summary, start = None, 0
        for size in chunks:
            cache.position = start + size
            summary = config.summarize_queries(cache, summary, post[:, :, start : start + size])
            start += size
        summaries.append(summary)
    kept = raw[:, :, config.n_sink :].astype(np.float64)
    mean = kept.mean(axis=2)
    centred = kept - mean[:, :, None]
    m2 = np.einsum("rgti,rgtj->rgij", centred, centred)
    for count, got_mean, got_m2 in summaries:
        assert count == T - config.n_sink
        np.testing.assert_allclose(np.array(got_mean), mean, atol=1e-5)
        np.testing.assert_allclose(np.array(got_m2), m2, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("name, params", [("keydiff", {}), ("expected_attention", {}), ("criticalkv", {}),
                                          ("criticalkv", {"scorer": "expected_attention"})])
@pytest.mark.parametrize("budget", [0.25, 0.125])
def test_prompt_compression_frees_the_resident_bytes_of_the_budget(embedded, name, params, budget):
    """After compressing a 510-token prompt of the embedded model, the resident bytes (keys, values
    and the int32 positions eviction keeps per token) are the budget's share of the full cache's,
    within 5% of it."""
    model, tokenizer = embedded
    sample = load_dataset("passkey", tokenizer=tokenizer, context_tokens=512, num_samples=1)[0]
    prefilled, _, _ = prefill(model, prompt_tokens(sample, tokenizer), record_queries=True)
    full = live_kv_bytes(prefilled)
    caches = derive_cache(model, method_config(name, budget=budget, **params), prefilled)
    assert live_kv_bytes(caches) / full == pytest.approx(budget, rel=0.05)


def test_scores_do_not_underflow_where_the_float64_scores_are_positive():
    """Issue 48 item 6: with epsilon 0, a float32 softmax gives exactly 0 to keys whose logit is ~100
    below the best, and those tied keys were ranked arbitrarily (30 of 45,540 in one head of the
    embedded model). Here a head whose logits span ~290: the old float32 scores are 0 for most keys,
    the log-domain scores are finite and rank every key as the float64 restatement of kvpress's
    formula does, and the cache keeps the reference's set at a budget that cuts among them."""
    G, T, D, n_sink = 3, 64, 8, 4
    rng = np.random.default_rng(0)
    queries = (40.0 * np.eye(D)[0] + 0.05 * rng.standard_normal((1, G, T, D))).astype(np.float32)
    keys = 0.1 * rng.standard_normal((1, 1, T, D))
    keys[..., 0] = rng.permutation(np.linspace(-20.0, 0.5, T))  # logits s * 40 * k0: -283 .. +7
    keys = keys.astype(np.float32)
    values = rng.standard_normal((1, 1, T, D)).astype(np.float32)
    scale = D**-0.5

    # float64 restatement (no RoPE): mean and population covariance of the queries after the sinks,
    # logits s mu.k + s^2/2 k Sigma k, log-softmax, mean over the query group, times ||v||, in logs
    q, k = queries[0, :, n_sink:].astype(np.float64), keys[0, 0, n_sink:].astype(np.float64)
    mean = q.mean(axis=1)
    cov = np.einsum("gti,gtj->gij", q - mean[:, None], q - mean[:, None]) / q.shape[1]
    logits = scale * mean @ k.T + scale**2 / 2 * np.einsum("ti,gij,tj->gt", k, cov, k)
    log_p = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    reference = np.logaddexp.reduce(log_p, axis=0) - np.log(G) + np.log(np.linalg.norm(values[0, 0, n_sink:], axis=1))
    old = (np.exp(log_p).astype(np.float32).mean(axis=0)) * np.linalg.norm(values[0, 0, n_sink:], axis=1)
    assert (old == 0).sum() >= 30 and np.isfinite(reference).all()  # the head underflowed before

    def cache(budget):
        config = method_config("expected_attention", budget=budget, epsilon=0.0)
        c = EvictionCache(config, 0, 1, 1, D, None, scale)
        c.from_prefill(mx.array(keys), mx.array(values), mx.array(queries))
        return config, c

    config, whole = cache(1.0)  # nothing evicted: score the held prompt as its selection did
    summary = config.summarize_queries(whole, None, mx.array(queries[0][None]))
    ours = np.array(config.score_prompt(whole, whole.keys, summary))[0, n_sink:]
    _, evicted = cache(T - 20)  # keeps 40 of the 60 scored keys: the cut falls among the underflowed ones
    expected = set(range(n_sink)) | set((n_sink + np.argsort(-reference)[: T - 20 - n_sink]).tolist())
    assert set(evicted.kept_rows()[0].tolist()) == expected
    np.testing.assert_array_equal(np.argsort(-ours), np.argsort(-reference))
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-3)  # the scores are the logarithms
