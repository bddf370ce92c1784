"""Eviction methods: each keeps a budget of tokens per KV head and drops the rest.

`base.py` is the family's base (`Eviction`, the config every method extends, and `EvictionCache`,
the one cache they all build); `scoring/` holds the scoring machinery several methods share (tiled
prompt scores, the base of methods that rank by another method's scores, the base of methods that
score a token once from its key). Every other file is one method, named as its registry name.

The base's names are importable from the family too (`from kvcompress.methods.eviction import
Eviction`), as they were when the base was the module `methods/eviction.py`.
"""

from ...adapter import rope_rotations
from .base import PAD, Eviction, EvictionCache

__all__ = ["PAD", "Eviction", "EvictionCache", "rope_rotations"]
