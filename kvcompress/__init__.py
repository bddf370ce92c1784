"""kvcompress: evaluate KV-cache compression (Keyformer, KIVI, ...) on MLX models."""

from . import _blas

_blas.preload()  # must run before mlx.core is imported anywhere below

from .api import load_dataset, load_model, load_prompt_cache, make_cache  # noqa: E402
from .methods import ConfigError, method_config, methods  # noqa: E402

__all__ = ["ConfigError", "load_dataset", "load_model", "load_prompt_cache", "make_cache", "method_config", "methods"]
