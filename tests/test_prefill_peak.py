"""No quantizer peaks above the full cache while prefilling (issue 40): a 2048-token prompt in chunks,
then its last token alone, as mlx-lm's generate prefills; the MLX peak above what was allocated
before, against the full cache's on the same prompt and chunks.

The model is llama-shaped with random weights and the attention geometry that makes the KV cache,
not the chunk's score matrix, the larger term on this CPU (head_dim 128, 2 KV heads, 2 queries per
KV head): MLX's CPU attention materializes a chunk's [B, H_q, L, T] scores for every cache alike.
The quantizers' prefill path dequantizes held codes DEQUANTIZE_BLOCK rows at a time; 256 here, so a
2048-token prompt spans 8 blocks, as a 32k context spans 16 of the default 2048. Peak memory is
deterministic up to the allocator's rounding (no timing): the margins are several MiB."""

from __future__ import annotations

import mlx.core as mx
import pytest

import kvcompress
from kvcompress.methods.quantization import base

PROMPT, CHUNK, BLOCK = 2048, 512, 256

# KIVI's path, TurboQuant's integer (3-bit codes straddle words) and fractional widths, QJL, KVQuant
QUANTIZERS = [("kivi", {"bits": 2}), ("turboquant", {"bits": 4}), ("turboquant", {"bits": 2.5}), ("qjl", {}),
              ("kvquant", {"bits": 3})]


@pytest.fixture(scope="module")
def model():
    import mlx.nn as nn
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-5, vocab_size=128, rope_theta=10000.0,
    )
    model = llama.Model(args)
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape, key=mx.random.key(1)) * 0.1, model.parameters()))
    mx.eval(model.parameters())
    return model


def prefill_peak(model, method: str, **params) -> int:
    """Bytes above the memory allocated before: the MLX peak of prefilling the prompt into a new cache,
    the second time (a first use may self-test a kernel or pick its path: what a process did before
    must not move the number)."""
    prefill(model, kvcompress.make_cache(model, method, **params))
    mx.synchronize()
    mx.clear_cache()
    cache = kvcompress.make_cache(model, method, **params)
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    prefill(model, cache)
    return mx.get_peak_memory() - before


def prefill(model, cache) -> None:
    prompt = mx.random.randint(0, 128, (1, PROMPT), key=mx.random.key(2))
    for start in range(0, PROMPT - 1, CHUNK):
        model(prompt[:, start : min(PROMPT - 1, start + CHUNK)], cache=cache)
        mx.eval([c.state for c in cache])  # as mlx-lm's prefill: the caches, not the chunk's logits
    mx.eval(model(prompt[:, PROMPT - 1 :], cache=cache), [c.state for c in cache])


@pytest.fixture(scope="module")
def full_peak(model):
    return prefill_peak(model, "full")


@pytest.mark.parametrize("method, params", QUANTIZERS, ids=[f"{m}-{p.get('bits', '')}" for m, p in QUANTIZERS])
def test_no_quantizer_peaks_above_the_full_cache_while_prefilling(model, full_peak, method, params, monkeypatch):
    monkeypatch.setattr(base, "DEQUANTIZE_BLOCK", BLOCK)
    peak = prefill_peak(model, method, **params)
    # the full cache holds 16 MiB of float32 keys and values here, and its peak is ~24 MiB
    assert peak < 0.95 * full_peak, (peak / 2**20, full_peak / 2**20)


def test_an_eviction_methods_quantized_store_adds_at_most_its_codes_to_its_peak(model, monkeypatch):
    """SnapKV + KIVI-4 holds the prompt in full precision until it selects (as kvpress), so its peak
    is SnapKV's own, plus at most the codes the hand-over writes while the kept tokens are still held
    (whether the two meet depends on when Python frees the eviction cache: the bound, not the sum,
    is what holds in every process)."""
    from kvcompress.memory import live_kv_bytes

    monkeypatch.setattr(base, "DEQUANTIZE_BLOCK", BLOCK)
    alone = prefill_peak(model, "snapkv", budget=0.5)
    composed = prefill_peak(model, "snapkv", budget=0.5, quantize={"name": "kivi", "bits": 4})
    caches = kvcompress.make_cache(model, "snapkv", budget=0.5, quantize={"name": "kivi", "bits": 4})
    prefill(model, caches)
    codes = live_kv_bytes(caches)  # ~1.9 MiB; the kept half in float32 is 8 MiB
    assert composed <= alone + codes + 2**19, (composed / 2**20, alone / 2**20, codes / 2**20)


@pytest.mark.parametrize("method, params", [("turboquant", {"bits": 4}), ("qjl", {}),
                                            ("snapkv", {"budget": 0.5, "quantize": {"name": "turboquant", "bits": 4}}),
                                            ("snapkv", {"budget": 0.5, "quantize": {"name": "qjl"}})],
                         ids=["turboquant", "qjl", "snapkv+turboquant", "snapkv+qjl"])
def test_tokens_handed_to_a_quantizer_are_held_as_codes_only(model, method, params):
    """A prefill handed to a quantizer (the runner's from_prefill) or a composed cache's hand-over of
    the kept tokens has no attention after it: the tokens' full-precision copy, which a call keeps
    for its own attention, must not stay beside their codes (uncounted) until the next call. What
    the process holds after the prompt is the cache's resident bytes."""
    import gc

    from kvcompress.memory import live_kv_bytes

    gc.collect()
    mx.synchronize()
    before = mx.get_active_memory()
    if method == "snapkv":  # the composed cache hands over in the call that completes the prompt
        caches = kvcompress.make_cache(model, method, **params)
        prefill(model, caches)
    else:  # one layer's cache from a finished prefill, as the runner derives it
        caches = [kvcompress.make_cache(model, method, **params)[0]]
        k, v = (mx.random.normal((1, 2, PROMPT, 128), key=mx.random.key(i)) for i in (3, 4))
        caches[0].from_prefill(k, v, None)
        mx.eval([c.state for c in caches])
        del k, v
    gc.collect()
    mx.synchronize()
    held = mx.get_active_memory() - before
    # the float32 keys and values of one layer's prompt are 2 MiB, of the kept half 1 MiB; rows a
    # buffer allocated ahead of its tokens (as mlx-lm's KVCache does) are not held tokens: < 64 KiB a layer
    assert held <= live_kv_bytes(caches) + 2**16 * len(caches), (held / 2**20, live_kv_bytes(caches) / 2**20)
