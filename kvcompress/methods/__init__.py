"""Registry of compression methods: name -> config class. Adding a method is adding one file and
one entry in `REGISTRY`."""

from __future__ import annotations

from typing import Any

from ..adapter import LAYER_CHOICES
from ..errors import ConfigError, build, check
from .base import CompressedCache, Method
from .eviction.adakv import AdaKV
from .composed import ComposedCache
from .eviction.criticalkv import CriticalKV
from .eviction.decoding import Decoding
from .eviction.duoattention import DuoAttention
from .eviction.expected_attention import ExpectedAttention
from .full import Full
from .eviction.h2o import H2O
from .eviction.keydiff import KeyDiff
from .eviction.keyformer import Keyformer
from .quantization.kivi import Kivi
from .quantization.kvquant import KVQuant
from .eviction.knorm import KNorm
from .eviction.kvzip import KVzip
from .quantization.mlx_quant import MlxQuant
from .eviction.pyramidkv import PyramidKV
from .quantization.qjl import Qjl
from .eviction.random_floor import Random
from .eviction.snapkv import SnapKV
from .eviction.streaming import Streaming
from .eviction.tova import TOVA
from .quantization.turboquant import TurboQuant

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
