"""Eviction x quantization (kvcompress/methods/composed.py): configs, the composed cache against the
plain quantizer and the eviction-only cache on the embedded model, masks against a reference on a
random model, save/load, the runner."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import save_prompt_cache

import kvcompress
from kvcompress import load_dataset
from kvcompress.attention import reference_attention
from kvcompress.errors import ConfigError
from kvcompress.memory import live_kv_bytes, quantized_tokens, tokens_kept
from kvcompress.methods import ComposedCache, method_config
from kvcompress.methods.eviction.base import PAD
from kvcompress.runner import RunContext, decode_step, derive_cache, method_identity, prefill, run_config, run_sample

KIVI4 = {"name": "kivi", "bits": 4}
TQ3 = {"name": "turboquant", "bits": 3}
QJL = {"name": "qjl"}


def test_the_config_names_both_and_configs_without_it_keep_their_identity():
    plain = method_config("snapkv", budget=0.5)
    composed = method_config("snapkv", budget=0.5, quantize=KIVI4)
    assert plain.label() == "snapkv budget=0.5"
    # a store's residual is one group by default (KIVI's own 128 would hold a budget's tokens whole)
    assert composed.label() == "snapkv budget=0.5 + kivi bits=4 residual=32"
    assert method_config("adakv", quantize={"name": "turboquant", "bits": 3, "qjl": False}).label() == \
        "adakv budget=0.5 + turboquant bits=3 qjl=False"
    # the run id hashes the full quantizer config; without one the identity is what it was
    assert method_identity(plain) == {"name": "snapkv", "budget": 0.5, "recent": 32, "kernel": 7, "pooling": "max"}
    assert method_identity(composed)["quantize"] == {"name": "kivi", "bits": 4, "key_bits": None, "value_bits": None,
                                                      "group_size": 32, "residual": 32, "residual_policy": "paper"}
    two_bits = method_config("snapkv", budget=0.5, quantize={"name": "kivi", "bits": 2})
    assert len({json.dumps(method_identity(c), sort_keys=True) for c in (plain, composed, two_bits)}) == 3
    assert method_config(**composed.to_dict()) == composed  # rebuilds (the prompt-cache files rely on it)
    # a config object is taken as it is; a mapping gets the store's defaults where it sets none
    assert method_config("snapkv", quantize=method_config("kivi", bits=4)) == \
        method_config("snapkv", quantize={**KIVI4, "residual": 128})
    assert method_config("snapkv", quantize=method_config("kivi", bits=4, residual=32)) == method_config("snapkv", quantize=KIVI4)
    assert method_config("snapkv", quantize={**KIVI4, "group_size": 64}).quantize.residual == 64
    assert method_config("kivi").residual == 128 and method_config("qjl").buffer == 128  # alone: the papers'
    assert composed.grid_columns() == {"budget": 0.5, "bits": 4.0, "tau_init": None, "tau_end": None}
    assert method_config("snapkv", quantize={"name": "kivi", "key_bits": 4, "value_bits": 2}).grid_columns()["bits"] == 3.0
    with_qjl = method_config("snapkv", budget=0.5, quantize={"name": "qjl", "value_bits": 4})
    assert with_qjl.label() == "snapkv budget=0.5 + qjl value_bits=4 buffer=32"
    assert method_identity(with_qjl)["quantize"] == {
        "name": "qjl", "sketch_dim": 256, "outlier_sketch_dim": 256, "initial_layers": 15, "initial_sketch_dim": 512,
        "initial_outlier_sketch_dim": 128, "outliers": 8, "value_bits": 4, "group_size": 32, "buffer": 32, "seed": 0}
    assert method_config(**with_qjl.to_dict()) == with_qjl
    assert with_qjl.grid_columns()["bits"] is None  # as plain QJL's: keys have no code width


ALLOWED = r"expected one of \['kivi', 'qjl', 'turboquant'\]"


@pytest.mark.parametrize("quantize, message", [
    ({"name": "full"}, rf"snapkv.quantize.name: {ALLOWED}, got 'full'"),
    ({"bits": 4}, rf"snapkv.quantize.name: {ALLOWED}, got no name"),
    # quantizers that cannot be a store say why, and still name the allowed ones
    ({"name": "kvquant"}, rf"snapkv.quantize.name: kvquant cannot store .* pre-RoPE .* slot index.*; {ALLOWED}$"),
    ({"name": "mlx-quant", "bits": 4}, rf"snapkv.quantize.name: mlx-quant cannot store .* QuantizedKVCache.*; {ALLOWED}$"),
    (method_config("kvquant"), rf"snapkv.quantize.name: kvquant cannot store .*; {ALLOWED}$"),
    ({"name": "qjl", "sketch_dim": 33}, r"snapkv.quantize: qjl.sketch_dim: expected a positive multiple of 32"),
    ({"name": "kivi", "bits": 5}, r"snapkv.quantize: kivi.bits: expected one of 2, 3, 4, 8"),
    ({"name": "kivi", "bitz": 4}, r"snapkv.quantize: kivi.bitz: unknown parameter"),
    ({"name": "kivi", "layers": "all"}, r"snapkv.quantize.layers: the eviction method's own `layers`"),
    ("kivi", r"snapkv.quantize: expected a mapping"),
])
def test_a_bad_quantizer_is_a_config_error_naming_the_field(quantize, message):
    with pytest.raises(ConfigError, match=message):
        method_config("snapkv", quantize=quantize)


@pytest.mark.parametrize("method, params", [("h2o", {}), ("keyformer", {}), ("tova", {}), ("streaming", {}),
                                            ("knorm", {"decoding": "evict", "n_sink": 4}),
                                            ("random", {"decoding": "evict", "n_sink": 4})])
def test_methods_that_evict_while_decoding_are_refused(method, params):
    with pytest.raises(ConfigError, match=rf"{method}.quantize: {method} evicts while decoding.*one of \['adakv'"):
        method_config(method, quantize=KIVI4, **params)
    method_config(method, **params)  # fine without


def test_every_method_that_compresses_once_composes():
    from kvcompress.methods.eviction.base import prompt_once_methods

    assert prompt_once_methods() == ["adakv", "criticalkv", "expected_attention", "keydiff", "knorm", "pyramidkv",
                                     "random", "snapkv"]
    for name in prompt_once_methods():
        assert method_config(name, quantize=KIVI4).label().endswith(" + kivi bits=4 residual=32")


# -- the embedded model: the runner's path (one full prefill, each cache derived from it) ------------


@pytest.fixture(scope="module")
def essay(embedded):
    """A 512-token essay prompt, its full prefill (queries recorded) and 4 continuation tokens."""
    model, tokenizer = embedded
    sample = load_dataset("lm", tokenizer=tokenizer, context_tokens=512, continuation_tokens=8, num_samples=1, seed=1)[0]
    prompt = tokenizer.encode(sample["context"])
    continuation = tokenizer.encode(sample["answers"][0])[:4]
    prefilled, logits, _ = prefill(model, prompt, record_queries=True)
    return model, prefilled, logits, continuation


def _decode(model, method, essay):
    """The method's caches derived from the full prefill and the log-probabilities [4, V] of the
    teacher-forced continuation steps."""
    _, prefilled, _, continuation = essay
    caches = derive_cache(model, method, prefilled)
    out = []
    for token in continuation:
        logits = decode_step(model, token, caches).astype(mx.float32)
        out.append(np.array(logits - mx.logsumexp(logits)))
    return caches, np.stack(out)


def _kl(p_log, q_log) -> float:
    return float(np.max((np.exp(p_log) * (p_log - q_log)).sum(axis=-1)))


@pytest.mark.parametrize("quantize", [KIVI4, TQ3, QJL])
def test_at_budget_one_the_composed_cache_is_the_plain_quantizer(embedded, essay, quantize):
    model = essay[0]
    config = method_config("snapkv", budget=1.0, quantize=quantize)
    plain, plain_lp = _decode(model, config.quantize, essay)  # the quantizer as the store is configured
    composed, composed_lp = _decode(model, config, essay)
    np.testing.assert_array_equal(composed_lp, plain_lp)
    # the same store, plus the kept positions [3 heads, 512 + 4] int32 of each of the 30 layers
    positions = 30 * 3 * 512 * 4
    assert live_kv_bytes(composed) == live_kv_bytes(plain) + positions


@pytest.mark.parametrize("method", ["snapkv", "adakv"])
def test_the_quantizer_keeps_the_eviction_and_holds_fewer_bytes_than_either(embedded, essay, method):
    model = essay[0]
    full, full_lp = _decode(model, method_config("full"), essay)
    kivi, kivi_lp = _decode(model, method_config("kivi", bits=4), essay)
    evicted, evicted_lp = _decode(model, method_config(method, budget=0.5), essay)
    composed, composed_lp = _decode(model, method_config(method, budget=0.5, quantize=KIVI4), essay)
    for e, c in zip(evicted, composed):
        assert isinstance(c, ComposedCache)
        kept_e, kept_c = np.array(e.kept_positions()), np.array(c.kept_positions())
        assert c.padded == (method == "adakv")
        for row_e, row_c in zip(kept_e, kept_c):
            np.testing.assert_array_equal(np.sort(row_e[row_e != PAD]), row_c[row_c != PAD])  # in temporal order
        assert c.tokens_kept == e.tokens_kept  # padding slots count in both
    assert live_kv_bytes(composed) < live_kv_bytes(evicted)
    if method == "snapkv":
        assert live_kv_bytes(composed) < live_kv_bytes(kivi)
    else:  # AdaKV's rows are padded to the longest (~0.7 of this prompt) and that length's residual keys
        # happen to be 114 full-precision keys against the plain cache's 4 (516 % 128): not below KIVI here
        assert live_kv_bytes(composed) < 1.05 * live_kv_bytes(kivi)
    # quantizing the kept tokens moves the logits by about what quantizing them all does
    assert _kl(evicted_lp, composed_lp) < 3 * _kl(full_lp, kivi_lp) + 1e-3, (_kl(evicted_lp, composed_lp),
                                                                            _kl(full_lp, kivi_lp))


def test_by_default_the_store_quantizes_the_kept_tokens(embedded, essay):
    """Issue 48: SnapKV keeping 96 tokens into KIVI with its own 128-token residual quantized none of
    them (the eviction's numbers, a few bytes less, reported as a point of its own). The store's
    default residual, one group, quantizes them; `quantized_tokens` says how many a layer holds."""
    model, prefilled = essay[0], essay[1]

    def after_prompt(name, **params):
        return derive_cache(model, method_config(name, **params), prefilled)

    alone = after_prompt("snapkv", budget=0.25)
    composed = after_prompt("snapkv", budget=0.25, quantize=KIVI4)
    kept = tokens_kept(alone)
    assert kept == tokens_kept(composed) and 32 < kept <= 128
    # the paper's policy with a 32-token residual: keys in whole groups of 32, values all but the last 32
    assert quantized_tokens(composed) == kept - kept % 32
    assert all(c.quantized_tokens == quantized_tokens(composed) for c in composed)
    assert live_kv_bytes(composed) < 0.5 * live_kv_bytes(alone)
    whole = after_prompt("snapkv", budget=96, quantize={**KIVI4, "residual": 128})
    assert quantized_tokens(whole) == 0 and quantized_tokens(alone) is None
    assert live_kv_bytes(whole) > 0.95 * live_kv_bytes(after_prompt("snapkv", budget=96))


# -- a random model: attention against a reference over what the store holds ------------------------


def _prompt_cache(model, method, T=128, seed=0, check_phase=True):
    """`method`'s caches after a T-token prompt fed as mlx-lm's generate does (all but the last
    token in one call, then the last alone: the call that compresses)."""
    caches = method.make_cache(model)
    tokens = np.random.default_rng(seed).integers(0, 128, T).tolist()
    model(mx.array(tokens[:-1])[None], cache=caches)
    assert not check_phase or all(c.eviction is not None for c in caches)
    model(mx.array(tokens[-1:])[None], cache=caches)
    return caches


def _reference(keys, values, positions, q, query_positions):
    """Attention of q [B, H_q, S, D] over keys/values [B, H, T, D] at true positions [R, T], masked by
    position (PAD: after every query), in float32 MLX ops."""
    B, H, T, D = keys.shape
    S = q.shape[2]
    visible = positions.reshape(B, H, 1, 1, T) <= query_positions[:, None]
    mask = mx.broadcast_to(visible, (B, H, q.shape[1] // H, S, T)).reshape(B, q.shape[1], S, T)
    return reference_attention(q, keys, values, D**-0.5, mask)


@pytest.mark.parametrize("quantize", [{"name": "kivi", "bits": 4, "residual": 32}, {"name": "turboquant", "bits": 3},
                                      {"name": "qjl", "buffer": 32}])
@pytest.mark.parametrize("method", ["snapkv", "adakv"])
def test_attention_on_the_store_equals_attention_over_what_it_holds(tiny_llama, method, quantize):
    """After compression: one-token steps and multi-token calls (KIVI's codes path up to 8 query rows,
    its dequantized SDPA past them) against a float32 reference over the store's dequantized keys
    and values, masked by true positions, so padding slots (AdaKV) are never attended. What a call
    sees is the quantizers' own rule: the tokens held before it as codes, its own tokens exactly
    (KIVI's one-token step: after its flush; QJL's: what it holds after the call, its own tokens
    exact, as a call that completes a 32-token buffer quantizes keys it held exactly before)."""
    qjl = quantize["name"] == "qjl"
    # QJL: ~90 kept tokens, so that the calls below complete a 32-token key buffer (at 96)
    caches = _prompt_cache(tiny_llama, method_config(method, budget=0.7 if qjl else 0.5, quantize=quantize))
    cache = caches[1]
    assert cache.padded == (method == "adakv") and cache.offset == 128 and cache.tokens_kept < 128
    if qjl:  # the handed-over rows went through QJL's codes, with the first layers' sketch size
        assert cache.store.n_keys == 64 and cache.store.n_values > 32 and cache.store.m == 512
    rng = np.random.default_rng(1)
    for S in (1, 3, 1, 6, 1):
        k, v = (mx.array(rng.standard_normal((1, 2, S, 32)).astype(np.float32)) for _ in range(2))
        q = mx.array(rng.standard_normal((1, 4, S, 32)).astype(np.float32))
        held_k, held_v = cache.held_kv()
        held_positions = cache.kept_positions()
        query_positions = mx.arange(cache.offset, cache.offset + S)
        keys, values = cache.update_and_fetch(k, v)
        if quantize["name"] == "kivi" and S == 1:
            held_k, held_v = cache.held_kv()
            held_positions = cache.kept_positions()
        elif qjl:
            held_k, held_v = (mx.concatenate([a[:, :, :-S], b], axis=2) for a, b in zip(cache.held_kv(), (k, v)))
            held_positions = cache.kept_positions()
        else:
            held_k, held_v = mx.concatenate([held_k, k], axis=2), mx.concatenate([held_v, v], axis=2)
            new = mx.broadcast_to(query_positions.astype(mx.int32), (2, S))
            held_positions = mx.concatenate([held_positions, new], axis=1)
        expected = _reference(held_k, held_v, held_positions, q, query_positions)
        out = cache.attention(q, keys, values, scale=32**-0.5, mask="causal" if S > 1 else None)
        assert float(mx.abs(out - expected).max()) < 1e-4, S
        assert cache.kept_positions().shape[1] == cache.store.offset
    assert cache.offset == 128 + 12 and (not qjl or cache.store.n_keys == 96)


@pytest.mark.parametrize("method", ["adakv", "criticalkv", "expected_attention", "keydiff", "knorm", "pyramidkv",
                                    "random", "snapkv"])
def test_every_composable_method_keeps_its_own_positions_in_the_drop_in_path(tiny_llama, method):
    """Fed as mlx-lm's generate feeds a prompt, each method's composed cache holds exactly the
    positions its eviction-only cache holds, layer by layer (PyramidKV: different lengths per layer),
    and both decode on from there."""
    plain = _prompt_cache(tiny_llama, method_config(method, budget=0.5), check_phase=False)
    composed = _prompt_cache(tiny_llama, method_config(method, budget=0.5, quantize=TQ3))
    for e, c in zip(plain, composed):
        rows_c = [row[row != PAD] for row in np.array(c.kept_positions())]
        assert [r.tolist() for r in e.kept_rows()] == [r.tolist() for r in rows_c]
        assert c.tokens_kept == e.tokens_kept < 128
    logits = tiny_llama(mx.array([[5, 6]]), cache=composed)
    assert np.isfinite(np.array(logits)).all() and composed[0].kept_positions().shape[1] == composed[0].tokens_kept


def test_padding_slots_are_never_attended(tiny_llama):
    """AdaKV's padding slots hold a copy of their row's last kept token and are masked: garbage put
    into them does not change the attention."""
    caches = _prompt_cache(tiny_llama, method_config("adakv", budget=0.5, quantize=TQ3))
    cache = caches[0]
    assert cache.padded
    valid = np.array(cache.prompt_positions) != PAD
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(2))
    k, v = mx.random.normal((1, 2, 1, 32), key=mx.random.key(3)), mx.random.normal((1, 2, 1, 32), key=mx.random.key(4))
    keys, values = cache.update_and_fetch(k, v)
    before = cache.attention(q, keys, values, scale=32**-0.5, mask=None)
    store = cache.store
    n = valid.shape[1]
    noise = (np.random.default_rng(5).random(store.arrays["k_norms"].shape) * 1e3).astype(np.float16)
    noise[..., :n] *= ~valid.reshape(noise.shape[0], noise.shape[1], n)  # only padding slots
    noise[..., n:] = 0
    store.arrays["k_norms"] = store.arrays["k_norms"] + mx.array(noise)
    store._fresh = (k, v)
    after = cache.attention(q, keys, values, scale=32**-0.5, mask=None)
    assert mx.array_equal(before, after)


@pytest.mark.parametrize("quantize", [{"name": "kivi", "bits": 2, "residual": 32}, {"name": "qjl", "buffer": 32}])
@pytest.mark.parametrize("phase", ["prompt", "store"])
def test_save_and_load_in_either_phase(tiny_llama, tmp_path, phase, quantize):
    tokens = np.random.default_rng(0).integers(0, 128, 130).tolist()
    # knorm scores need no queries: an eviction cache saved mid-prompt does not keep a window's queries
    caches = kvcompress.make_cache(tiny_llama, "adakv", budget=0.5, scorer="knorm", quantize=quantize)
    tiny_llama(mx.array(tokens[:127])[None], cache=caches)
    if phase == "store":
        tiny_llama(mx.array(tokens[127:128])[None], cache=caches)
    assert all((c.eviction is None) == (phase == "store") for c in caches)
    assert phase == "prompt" or all(c.padded for c in caches)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches)
    loaded = kvcompress.load_prompt_cache(path, tiny_llama)
    assert [type(c) for c in loaded] == [ComposedCache] * 3
    assert [c.live_kv_bytes for c in loaded] == [c.live_kv_bytes for c in caches]
    start = 127 if phase == "prompt" else 128
    for token in tokens[start:]:
        a = tiny_llama(mx.array([[token]]), cache=caches)
        b = tiny_llama(mx.array([[token]]), cache=loaded)
        assert mx.array_equal(a, b)
    assert all(c.eviction is None for c in loaded)


def test_a_run_writes_rows_that_name_both(embedded):
    model, tokenizer = embedded
    params = {"context_tokens": 256, "num_samples": 1, "seed": 0}
    sample = load_dataset("passkey", tokenizer=tokenizer, **params)[0]
    nothing = method_config("snapkv", budget=64, quantize={**KIVI4, "residual": 128})  # 64 kept: all residual
    methods = [method_config("snapkv", budget=0.5), method_config("snapkv", budget=0.5, quantize=KIVI4), nothing]
    context = RunContext("smollm2-135m", "fp", "passkey", params, None)  # the whole reference answer
    with pytest.warns(UserWarning, match=r"snapkv budget=64 \+ kivi bits=4 on sample .*: the quantizer holds none of "
                                         r"the 64 tokens per layer kept after the prompt as codes") as warned:
        plain, composed, unquantized, plain_agnostic, agnostic, _ = run_sample(
            model, tokenizer, sample, methods, context, protocols=("query_aware", "query_agnostic"))
    assert sum("quantizer holds none" in str(w.message) for w in warned) == 2  # one per protocol, that config's only
    assert plain.run["quantized_tokens"] is None and unquantized.run["quantized_tokens"] == 0
    assert composed.run["quantized_tokens"] >= composed.run["budget_tokens"] - 32 > 0  # all but part of a group
    # query-agnostic: the question part is appended to the store in one multi-token call
    assert agnostic.run["status"] == "ok" and agnostic.run["config_label"].endswith("+ kivi bits=4 residual=32 protocol=query_agnostic")
    assert composed.run["status"] == "ok", composed.run["error"]
    assert composed.run["config_label"] == "snapkv budget=0.5 + kivi bits=4 residual=32"
    assert (composed.run["budget"], composed.run["bits"]) == (0.5, 4.0)
    assert json.loads(composed.run["config"])["method"]["quantize"]["bits"] == 4
    assert composed.run["run_id"] != plain.run["run_id"]
    assert run_config(context, sample, methods[0])["method"] == method_identity(methods[0])
    assert composed.run["budget_tokens"] == plain.run["budget_tokens"]
    assert composed.run["live_kv_bytes"] < plain.run["live_kv_bytes"]
    assert all(s["live_kv_bytes"] > 0 and s["tokens_kept"] == plain.steps[i]["tokens_kept"]
               for i, s in enumerate(composed.steps))


@pytest.mark.parametrize("name, params", [("kvzip", {}), ("adakv", {"scorer": "kvzip"})])
def test_a_method_that_selects_after_a_reconstruction_pass_is_refused(name, params):
    """kvcompress.compress_prompt runs KVzip's pass over eviction caches, not over composed ones: refused
    before any work instead of failing at the first token."""
    with pytest.raises(ConfigError, match=rf"{name}\.quantize: kvzip selects after a reconstruction pass"):
        method_config(name, quantize=KIVI4, **params)
