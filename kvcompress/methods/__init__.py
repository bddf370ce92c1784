"""Compression methods by family: `eviction/` (keep some tokens), `quantization/` (keep every token in
fewer bits), `composed.py` (an eviction method's kept tokens stored by a quantizer), `full.py` (the
uncompressed baseline); `base.py` is what every method is, `registry.py` finds one by name.

Adding a method is adding one file to its family and one entry in the tuple below."""

from __future__ import annotations

from ..errors import ConfigError
from .base import CompressedCache, Method
from .composed import ComposedCache
from .eviction.adakv import AdaKV
from .eviction.criticalkv import CriticalKV
from .eviction.decoding import Decoding
from .eviction.duoattention import DuoAttention
from .eviction.expected_attention import ExpectedAttention
from .eviction.h2o import H2O
from .eviction.keydiff import KeyDiff
from .eviction.keyformer import Keyformer
from .eviction.knorm import KNorm
from .eviction.kvzip import KVzip
from .eviction.pyramidkv import PyramidKV
from .eviction.random_floor import Random
from .eviction.snapkv import SnapKV
from .eviction.streaming import Streaming
from .eviction.tova import TOVA
from .full import Full
from .quantization.kivi import Kivi
from .quantization.kvquant import KVQuant
from .quantization.mlx_quant import MlxQuant
from .quantization.qjl import Qjl
from .quantization.turboquant import TurboQuant
from .registry import REGISTRY, list_methods, method_config

REGISTRY.update({
    cls.name: cls
    for cls in (Full, MlxQuant, Kivi, TurboQuant, Qjl, KVQuant, Streaming, H2O, Keyformer, SnapKV, PyramidKV, AdaKV,
                TOVA, KNorm, Random, KeyDiff, ExpectedAttention, CriticalKV, DuoAttention, Decoding, KVzip)
})

__all__ = ["REGISTRY", "ComposedCache", "CompressedCache", "ConfigError", "Method", "list_methods", "method_config"]
