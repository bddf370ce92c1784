"""Short prompts (issue 48, item 4): every registered method, used drop-in through mlx-lm's
`stream_generate` on the embedded model, takes prompts of 1, 2, 5 and 8 tokens at its defaults and at
budget 1.0 without an exception; where nothing needs compressing (the budget or the protected window
covers the prompt) it keeps the prompt whole and decodes exactly as mlx-lm's own KVCache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate
from mlx_lm.models.cache import make_prompt_cache

import kvcompress
from kvcompress.memory import tokens_kept
from kvcompress.methods import REGISTRY, method_config
from kvcompress.methods.eviction.base import quantizers
from kvcompress.methods.eviction.decoding import Decoding
from kvcompress.methods.eviction.duoattention import DuoAttention
from kvcompress.methods.eviction import Eviction
from kvcompress.methods.full import Full
from kvcompress.methods.quantization.kivi import Kivi

PROMPTS = (1, 2, 5, 8)
STEPS = 3  # generated tokens per run
TEXT = "The capital of France is Paris, and the capital of Italy is Rome."


def configs():
    """Each registered method at its defaults and, where it has a budget below 1.0, at budget 1.0;
    then every quantizer as the store of SnapKV's kept tokens (composed caches)."""
    out = []
    for name in sorted(REGISTRY):
        out.append(pytest.param(name, {}, id=name))
        if REGISTRY[name]().params().get("budget", 1.0) != 1.0:
            out.append(pytest.param(name, {"budget": 1.0}, id=f"{name}-budget1"))
    for quantizer in sorted(quantizers()):  # SnapKV's window covers these prompts at any budget
        out.append(pytest.param("snapkv", {"quantize": {"name": quantizer}}, id=f"snapkv+{quantizer}"))
    return out


def generate(model, tokenizer, cache, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and their log-probability vectors [STEPS, vocab] from `stream_generate`."""
    out = list(stream_generate(model, tokenizer, prompt, max_tokens=STEPS, prompt_cache=cache))
    return [r.token for r in out], np.stack([np.array(r.logprobs.astype(mx.float32)) for r in out])


def lossless_responses(config, prompt_tokens: int) -> int:
    """How many of the STEPS responses must equal mlx-lm's KVCache's: where the cache keeps the
    prompt whole, every one for a cache that does not evict while decoding; for one that does, the
    responses whose attention still sees every token (eviction follows a step's attention)."""
    if isinstance(config, Full):
        return STEPS
    if isinstance(config, Kivi):
        return STEPS  # its 128-token full-precision residual holds every token here
    if not isinstance(config, Eviction):
        return 0  # quantizers that code tokens on arrival: no exception is the claim
    if config.quantize is not None and not isinstance(config.quantize, Kivi):
        return 0
    # mlx-lm feeds all but a prompt's last token first, in one call: for a 2-token prompt that call
    # is one token, which an eviction cache takes as the prompt's last query (module docstring there)
    seen = 1 if prompt_tokens == 2 else prompt_tokens
    capacity, _ = config.resolve(seen)
    if capacity < seen:
        return 0  # compressed: not a no-compression case
    evicts = config.evicts_while_decoding
    if isinstance(config, Decoding):
        evicts = config.compression_interval <= STEPS
    if isinstance(config, DuoAttention):
        evicts = False  # a prompt the budget covers has no streaming head
    if not evicts:
        return STEPS
    # response i comes from the forward at position T - 1 + i, which held min(T - 1 + i, capacity)
    # tokens before it: all of them while T - 1 + i <= capacity
    return min(STEPS, capacity - prompt_tokens + 2)


@pytest.fixture(scope="module")
def reference(embedded):
    """mlx-lm's own KVCache: tokens and log-probabilities per prompt length."""
    model, tokenizer = embedded
    tokens = tokenizer.encode(TEXT)
    assert len(tokens) >= max(PROMPTS)
    return {n: (tokens[:n], *generate(model, tokenizer, make_prompt_cache(model), tokens[:n])) for n in PROMPTS}


@pytest.mark.parametrize("name, params", configs())
def test_short_prompts_run_drop_in_and_are_kept_whole_where_covered(embedded, reference, name, params):
    model, tokenizer = embedded
    config = method_config(name, **params)
    for n in PROMPTS:
        prompt, want_tokens, want_logprobs = reference[n]
        cache = kvcompress.make_cache(model, name, **params)
        if config.reconstructs and config.resolve(n)[0] < n:
            # KVzip scores a prompt it compresses by reconstructing it, which generate cannot run:
            # compress all but the last token, then generate from it (kvcompress.make_cache's docstring)
            kvcompress.compress_prompt(model, tokenizer, cache, prompt[:-1])
            prompt = prompt[-1:]
        tokens, logprobs = generate(model, tokenizer, cache, prompt)
        assert len(tokens) == STEPS, (n, tokens)
        assert np.isfinite(logprobs).all(), n
        same = lossless_responses(config, n)
        assert tokens[:same] == want_tokens[:same], (n, tokens, want_tokens)
        np.testing.assert_array_equal(logprobs[:same], want_logprobs[:same], err_msg=f"{n}-token prompt")
        if same == STEPS and isinstance(config, Eviction) and config.quantize is None:
            assert tokens_kept(cache) == n + STEPS  # mlx-lm computes one step ahead: the last token is fed too


def test_lossless_cases_cover_every_family():
    """The test above asserts equality somewhere for each kind of cache (so it cannot pass vacuously)."""
    checked = {name for name in REGISTRY for n in PROMPTS
               if lossless_responses(method_config(name, **({"budget": 1.0} if "budget" in REGISTRY[name]().params()
                                                          else {})), n) == STEPS}
    assert {"full", "kivi", "snapkv", "adakv", "pyramidkv", "kvzip", "duoattention", "decoding",
            "expected_attention", "criticalkv", "keydiff"} <= checked, checked
    assert lossless_responses(method_config("h2o", budget=1.0), 8) == 2
    assert lossless_responses(method_config("h2o", budget=1.0), 2) == 1
    assert lossless_responses(method_config("snapkv", budget=1.0, quantize={"name": "kivi"}), 8) == STEPS
