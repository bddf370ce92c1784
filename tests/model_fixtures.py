"""Model fixtures that need nothing but MLX and mlx-lm: conftest.py imports them, and a GPU machine
without the project installed loads them alone (`pytest --noconftest -p model_fixtures`, as
scripts/gpu_tests.sh does). Also `TwinCaches`, for tests that compare two paths of a cache."""

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

