"""Registry of compression methods: name -> config class. Adding a method is adding one file and
one entry in `REGISTRY`."""

from __future__ import annotations

from typing import Any

from ..adapter import LAYER_CHOICES
from ..errors import ConfigError, build, check
from .base import CompressedCache, Method
from .adakv import AdaKV
from .composed import ComposedCache
from .criticalkv import CriticalKV
from .decoding import Decoding
from .duoattention import DuoAttention
from .expected_attention import ExpectedAttention
from .full import Full
from .h2o import H2O
from .keydiff import KeyDiff
from .keyformer import Keyformer
from .kivi import Kivi
from .kvquant import KVQuant
from .knorm import KNorm
from .kvzip import KVzip
from .mlx_quant import MlxQuant
from .pyramidkv import PyramidKV
from .qjl import Qjl
from .random_floor import Random
from .snapkv import SnapKV
from .streaming import Streaming
from .tova import TOVA
from .turboquant import TurboQuant

REGISTRY: dict[str, type[Method]] = {
    cls.name: cls
    for cls in (Full, MlxQuant, Kivi, TurboQuant, Qjl, KVQuant, Streaming, H2O, Keyformer, SnapKV, PyramidKV, AdaKV,
                TOVA, KNorm, Random, KeyDiff, ExpectedAttention, CriticalKV, DuoAttention, Decoding, KVzip)
}


def method_config(name: str, **params: Any) -> Method:
    """Build a validated method config, naming the bad field and the allowed values on error."""
    config = build("method", REGISTRY, name, params)
    check(config.layers in LAYER_CHOICES, f"{name}.layers", f"one of {LAYER_CHOICES}", config.layers)
    return config


def list_methods() -> list[dict[str, Any]]:
    """Every registered method with its one-line doc and parameters with their defaults."""
    return [cls.describe() for cls in REGISTRY.values()]


__all__ = ["REGISTRY", "ComposedCache", "CompressedCache", "ConfigError", "Method", "list_methods", "method_config"]
