"""Load an optimized BLAS before MLX on Linux.

The `mlx-cpu` wheel links a netlib *reference* BLAS: an fp32 matmul runs at 2-5 GFLOP/s. MLX
resolves `cblas_sgemm` through the global symbol table, so loading OpenBLAS with RTLD_GLOBAL
before `mlx.core` is imported makes every matmul use it (40-90x faster on this CPU). Set
`KVCOMPRESS_BLAS` to a library path to choose one, or to `reference` to keep the wheel's own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import warnings

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

loaded: str | None = None  # path of the BLAS this process uses, None for MLX's own


def preload() -> str | None:
    """Load the first optimized BLAS found; return its path (None off Linux or when none is found)."""
    global loaded
    if loaded or not sys.platform.startswith("linux"):
        return loaded
    choice = os.environ.get("KVCOMPRESS_BLAS", "")
    if choice == "reference":
        return None
    if "mlx.core" in sys.modules:
        warnings.warn("mlx was imported before kvcompress: matmuls use the slow reference BLAS", stacklevel=3)
        return None
    found = ctypes.util.find_library("openblas")
    for path in ([choice] if choice else [*CANDIDATES, *([found] if found else [])]):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        loaded = path
        return loaded
    warnings.warn(
        "no optimized BLAS found (install libopenblas0-pthread): MLX matmuls run ~40x slower", stacklevel=3
    )
    return None
