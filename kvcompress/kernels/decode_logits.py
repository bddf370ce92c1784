"""A decode step's attention logits for the methods that score from them (H2O, TOVA, Keyformer).

A scoring eviction cache takes its output from SDPA and needs the step's logits beside it:
logits[r, m, j] = q[r, m] . k[r, j] for the M query rows of each KV head's group (M = 4 for
Llama-3.1-8B) over its n kept keys. MLX computes that as a batched matmul with M columns, for which
the H200's GEMM picks a tensor-core tile that reads the keys at a fraction of bandwidth: 41-50 us
per layer at 16k slots, as long as SDPA's whole attention (42 us; benchmarks/evict_decode_gpu.py).

This kernel gives each thread one key: it reads the key row once (16-byte loads), the group's M
queries sit in shared memory, and the M dot products accumulate in float32. Like the matmul it
rounds each logit to the key dtype before widening it to float32, so the two paths differ only by
the order of the float32 sums (within one rounding step of the key dtype).

Reference: `kvcompress.methods.prompt_scores.folded_logits`. Both take queries [R, G, L, D] and the
cache's key buffer; the kernel reads the buffer [R, allocated, D] directly (the n slots in use are a
strided view of it, which MLX would copy to hand to a custom kernel). `decode_logits` picks the path
through kernels/dispatch.py (self-test on first use, fallback to the reference).
"""

from __future__ import annotations

import zlib

import mlx.core as mx

from . import dispatch

THREADS = 256
MAX_ROWS = 16  # query rows per KV head the kernel keeps in registers (G * L)

# Grid: (ceil(n / THREADS) * THREADS, R, 1), threadgroup (THREADS, 1, 1). Template: T (key dtype),
# D, M (query rows), W (key elements per 16-byte load).
_BODY = """
    const int n = dims[0];
    const int allocated = dims[1];
    LG_SHARED float qs[M * D];
    for (int i = tid; i < M * D; i += THREADS) {
        qs[i] = (float)q[row * M * D + i];
    }
    LG_BARRIER();
    if (key >= n) return;
    const LG_DEVICE T* k = keys + ((long)row * allocated + key) * D;
    float acc[M];
    for (int m = 0; m < M; ++m) acc[m] = 0.0f;
    for (int c = 0; c < D; c += W) {
        T kv[W];
        LOAD16(kv, k + c);
        for (int j = 0; j < W; ++j) {
            const float kf = (float)kv[j];
            for (int m = 0; m < M; ++m) acc[m] += qs[m * D + c + j] * kf;
        }
    }
    for (int m = 0; m < M; ++m) {
        logits[((long)row * M + m) * n + key] = (float)(T)acc[m];
    }
"""

CUDA_HEADER = """
#define LG_SHARED __shared__
#define LG_BARRIER() __syncthreads()
#define LG_DEVICE
#define LOAD16(dst, src) (*reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src))
"""
CUDA_SOURCE = (
    "const int tid = threadIdx.x; const int key = blockIdx.x * blockDim.x + threadIdx.x;"
    " const long row = blockIdx.y;\n" + _BODY
)
# Metal: UNTESTED here (no Apple GPU on these machines); the dispatch self-tests it on first use.
METAL_HEADER = """
#define LG_SHARED threadgroup
#define LG_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define LG_DEVICE device
#define LOAD16(dst, src) for (int w_ = 0; w_ < W; ++w_) { (dst)[w_] = (src)[w_]; }
"""
METAL_SOURCE = (
    "const int tid = (int)thread_position_in_threadgroup.x; const int key = (int)thread_position_in_grid.x;"
    " const long row = (long)threadgroup_position_in_grid.y;\n" + _BODY
)

_kernels: dict[str, object] = {}


def _kernel(backend: str):
    if backend not in _kernels:
        header, source = (CUDA_HEADER, CUDA_SOURCE) if backend == "cuda" else (METAL_HEADER, METAL_SOURCE)
        # MLX caches compiled kernels by name: a name per source text, so an edited source recompiles
        name = f"decode_logits_{zlib.crc32((header + source).encode()):08x}"
        make = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
        _kernels[backend] = make(name=name, input_names=["q", "keys", "dims"], output_names=["logits"],
                                 source=source, header=header)
    return _kernels[backend]


def decode_logits_reference(queries, key_buffer, n: int, scale: float) -> mx.array:
    """queries [R, G, L, D], key_buffer [R, allocated, D] (slots [0, n) in use) -> [R, G, L, n] float32."""
    from ..methods.prompt_scores import folded_logits  # the methods package imports this module

    return folded_logits(queries, key_buffer[:, :n], scale)


def decode_logits_fused(queries, key_buffer, n: int, scale: float, backend: str = "cuda") -> mx.array:
    """The fused kernel; same contract as `decode_logits_reference` for supported inputs."""
    R, G, L, D = queries.shape
    M = G * L
    dtype = key_buffer.dtype
    # scaled in the query dtype and cast, exactly as the reference does before its matmul
    q = (queries.reshape(R, M, D) * scale).astype(dtype)
    dims = mx.array([n, key_buffer.shape[1]], dtype=mx.int32)
    (logits,) = _kernel(backend)(
        inputs=[q, key_buffer, dims],
        template=[("T", dtype), ("D", D), ("M", M), ("W", 16 // dtype.size), ("THREADS", THREADS)],
        grid=(-(-n // THREADS) * THREADS, R, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(R, M, n)],
        output_dtypes=[mx.float32],
    )
    return logits.reshape(R, G, L, n)


def fused_supported(queries, key_buffer) -> bool:
    R, G, L, D = queries.shape
    return (G * L <= MAX_ROWS and key_buffer.dtype in (mx.float16, mx.bfloat16, mx.float32)
            and (D * key_buffer.dtype.size) % 16 == 0 and G * L * D * 4 <= 32 * 1024)


def _selftest(backend: str, dtype) -> None:
    for R, G, L, D, allocated, n in ((3, 4, 1, 64, 300, 257), (2, 8, 1, 128, 512, 500)):
        k1, k2 = mx.random.split(mx.random.key(n), 2)
        queries = mx.random.normal((R, G, L, D), key=k1).astype(dtype)
        key_buffer = mx.random.normal((R, allocated, D), key=k2).astype(dtype)
        want = decode_logits_reference(queries, key_buffer, n, D**-0.5)
        dispatch.assert_close(decode_logits_fused(queries, key_buffer, n, D**-0.5, backend), want, 2e-3, "decode_logits self-test")


def decode_logits(queries, key_buffer, n: int, scale: float) -> mx.array:
    """The step's logits [R, G, L, n] float32: the fused kernel where it passed its self-test on this
    machine (and supports the shape), else the MLX reference."""
    if not fused_supported(queries, key_buffer):
        dispatch.record_reference("decode_logits", key_buffer.dtype)
        return decode_logits_reference(queries, key_buffer, n, scale)
    dtype = key_buffer.dtype
    backend = dispatch.select("decode_logits", dtype, (), lambda b: _selftest(b, dtype))
    if backend is None:
        return decode_logits_reference(queries, key_buffer, n, scale)
    return decode_logits_fused(queries, key_buffer, n, scale, backend)
