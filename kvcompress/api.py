"""The public entry points: load a model, build a compressed cache, load a dataset."""

from __future__ import annotations

from typing import Any

from . import attention
from .methods import method_config


def make_cache(model, method: str = "full", max_tokens: int | None = None, **params: Any) -> list:
    """An mlx-lm prompt cache for `model` compressed by `method` (see `kvcompress.list_methods()`).

    Usable as `mlx_lm.stream_generate(model, tokenizer, prompt, prompt_cache=make_cache(...))`, except
    for a method that scores the prompt by reconstructing it (`kvzip`), which a generate call cannot
    run: prefill and compress the prompt with `kvcompress.compress_prompt(model, tokenizer, cache,
    prompt)`, then generate from the cache with what follows the prompt.
    Installs the attention hook so caches that attend themselves (Keyformer, KIVI) are called.
    `max_tokens`: the tokens you will generate, for methods that schedule over them (Keyformer's tau).
    """
    attention.install()
    config = method_config(method, **params)
    if max_tokens is not None:
        config = config.for_run(max_tokens)
    return config.make_cache(model)


def compress_prompt(model, tokenizer, cache: list, prompt: list[int]) -> list:
    """Prefill `prompt` (token ids) into `cache` (from `make_cache`) and compress it, running KVzip's
    reconstruction pass where the method needs one (kvcompress/reconstruct.py); then generate from
    `cache` with the tokens that follow the prompt. Returns `cache`."""
    from .reconstruct import compress_prompt as _compress

    attention.install()
    return _compress(model, tokenizer, cache, prompt)


def load_prompt_cache(path: str, model=None, return_metadata: bool = False):
    """mlx-lm's `load_prompt_cache`, for kvcompress caches too.

    mlx-lm restores caches by class name from `mlx_lm.models.cache` only; importing
    `kvcompress.methods` registers kvcompress's cache classes there, so mlx-lm's own loader works
    after `import kvcompress`. A saved cache decodes exactly as the original would have, from any
    point (mid-prompt, a compression pending, mid-answer). Modules cannot be saved: given `model`,
    each cache gets its layer's back (the RoPE: compact positions, KVQuant and a pending Expected
    Attention compression need it; the output projection: CriticalKV's, KVzip+'s); a cache loaded
    without it raises where it needs one.
    """
    from mlx_lm.models.cache import load_prompt_cache as mlx_load

    from .methods import CompressedCache

    cache, metadata = mlx_load(path, return_metadata=True)
    if model is not None:
        from .adapter import model_layout

        for layer in model_layout(model).attention:
            if isinstance(cache[layer.index], CompressedCache):
                cache[layer.index].attach(layer)
    return (cache, metadata) if return_metadata else cache


def load_model(name_or_path: str = "smollm2-135m", dtype=None, bits: int | None = None):
    """(model, tokenizer). "smollm2-135m" and "qwen2.5-coder-1.5b" are the embedded models; a path
    ending in .gguf is any GGUF file (converted once, cached); anything else goes to mlx_lm.load.
    `dtype`: float32, float16 or bfloat16 (default: float16 on a GPU, float32 on a CPU); `bits`: a
    GGUF model re-quantized by MLX (2-8 bits) instead of dense weights (kvcompress/model.py)."""
    from .model import load_model as _load

    return _load(name_or_path, dtype, bits)


def load_dataset(name: str, **params: Any):
    """A `datasets.Dataset` in kvcompress's schema (see kvcompress/datasets)."""
    from .datasets import load_dataset as _load

    return _load(name, **params)
