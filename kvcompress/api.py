"""The public entry points: load a model, build a compressed cache, load a dataset."""

from __future__ import annotations

from typing import Any

from . import attention
from .methods import method_config


def make_cache(model, method: str = "full", **params: Any) -> list:
    """An mlx-lm prompt cache for `model` compressed by `method` (see `kvcompress.methods()`).

    Usable as `mlx_lm.stream_generate(model, tokenizer, prompt, prompt_cache=make_cache(...))`.
    Installs the attention hook so caches that attend themselves (Keyformer, KIVI) are called.
    """
    attention.install()
    return method_config(method, **params).make_cache(model)


def load_model(name_or_path: str = "smollm2-135m"):
    """(model, tokenizer). "smollm2-135m" is the embedded model; anything else goes to mlx_lm.load."""
    from .model import load_model as _load

    return _load(name_or_path)


def load_dataset(name: str, **params: Any):
    """A `datasets.Dataset` in kvcompress's schema (see kvcompress/datasets)."""
    from .datasets import load_dataset as _load

    return _load(name, **params)
