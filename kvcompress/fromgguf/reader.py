"""Read a GGUF file with ggml's own `gguf` package: its metadata as Python values, its tensors
dequantized to float32 numpy arrays by `gguf.quants.dequantize` (llama.cpp's reference decoders).

`gguf` is imported here and nowhere else, and only while converting: a cached conversion loads
without it (kvcompress/fromgguf/convert.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..errors import ConfigError


@dataclass(frozen=True)
class GGUFTensor:
    name: str  # GGUF name, e.g. "blk.3.attn_q.weight"
    type_name: str  # ggml type, e.g. "Q4_K"
    shape: tuple[int, ...]  # numpy order (rows, columns): ggml's `ne` reversed


class GGUFFile:
    """One GGUF file, memory-mapped: metadata now, tensors when asked for."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError) as error:  # not a GGUF file (bad magic), truncated, unreadable
            raise ConfigError(f"name_or_path: expected a readable GGUF file, got {str(path)!r} ({error})") from error
        self._tensors = {t.name: t for t in self._reader.tensors}

    def metadata(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python (int, float, str, list); `default` where the key is absent."""
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def require(self, key: str) -> Any:
        if key not in self._reader.fields:
            raise ConfigError(f"{key}: expected in the GGUF metadata of {self.path.name}, missing")
        return self.metadata(key)

    @property
    def tensors(self) -> list[GGUFTensor]:
        return [GGUFTensor(t.name, t.tensor_type.name, tuple(int(n) for n in reversed(t.shape)))
                for t in self._tensors.values()]

    def check_readable(self) -> None:
        """Every tensor's type has a `gguf` decoder; else a ConfigError naming the tensor, its type and
        the types `gguf` reads (before any conversion work)."""
        readable = readable_types()
        for tensor in self.tensors:
            if tensor.type_name not in readable:
                raise ConfigError(f"{tensor.name}: tensor type {tensor.type_name} cannot be dequantized by the "
                                  f"installed `gguf` package; readable types: {sorted(readable)}")

    def dequantize(self, name: str) -> np.ndarray:
        """A tensor as float32, shaped (rows, columns) as its numpy view."""
        from gguf import quants

        tensor = self._tensors[name]
        try:
            values = quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as error:
            raise ConfigError(f"{name}: tensor type {tensor.tensor_type.name} cannot be dequantized by the "
                              f"installed `gguf` package ({error})") from error
        return np.asarray(values, dtype=np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))

    def iter_dequantized(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self._tensors:
            yield name, self.dequantize(name)


def readable_types() -> set[str]:
    """ggml tensor types the installed `gguf` package dequantizes."""
    from gguf import GGMLQuantizationType, quants

    return {"F32", "F16"} | {t.name for t in GGMLQuantizationType if t in quants._type_traits}
