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
            config.epsilon) == (0.5, 512, 4, True, True, 0.0)
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
