"""Model fixtures that need nothing but MLX and mlx-lm: conftest.py imports them, and a GPU machine
without the project installed loads them alone (`pytest --noconftest -p model_fixtures`, as
benchmarks/kivi_gpu_check.sh does)."""

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
