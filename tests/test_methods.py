"""Method registry, config validation, the streaming cache and resident-byte measurement."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import stream_generate
from mlx_lm.models.cache import KVCache, QuantizedKVCache

import kvcompress
from kvcompress.attention import reference_attention
from kvcompress.memory import live_kv_bytes, tokens_kept
from kvcompress.errors import ConfigError
from kvcompress.methods import method_config


def test_methods_lists_every_registered_method_with_defaults():
    listed = {m["name"]: m for m in kvcompress.list_methods()}
    assert {"full", "mlx-quant", "streaming"} <= set(listed)
    assert listed["mlx-quant"]["params"] == {"bits": 4, "group_size": 64, "layers": "global"}
    assert listed["streaming"]["params"]["n_sink"] == 4



def test_methods_is_the_subpackage_and_errors_live_in_one_place():
    import kvcompress.errors
    import kvcompress.methods as m
    import kvcompress.methods.base

    assert "keyformer" in m.REGISTRY and kvcompress.methods is m
    # one ConfigError: raised by every layer, importable from the package, errors and (for users) methods.base
    assert kvcompress.ConfigError is kvcompress.errors.ConfigError is kvcompress.methods.base.ConfigError
    assert [kvcompress.errors.is_int(v) for v in (3, True, 3.0, "3")] == [True, False, False, False]


@pytest.mark.parametrize(
    "name, params, fragment",
    [
        ("nope", {}, "method: expected one of"),
        ("mlx-quant", {"bits": 7}, "mlx-quant.bits: expected one of 2, 3, 4, 5, 6, 8, got 7"),
        ("mlx-quant", {"group": 64}, "mlx-quant.group: unknown parameter"),
        ("streaming", {"budget": 0}, "streaming.budget: expected a token count >= 1"),
        ("streaming", {"budget": 1.5}, "streaming.budget"),
        ("streaming", {"budget": 4, "n_sink": 4}, "streaming.budget: expected more tokens than n_sink"),
    ],
)
def test_bad_config_names_field_and_allowed_values(name, params, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.").replace("(", r"\(")):
        method_config(name, **params)


def test_mlx_quant_on_a_device_without_its_kernels_fails_before_any_work(embedded, monkeypatch):
    """MLX 0.32.4's CUDA back-end has no quantized_matmul for mlx-lm's quantized attention shapes
    (measured on the H200: "No implementation for problem shape"). Here the CPU has them, so the
    check passes; with MLX's failure forced, make_cache names the method and the missing kernel."""
    from kvcompress.methods.quantization import mlx_quant

    model, _ = embedded
    assert len(method_config("mlx-quant").make_cache(model)) == len(model.layers)

    def unsupported(*args, **kwargs):
        raise ValueError("[quantized_matmul] No implementation for problem shape")

    monkeypatch.setattr(mlx_quant.mx, "quantized_matmul", unsupported)
    mlx_quant.quantized_attention_error.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"mlx-quant: this device's mx.quantized_matmul .*bits 4, group_size 64.*"
                                              r"No implementation for problem shape; 'kivi' runs here"):
            method_config("mlx-quant").make_cache(model)
    finally:
        mlx_quant.quantized_attention_error.cache_clear()


def test_run_id_json_is_canonical():
    a = method_config("streaming", budget=64, n_sink=2)
    b = method_config("streaming", n_sink=2, budget=64)
    assert a.to_json() == b.to_json() == '{"budget": 64, "layers": "global", "n_sink": 2, "name": "streaming"}'
    assert a.grid_columns() == {"budget": 64.0, "bits": None, "tau_init": None, "tau_end": None}
    # reports group by the label: configs that differ only outside the grid columns stay apart
    assert a.label() == "streaming budget=64 n_sink=2"
    assert method_config("mlx-quant").label() == "mlx-quant bits=4"
    assert method_config("full").label() == "full"


def test_live_kv_bytes_counts_held_tokens_not_capacity():
    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 3, 100, 64)), mx.zeros((1, 3, 100, 64)))
    assert cache.nbytes == 2 * 3 * 256 * 64 * 4  # mlx-lm reports capacity
    assert live_kv_bytes([cache]) == 2 * 3 * 100 * 64 * 4
    q = QuantizedKVCache(group_size=64, bits=4)
    q.update_and_fetch(mx.zeros((1, 3, 100, 64)), mx.zeros((1, 3, 100, 64)))
    codes = 3 * 100 * 64 * 4 // 8
    scales_biases = 2 * 3 * 100 * 1 * 4
    assert live_kv_bytes([q]) == 2 * (codes + scales_biases)
    assert tokens_kept([q]) == 100


def test_reference_attention_matches_fused_kernel():
    mx.random.seed(1)
    q = mx.random.normal((1, 9, 5, 64))
    k = mx.random.normal((1, 3, 12, 64))
    v = mx.random.normal((1, 3, 12, 64))
    for mask in (None, "causal"):
        fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        assert mx.allclose(reference_attention(q, k, v, 0.125, mask), fused, atol=1e-5)


def test_streaming_drop_in_matches_full_cache_when_budget_covers_context(embedded):
    model, tokenizer = embedded
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colors of the rainbow."}], add_generation_prompt=True
    )
    full = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=12,
                                                   prompt_cache=kvcompress.make_cache(model, "full")))
    big = kvcompress.make_cache(model, "streaming", budget=4096)
    streamed = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=12, prompt_cache=big))
    assert streamed == full and len(full) > 0
    small = kvcompress.make_cache(model, "streaming", budget=16, n_sink=4)
    list(stream_generate(model, tokenizer, prompt, max_tokens=12, prompt_cache=small))
    assert tokens_kept(small) == 16 and small[0].offset == len(prompt) + 12  # mlx-lm computes one step ahead


@pytest.mark.parametrize("name", sorted(kvcompress.methods.REGISTRY))
def test_every_cache_deep_copies_and_the_copy_decodes_alike(embedded, name):
    """The runner copies a compressed context for each use (copy.deepcopy: one per protocol, and the
    answer pass). A cache holding something that cannot be copied (an mx.Dtype: TurboQuant's, which
    failed every query-agnostic run on the H200 on 2026-12-05) must not reach a sweep."""
    import copy

    model, tokenizer = embedded
    small_window = {"duoattention": {"n_sink": 4, "recent": 16}}  # its defaults need a 400-token prompt
    caches = kvcompress.make_cache(model, name, **small_window.get(name, {}))  # eviction keeps half the prompt
    kvcompress.compress_prompt(model, tokenizer, caches, list(range(100, 260)))  # KVzip's pass where it has one
    twin = copy.deepcopy(caches)
    step = mx.array([[11]])
    assert mx.array_equal(model(step, cache=twin), model(step, cache=caches)).item()
