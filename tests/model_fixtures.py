"""Model fixtures that need nothing but MLX and mlx-lm: conftest.py imports them, and a GPU machine
without the project installed loads them alone (`pytest --noconftest -p model_fixtures`, as
scripts/gpu_tests.sh does). Also `TwinCaches`, for tests that compare two paths of a cache, and
`next_token_kl`, the quantizers' error on the embedded model."""

import numpy as np
import pytest


@pytest.fixture(scope="module")
def tiny_llama():
    """A random 3-layer mlx-lm Llama (4 query / 2 KV heads, head_dim 32) with kvcompress's attention
    hook installed; RoPE base 20000, an unusual one: a hard-coded 10000 anywhere would break the
    eviction tests that use it."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    from kvcompress.attention import install

    args = llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=3, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128, rope_theta=20000.0,
    )
    model = llama.Model(args)
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape, key=mx.random.key(5)) * 0.1, model.parameters()))
    mx.eval(model.parameters())
    install()
    return model


class TwinCaches:
    """Two caches of one attention layer fed the same random post-RoPE keys, values and queries
    (B batch, H KV heads, G queries per KV head, head dim D), as mlx-lm's attention calls them."""

    def __init__(self, first, second, B: int, H: int, G: int, D: int, seed: int):
        self.caches = (first, second)
        self.B, self.H, self.G, self.D = B, H, G, D
        self.rng = np.random.default_rng(seed)

    def normal(self, heads: int, S: int):
        import mlx.core as mx

        return mx.array(self.rng.standard_normal((self.B, heads, S, self.D)).astype(np.float32))

    def feed(self, S: int = 1) -> list:
        """S new tokens into both caches; their attention outputs [B, H * G, S, D]."""
        k, v, q = self.normal(self.H, S), self.normal(self.H, S), self.normal(self.H * self.G, S)
        outs = []
        for c in self.caches:
            keys, values = c.update_and_fetch(k, v)
            mask = c.make_mask(S, return_array=True) if S > 1 else None
            outs.append(c.attention(q, keys, values, scale=self.D**-0.5, mask=mask))
        return outs


# A 217-token prompt (benchmarks/quantizer_kl.py's): its last token attends over what the cache holds.
KL_PROMPT = "The pass key is 4127. Remember it. " + "The grass is green. " * 40 + "The pass key is"


def next_token_kl(model, tokenizer, method: str, **params) -> float:
    """KL(full || cache) in nats of the next-token distribution after KL_PROMPT: all but its last
    token in one call, then the last alone, over the codes (or whatever the cache holds)."""
    import mlx.core as mx

    import kvcompress

    prompt = tokenizer.encode(KL_PROMPT)

    def log_probs(cache):
        model(mx.array(prompt[:-1])[None], cache=cache)
        out = model(mx.array(prompt[-1:])[None], cache=cache)[0, -1].astype(mx.float32)
        return out - mx.logsumexp(out)

    key = id(model)  # the full cache's distribution once per model: the tests call this many times
    if key not in _FULL_LOG_PROBS:
        _FULL_LOG_PROBS[key] = (model, log_probs(kvcompress.make_cache(model, "full")))  # the model kept alive: its id stays its own
    full = _FULL_LOG_PROBS[key][1]
    return float((mx.exp(full) * (full - log_probs(kvcompress.make_cache(model, method, **params)))).sum())


_FULL_LOG_PROBS: dict = {}
