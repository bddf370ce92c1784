"""kvcompress: evaluate KV-cache compression (Keyformer, KIVI, ...) on MLX models."""

from . import _blas

_blas.preload()  # must run before mlx.core is imported anywhere below

from .api import compress_prompt, load_dataset, load_model, load_prompt_cache, make_cache  # noqa: E402
from .errors import ConfigError  # noqa: E402
from .methods import list_methods, method_config  # noqa: E402

# `kvcompress.methods` is the subpackage (its REGISTRY, Method, ...); `list_methods()` describes them
__all__ = ["ConfigError", "compress_prompt", "list_methods", "load_dataset", "load_model", "load_prompt_cache", "make_cache", "method_config"]
