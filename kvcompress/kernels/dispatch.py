"""One dispatch for every fused kernel: self-test on first use, fall back, record the path that ran.

A fused kernel (CUDA or Metal, compiled at run time; for KIVI's decode attention also a C++
kernel on the CPU) is only trusted after it has matched its MLX reference on this machine. On the
first call per (kernel, backend, dtype, variant) -- the variant being the template parameters that
select a separately compiled instance, such as the code widths -- `select` runs the kernel's small
self-test (a random problem, fused vs reference). If the self-test raises (a compile error, wrong
numbers), it warns once and that key uses the reference from then on, so a Metal source that fails
to compile on a user's Mac costs speed, not results.

`KVCOMPRESS_KERNELS` forces a path: `reference` (never a fused kernel), `fused` (the fused kernel
without self-test, for benchmarks and debugging; an error where the kernel has no backend on the
default device), or unset / `auto` (self-test, then fused or reference). Every call records which path ran; the runner stores
`paths_used()` in each run's `config` (key `kernels`), so a result says whether it came from a
kernel or from the reference.
"""

from __future__ import annotations

import contextlib
import os
import zlib
import warnings
from typing import Callable

import mlx.core as mx

ENV = "KVCOMPRESS_KERNELS"
MODES = ("auto", "reference", "fused")

# Apple GPUs give a threadgroup at most 32 KiB of threadgroup memory (Metal's maxThreadgroupMemoryLength
# on Apple silicon), where CUDA allows a block 48 KiB of static shared memory: a kernel sized for CUDA
# can fail to build its Metal pipeline (tests/metal_on_cpu.py measures each kernel's arrays).
METAL_THREADGROUP_MEMORY = 32768
# MLX passes a Metal kernel's inputs of fewer elements than this in the constant address space, the
# others in the device one (mlx/backend/common/metal_kernel.cpp); a body that mixes the two kinds of
# pointer (`c ? a : b`, `const device T* p = a`) does not compile on a Mac.
METAL_CONSTANT_BELOW = 8

_verdicts: dict[tuple, str] = {}  # (kernel, backend, dtype, variant) -> "fused" | "reference"
_failures: dict[tuple, str] = {}  # the same key -> why its self-test failed ("TypeError: ...")
_paths: dict[str, str] = {}  # "kernel/backend/dtype" -> path of the latest call since reset_paths()


def mode() -> str:
    """The forced path from the environment ("auto" when unset); a bad value is an error."""
    return _parse_mode(os.environ.get(ENV))


def _parse_mode(raw: str | None) -> str:
    value = (raw or "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}: expected one of {', '.join(MODES)} (or unset), got {value!r}")
    return value


def gpu_backend() -> str | None:
    """"cuda" or "metal" when the default device is a GPU of that kind, else None."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.cuda.is_available():
        return "cuda"
    if mx.metal.is_available():
        return "metal"
    return None


def _dtype_name(dtype) -> str:
    return str(dtype).split(".")[-1]


# A decode step calls `select` once per kernel per layer, so its answer is kept per
# (kernel, dtype, variant, raw KVCOMPRESS_KERNELS value, default device): a later call costs one
# environment read and a dict lookup, and a changed variable or device is a new key, so the
# variable still takes effect at once. What `gpu_backend()` reports is read on the first call per
# key only: `forget_verdicts()` drops these answers too (tests that simulate a GPU call it).
_decisions: dict[tuple, tuple[str | None, str, str, bool]] = {}  # key -> (backend, path key, path, overrides)


def select(kernel: str, dtype, variant: tuple, selftest: Callable[[str], None], cpu: bool = False) -> str | None:
    """The backend to run `kernel` fused on, or None to run the MLX reference.

    selftest(backend) runs a small problem through the fused kernel and its reference and raises
    when they differ (or the kernel does not compile). cpu: the kernel has a CPU implementation
    for this call (backend "cpu" where the default device is the CPU)."""
    raw = os.environ.get(ENV)
    key = (kernel, dtype, variant, raw, str(mx.default_device()), cpu)  # a Device hashes by identity
    decision = _decisions.get(key)
    if decision is None:
        decision = _decisions[key] = _decide(kernel, dtype, variant, selftest, _parse_mode(raw), cpu)
    backend, path_key, path, overrides = decision
    # a key that fell back marks the whole (kernel, backend, dtype) as reference for this run,
    # unless a forced mode says otherwise
    if overrides or _paths.get(path_key) != "reference":
        _paths[path_key] = path
    return backend


def _decide(kernel: str, dtype, variant: tuple, selftest: Callable[[str], None], forced: str, cpu: bool = False):
    """(backend or None, path key, path, whether the path overrides an earlier one in the record)."""
    backend = gpu_backend() or ("cpu" if cpu and mx.default_device() == mx.cpu else None)
    path_key = f"{kernel}/{backend or 'cpu'}/{_dtype_name(dtype)}"
    if forced == "fused" and backend is None:
        raise RuntimeError(f"{ENV}=fused but the default device has no fused {kernel} for this call "
                           f"({mx.default_device()}: no CUDA or Metal backend)")
    if forced == "reference" or backend is None:
        return None, path_key, "reference", True
    if forced == "fused":
        return backend, path_key, "fused", True
    key = (kernel, backend, _dtype_name(dtype), variant)
    if key not in _verdicts:
        try:
            selftest(backend)
            _verdicts[key] = "fused"
        except Exception as exc:  # any failure means: do not trust this kernel here
            _verdicts[key] = "reference"
            _failures[key] = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"kvcompress: fused kernel {kernel} ({backend}, {_dtype_name(dtype)}, {variant}) failed its "
                f"self-test, using the MLX reference instead: {type(exc).__name__}: {exc}",
                RuntimeWarning,
                stacklevel=3,
            )
    path = _verdicts[key]
    return (backend if path == "fused" else None), path_key, path, False


def explain(kernel: str, dtype, variant: tuple, selftest: Callable[[str], None], cpu: bool = False) -> tuple[str, str]:
    """(path, why) for a call as `select` takes it (running the self-test if not yet run): what
    `kvcompress doctor` prints per kernel."""
    backend = select(kernel, dtype, variant, selftest, cpu)
    forced = mode()
    if forced != "auto":
        return ("reference" if backend is None else "fused"), f"{ENV}={forced}" + (", no self-test" * (backend is not None))
    if backend is not None:
        return "fused", f"self-test passed on {backend}"
    tried = gpu_backend() or ("cpu" if cpu and mx.default_device() == mx.cpu else None)
    if tried is None:
        return "reference", (f"no GPU back-end: default device {mx.default_device()}, CUDA "
                             f"{'available' if mx.cuda.is_available() else 'absent'}, Metal "
                             f"{'available' if mx.metal.is_available() else 'absent'}, no CPU kernel")
    return "reference", f"self-test failed on {tried}: {_failures.get((kernel, tried, _dtype_name(dtype), variant), '?')}"


def record_reference(kernel: str, dtype) -> None:
    """Record that a call of `kernel` ran the reference because the fused kernel does not cover it."""
    key = (kernel, dtype, str(mx.default_device()))
    path_key = _reference_keys.get(key)
    if path_key is None:
        path_key = _reference_keys[key] = f"{kernel}/{gpu_backend() or 'cpu'}/{_dtype_name(dtype)}"
    _paths[path_key] = "reference"


_reference_keys: dict[tuple, str] = {}  # (kernel, dtype, device) -> path key, as `_decisions`


def paths_used() -> dict[str, str]:
    """{"kernel/backend/dtype": "fused" | "reference"} for the calls since the last reset."""
    return dict(sorted(_paths.items()))


def reset_paths() -> None:
    _paths.clear()


def forget_verdicts() -> None:
    """Drop cached self-test results and the answers kept per key (tests that swap a kernel source
    or simulate a GPU call this)."""
    _verdicts.clear()
    _failures.clear()
    _decisions.clear()
    _reference_keys.clear()


def assert_close(got: mx.array, want: mx.array, rel_l2: float, what: str) -> None:
    """Raise AssertionError unless got is finite and within rel_l2 (relative L2) of want."""
    if _compile_only is not None:  # the stand-in kernels return zeros
        return
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    if not mx.all(mx.isfinite(got)).item():
        raise AssertionError(f"{what}: non-finite output")
    err = (mx.linalg.norm(got - want) / mx.maximum(mx.linalg.norm(want), 1e-30)).item()
    if not err <= rel_l2:
        raise AssertionError(f"{what}: relative L2 error {err:.3g} > {rel_l2:.1g}")


def assert_equal(got, want, what: str) -> None:
    """Raise AssertionError unless every array pair is bit-identical."""
    if _compile_only is not None:
        return
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape or a.dtype != b.dtype or not mx.array_equal(a, b).item():
            raise AssertionError(f"{what}: output {i} differs from the reference")


_constants: dict[tuple, mx.array] = {}


def constant(values: tuple, dtype) -> mx.array:
    """A small kernel argument array, one per distinct value rather than one per call: a decode step
    launches each kernel once per layer with the same arguments, and an array the host has just
    written costs a launch ~4 us more on the H200 (docs/learned.md)."""
    key = (values, dtype)
    if key not in _constants:
        if len(_constants) > 4096:  # values that change every step (positions) come and go
            _constants.clear()
        _constants[key] = mx.array(list(values), dtype)
    return _constants[key]


def fast_kernel(backend: str, name: str, source: str, header: str, inputs: list[str], outputs: list[str],
                **options):
    """`mx.fast.cuda_kernel` or `mx.fast.metal_kernel` for `backend`, named `name`_<CRC of header and
    source>: MLX caches compiled kernels by name, so an edited source gets a new name and recompiles."""
    if backend == "cuda":
        make = _compile_only or mx.fast.cuda_kernel
    else:
        make = mx.fast.metal_kernel
    return make(name=f"{name}_{zlib.crc32((header + source).encode()):08x}", input_names=inputs,
                output_names=outputs, source=source, header=header, **options)


# Each kernel module keeps the kernels it has built in a dict made by `kernel_cache()`, so that
# `clear_kernel_caches()` (tests that swap the kernel factory, `compile_only`) makes every module
# build its kernels anew.
_kernel_caches: list[dict] = []


def kernel_cache() -> dict:
    """An empty dict for a module's built kernels, emptied by `clear_kernel_caches()`."""
    cache: dict = {}
    _kernel_caches.append(cache)
    return cache


def clear_kernel_caches() -> None:
    for cache in _kernel_caches:
        cache.clear()


_compile_only: Callable | None = None  # what builds CUDA kernels inside `compile_only`


@contextlib.contextmanager
def compile_only(make_kernel: Callable):
    """Within: CUDA kernels are built by `make_kernel(**arguments of mx.fast.cuda_kernel)` instead of
    MLX, and the self-tests' comparisons pass whatever the numbers. scripts/cuda_compile_check.py
    hands in a factory that compiles each kernel with NVRTC and returns zeros, then calls every
    kernel's `selftest`: the instantiations compiled are the ones a GPU's first calls would build."""
    global _compile_only
    clear_kernel_caches()
    _compile_only = make_kernel
    try:
        yield
    finally:
        _compile_only = None
        clear_kernel_caches()
