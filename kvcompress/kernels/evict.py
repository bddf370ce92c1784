"""Decode-step eviction for every eviction method: pick one token per row to drop.

Two steps, by the cache's position mode:
- `evict_slot` (exact positions, the default; one pass): only picks, per row, the slot whose token
  goes. Nothing moves: the cache writes its next token into that slot (kvcompress/methods/
  eviction/base.py), so a decode step writes one token per row instead of copying the cache. Slots are
  then in no particular order, so protection and ties go by true position, not by slot index.
- `evict_one` (compact positions): removes the slot and shifts the later tokens down, re-rotating
  their keys one RoPE position back. Every later key changes, so this pass is O(n) by nature.

`evict_one`: after a decode step each row (one (batch, KV head) pair) holds `capacity + 1` tokens
in temporal order. Eviction picks, per row, the unprotected slot with the smallest eviction score -- whatever
the method's score is (accumulated attention for H2O / Keyformer, the current attention for TOVA,
a key norm, a position, ...): the kernel only ranks `evict_by` -- removes it and shifts the later
tokens down one slot. The first `n_sink` and the last `recent` slots are never evicted. In
compact-position mode (StreamingLLM-style) the shifted keys also move one RoPE position back, i.e.
are rotated by -1: k' = R(-theta) k per frequency pair.

Implementations of the same function, side by side:
- `evict_one_reference`: plain MLX ops, used on CPU and as the ground truth.
- one kernel body (`_BODY`) for `mx.fast.cuda_kernel` and `mx.fast.metal_kernel`, behind a small
  per-backend header of macros (indices, shared memory, barrier, unfused float products), as KIVI's
  kernels. Each block recomputes its row's argmin (n floats, cheap) and then copies its slice of
  the row, so a row's copy spreads over many SMs. Products and sums are rounded separately (CUDA
  `__fmul_rn`/`__fadd_rn`, Metal `precise::fma(x, y, 0)`) so the compiler cannot contract them into
  FMAs: that keeps the rotation bit-identical to MLX's separate multiply/subtract kernels. The CUDA
  path is checked bit-exact on an H200 (benchmarks/evict_gpu.py); the Metal path has never run on
  an Apple GPU and is checked bit-exact in the CPU emulator (tests/test_metal_on_cpu.py).
`evict_slot`: the same pair, `evict_slot_reference` and one body (`_SLOT_BODY`) for both GPU
back-ends: one block per row, each thread keeps its best (score, position, slot) over a strided
share of the row, then a shared-memory reduction. It writes only the [R] slots; the token write
stays an MLX scatter, which updates the cache buffer in place (MLX custom kernels cannot write into
an input, so a kernel that wrote the token would have to copy the whole cache). Not yet run on a
GPU when written: tests/test_evict_gpu.py (bit-exact, skipped on CPU) and benchmarks/evict_gpu.py
check and time it there.

Both go through kvcompress/kernels/dispatch.py: on first use per (backend, dtype, variant) the fused
kernel must match the reference bit for bit on a small problem, else the reference runs.

Argmin ties: `evict_one` takes the lowest index (as `mx.argmin`; slots are in temporal order there),
`evict_slot` the lowest true position (the same token).
"""

from __future__ import annotations

import mlx.core as mx

from . import dispatch

# ---------------------------------------------------------------------------------------------
# MLX reference


def protected_mask(n: int, n_sink: int, recent: int) -> mx.array:
    """[n] True where a slot may not be evicted: the first n_sink and the last `recent` slots."""
    index = mx.arange(n)
    return (index < n_sink) | (index >= n - recent)


def rotate_pairs(x: mx.array, cos: mx.array, sin: mx.array, traditional: bool) -> mx.array:
    """Rotate RoPE pairs of x [..., D] by angles given as cos/sin [..., dims/2] (float32 math).

    Non-traditional RoPE pairs element i with i + dims/2; traditional pairs 2i with 2i + 1.
    Elements past `dims` (partial rotary) are left unchanged.
    """
    half = cos.shape[-1]
    dims = 2 * half
    xf = x.astype(mx.float32)
    if traditional:
        x1, x2 = xf[..., 0:dims:2], xf[..., 1:dims:2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:dims]
    out1 = x1 * cos - x2 * sin
    out2 = x1 * sin + x2 * cos
    if traditional:
        rotated = mx.stack([out1, out2], axis=-1).reshape(*x.shape[:-1], dims)
    else:
        rotated = mx.concatenate([out1, out2], axis=-1)
    if dims < x.shape[-1]:
        rotated = mx.concatenate([rotated, xf[..., dims:]], axis=-1)
    return rotated.astype(x.dtype)


def evict_one_reference(keys, values, scores, positions, evict_by, n_sink, recent, rotation=None, traditional=False):
    """Remove from each row the unprotected slot with the lowest `evict_by`.

    keys, values [R, n, D]; scores, evict_by [R, n] float32; positions [R, n] int32.
    rotation: None (exact positions) or (cos, sin) [dims/2] float32 of a one-position step: the
    slots after the evicted one are rotated by -1 position (compact positions).
    Returns keys, values [R, n - 1, D], scores, positions [R, n - 1] and the evicted slot [R].
    """
    R, n, _ = keys.shape
    masked = mx.where(protected_mask(n, n_sink, recent)[None], mx.inf, evict_by)
    evicted = mx.argmin(masked, axis=1).astype(mx.int32)  # [R]
    out_index = mx.arange(n - 1, dtype=mx.int32)[None]
    shifted = out_index >= evicted[:, None]  # [R, n-1]: these slots receive their right neighbour

    def compact(a):
        # two shifted views and a select: contiguous streaming, faster than a gather on CPU
        return mx.where(shifted.reshape(*shifted.shape, *([1] * (a.ndim - 2))), a[:, 1:], a[:, :-1])

    new_keys = compact(keys)
    if rotation is not None:
        cos, sin = rotation
        back = rotate_pairs(new_keys, cos, -sin, traditional)
        new_keys = mx.where(shifted[..., None], back, new_keys)
    return new_keys, compact(values), compact(scores), compact(positions), evicted


# ---------------------------------------------------------------------------------------------
# Fused kernel. Grid: (blocks_per_row * THREADS, R, 1) threads, threadgroup (THREADS, 1, 1).
# Template constants: T (key/value dtype), N_SINK, RECENT, COMPACT, TRADITIONAL, HALF (dims / 2),
# VEC (a token's row is a multiple of 16 bytes: copy in 16-byte vectors).

THREADS = 256

_BODY = """
    const int n = scores_shape[1];
    const int D = keys_shape[2];
    SHARED float best_value[256];
    SHARED int best_index[256];

    // 1. argmin over the evictable slots [N_SINK, n - RECENT) of this row (ties: lowest index)
    float value = INF;
    int index = n;
    for (int i = N_SINK + tid; i < n - RECENT; i += threads) {
        float v = evict_by[row * n + i];
        if (v < value) { value = v; index = i; }
    }
    best_value[tid] = value;
    best_index[tid] = index;
    BARRIER;
    for (int stride = threads / 2; stride > 0; stride /= 2) {
        if (tid < stride) {
            float v = best_value[tid + stride];
            int i = best_index[tid + stride];
            if (v < best_value[tid] || (v == best_value[tid] && i < best_index[tid])) {
                best_value[tid] = v;
                best_index[tid] = i;
            }
        }
        BARRIER;
    }
    const int evicted = best_index[0];
    if (block == 0 && tid == 0) { evicted_out[row] = evicted; }

    // 2. compaction of this block's share of output slots [first, last) of [0, n - 1):
    //    segment A [first, min(last, evicted)) copies the same slots, segment B
    //    [max(first, evicted), last) copies the next slot (and, compact mode, rotates its key)
    const int m = n - 1;
    const int per_block = (m + blocks - 1) / blocks;
    const int first = block * per_block;
    const int last = min(m, first + per_block);
    const int a_end = min(last, evicted);
    const int b_start = max(first, evicted);
    for (int i = first + tid; i < last; i += threads) {
        int src = i + (i >= evicted ? 1 : 0);
        scores_out[row * m + i] = scores[row * n + src];
        positions_out[row * m + i] = positions[row * n + src];
    }
    const size_t row_in = (size_t)row * n * D;
    const size_t row_out = (size_t)row * m * D;
    if (VEC) {
        const int per = D * (int)sizeof(T) / 16;
        const GLOBAL uint4* v_in = (const GLOBAL uint4*)(values + row_in);
        const GLOBAL uint4* k_in = (const GLOBAL uint4*)(keys + row_in);
        GLOBAL uint4* v_out = (GLOBAL uint4*)(values_out + row_out);
        GLOBAL uint4* k_out = (GLOBAL uint4*)(keys_out + row_out);
        for (int e = first * per + tid; e < a_end * per; e += threads) { v_out[e] = v_in[e]; k_out[e] = k_in[e]; }
        for (int e = b_start * per + tid; e < last * per; e += threads) {
            v_out[e] = v_in[e + per];
            if (!COMPACT) k_out[e] = k_in[e + per];
        }
    } else {
        for (int e = first * D + tid; e < a_end * D; e += threads) {
            values_out[row_out + e] = values[row_in + e];
            keys_out[row_out + e] = keys[row_in + e];
        }
        for (int e = b_start * D + tid; e < last * D; e += threads) {
            values_out[row_out + e] = values[row_in + e + D];
            if (!COMPACT) keys_out[row_out + e] = keys[row_in + e + D];
        }
    }
    if (COMPACT) {
        // segment B keys move one RoPE position back: rotate by cos(theta), -sin(theta), with the
        // products and sums rounded separately, in the order rotate_pairs uses
        for (int e = b_start * D + tid; e < last * D; e += threads) {
            int d = e % D;
            size_t in_at = row_in + e + D;
            T k = keys[in_at];
            if (d < 2 * HALF) {
                int f, partner;
                bool first_half;
                if (TRADITIONAL) { f = d / 2; first_half = (d % 2) == 0; partner = first_half ? d + 1 : d - 1; }
                else { f = d % HALF; first_half = d < HALF; partner = first_half ? d + HALF : d - HALF; }
                float c = cos_theta[f];
                float s = -sin_theta[f];
                float x = static_cast<float>(k);
                float y = static_cast<float>(keys[in_at - d + partner]);
                float r = first_half ? FSUB(FMUL(x, c), FMUL(y, s)) : FADD(FMUL(y, s), FMUL(x, c));
                k = static_cast<T>(r);
            }
            keys_out[row_out + e] = k;
        }
    }
"""

CUDA_HEADER = """
#define SHARED __shared__
#define BARRIER __syncthreads()
#define GLOBAL
#define INF __int_as_float(0x7f800000)
#define FMUL(a, b) __fmul_rn((a), (b))
#define FADD(a, b) __fadd_rn((a), (b))
#define FSUB(a, b) __fsub_rn((a), (b))
"""
CUDA_SOURCE = """
    const int row = blockIdx.y;
    const int tid = threadIdx.x;
    const int threads = blockDim.x;
    const int blocks = gridDim.x;
    const int block = blockIdx.x;
""" + _BODY

METAL_HEADER = """
#define SHARED threadgroup
#define BARRIER threadgroup_barrier(mem_flags::mem_threadgroup)
#define GLOBAL device
#define INF INFINITY
#define FMUL(a, b) metal::precise::fma((a), (b), 0.0f)
#define FADD(a, b) ((a) + (b))
#define FSUB(a, b) ((a) - (b))
"""
METAL_SOURCE = """
    const int row = threadgroup_position_in_grid.y;
    const int tid = thread_position_in_threadgroup.x;
    const int threads = threads_per_threadgroup.x;
    const int blocks = threadgroups_per_grid.x;
    const int block = threadgroup_position_in_grid.x;
""" + _BODY

_INPUTS = ["keys", "values", "scores", "positions", "evict_by", "cos_theta", "sin_theta"]
_OUTPUTS = ["keys_out", "values_out", "scores_out", "positions_out", "evicted_out"]
_kernels = dispatch.kernel_cache()


def _kernel(backend: str):
    if backend not in _kernels:
        source, header = (CUDA_SOURCE, CUDA_HEADER) if backend == "cuda" else (METAL_SOURCE, METAL_HEADER)
        _kernels[backend] = dispatch.fast_kernel(backend, "evict_one", source, header, _INPUTS, _OUTPUTS)
    return _kernels[backend]


def evict_one_fused(
    keys, values, scores, positions, evict_by, n_sink, recent, rotation=None, traditional=False, backend="cuda", blocks_per_row=None
):
    """`evict_one_reference` as one fused GPU kernel (backend "cuda" or "metal")."""
    R, n, D = keys.shape
    if rotation is None:
        cos = sin = mx.zeros((1,), mx.float32)
    else:
        cos, sin = (a.astype(mx.float32) for a in rotation)
    half = cos.shape[-1] if rotation is not None else 1
    if blocks_per_row is None:
        # every block re-reads its row's n scores for the argmin (4 bytes per slot, against
        # 2 * 2 * D * itemsize copied), so many blocks per row are cheap; on the H200 at R = 32,
        # n = 8192 time fell from 4 to 64 blocks per row (measured with what is now
        # benchmarks/evict_gpu.py)
        blocks_per_row = max(1, min(64, (n - 1) // 128))
    outs = _kernel(backend)(
        inputs=[keys, values, scores.astype(mx.float32), positions.astype(mx.int32), evict_by.astype(mx.float32), cos, sin],
        template=[
            ("T", keys.dtype),
            ("N_SINK", int(n_sink)),
            ("RECENT", int(recent)),
            ("COMPACT", int(rotation is not None)),
            ("TRADITIONAL", int(bool(traditional))),
            ("HALF", int(half)),
            ("VEC", int((D * keys.dtype.size) % 16 == 0)),
        ],
        grid=(blocks_per_row * THREADS, R, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(R, n - 1, D), (R, n - 1, D), (R, n - 1), (R, n - 1), (R,)],
        output_dtypes=[keys.dtype, values.dtype, mx.float32, mx.int32, mx.int32],
    )
    return tuple(outs)


def selftest(backend: str, dtype, compact: bool, traditional: bool) -> None:
    """Bit-exact check of the fused kernel against the reference on a small random problem with
    score ties (the lowest-index rule) and 72-byte rows (the scalar copy path) besides 128-byte ones."""
    for R, n, D in ((3, 77, 36), (4, 300, 64)):
        k1, k2, k3 = mx.random.split(mx.random.key(n), 3)
        keys = mx.random.normal((R, n, D), key=k1).astype(dtype)
        values = mx.random.normal((R, n, D), key=k2).astype(dtype)
        scores = mx.floor(mx.random.uniform(shape=(R, n), key=k3) * 8)  # ties
        positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32) * 3, (R, n))
        rotation = None
        if compact:
            theta = 10000.0 ** (-mx.arange(0, D, 2, dtype=mx.float32) / D)
            rotation = (mx.cos(theta), mx.sin(theta))
        args = (keys, values, scores, positions, scores, 2, 5, rotation, traditional)
        dispatch.assert_equal(evict_one_fused(*args, backend=backend), evict_one_reference(*args), "evict_one self-test")


def evict_one(keys, values, scores, positions, evict_by, n_sink, recent, rotation=None, traditional=False):
    """Decode-step eviction: the fused kernel where it passed its self-test on this machine, else the
    MLX reference (kvcompress/kernels/dispatch.py; KVCOMPRESS_KERNELS forces either)."""
    variant = (rotation is not None, bool(traditional))
    backend = dispatch.select("evict_one", keys.dtype, variant, lambda b: selftest(b, keys.dtype, *variant))
    if backend is None:
        return evict_one_reference(keys, values, scores, positions, evict_by, n_sink, recent, rotation, traditional)
    return evict_one_fused(keys, values, scores, positions, evict_by, n_sink, recent, rotation, traditional, backend)


# ---------------------------------------------------------------------------------------------
# One pass (exact positions): which slot's token goes. Slots in any order.

INT32_MAX = 2**31 - 1


def evict_slot_reference(evict_by, positions, n_sink, recent_start):
    """The slot [R] int32 per row whose token is evicted: the lowest `evict_by` among unprotected
    slots, ties to the lowest true position.

    evict_by [R, n] float32, positions [R, n] int32 true positions (slots in any order). Protected:
    positions < n_sink (the sinks) and positions >= recent_start (the recent window: the newest
    tokens, all of which are held).
    """
    protected = (positions < n_sink) | (positions >= recent_start)
    masked = mx.where(protected, mx.inf, evict_by)
    lowest = masked.min(axis=1, keepdims=True)
    return mx.argmin(mx.where(masked == lowest, positions, INT32_MAX), axis=1).astype(mx.int32)


# Grid: (SLOT_THREADS, R, 1) threads, threadgroup (SLOT_THREADS, 1, 1): one block per row. A decode
# step has few rows (B * H_kv, 8 for Llama-3.1-8B) and long ones, so each block is wide and every
# thread issues SLOT_UNROLL slots' loads before comparing any (one slot at a time, each thread
# waited out two memory latencies per slot: 28-41 us per call at 16k slots on the H200).
SLOT_THREADS = 1024
SLOT_UNROLL = 4
_SLOT_BODY = """
    const int n = evict_by_shape[1];
    const int n_sink = bounds[0];
    const int recent_start = bounds[1];
    SHARED float best_value[SLOT_THREADS];
    SHARED int best_position[SLOT_THREADS];
    SHARED int best_slot[SLOT_THREADS];

    // (value, position) ordered lexicographically, so the order slots are visited in does not
    // matter; protected slots never win, a row with no evictable slot reports slot 0 (the caller
    // guarantees one exists)
    float value = INF;
    int position = 2147483647;
    int slot = 0;
    for (int base = tid; base < n; base += SLOT_UNROLL * threads) {
        int p[SLOT_UNROLL];
        float v[SLOT_UNROLL];
        for (int u = 0; u < SLOT_UNROLL; ++u) {  // all loads first: they are in flight together
            int i = base + u * threads;
            p[u] = i < n ? positions[row * n + i] : 0;
            v[u] = i < n ? evict_by[row * n + i] : INF;
        }
        for (int u = 0; u < SLOT_UNROLL; ++u) {
            int i = base + u * threads;
            if (i >= n || p[u] < n_sink || p[u] >= recent_start) continue;
            if (v[u] < value || (v[u] == value && p[u] < position)) { value = v[u]; position = p[u]; slot = i; }
        }
    }
    best_value[tid] = value;
    best_position[tid] = position;
    best_slot[tid] = slot;
    BARRIER;
    for (int stride = threads / 2; stride > 0; stride /= 2) {
        if (tid < stride) {
            float v = best_value[tid + stride];
            int p = best_position[tid + stride];
            if (v < best_value[tid] || (v == best_value[tid] && p < best_position[tid])) {
                best_value[tid] = v;
                best_position[tid] = p;
                best_slot[tid] = best_slot[tid + stride];
            }
        }
        BARRIER;
    }
    if (tid == 0) { slot_out[row] = best_slot[0]; }
"""

_SLOT_INDEX = {
    "cuda": """
    const int row = blockIdx.y;
    const int tid = threadIdx.x;
    const int threads = blockDim.x;
""",
    "metal": """
    const int row = threadgroup_position_in_grid.y;
    const int tid = thread_position_in_threadgroup.x;
    const int threads = threads_per_threadgroup.x;
""",
}
_slot_kernels = dispatch.kernel_cache()


def _slot_kernel(backend: str):
    if backend not in _slot_kernels:
        defines = f"#define SLOT_THREADS {SLOT_THREADS}\n#define SLOT_UNROLL {SLOT_UNROLL}\n"
        header = (CUDA_HEADER if backend == "cuda" else METAL_HEADER) + defines
        _slot_kernels[backend] = dispatch.fast_kernel(backend, "evict_slot", _SLOT_INDEX[backend] + _SLOT_BODY, header,
                                                      ["evict_by", "positions", "bounds"], ["slot_out"])
    return _slot_kernels[backend]


def evict_slot_fused(evict_by, positions, n_sink, recent_start, backend="cuda"):
    """`evict_slot_reference` as one GPU kernel (backend "cuda" or "metal")."""
    R = evict_by.shape[0]
    # the bounds change every step: an input, not a template constant (no recompiling per step),
    # shared by every layer of the step
    bounds = dispatch.constant((int(n_sink), int(recent_start)), mx.int32)
    (slot,) = _slot_kernel(backend)(
        inputs=[evict_by.astype(mx.float32), positions.astype(mx.int32), bounds],
        grid=(SLOT_THREADS, R, 1),
        threadgroup=(SLOT_THREADS, 1, 1),
        output_shapes=[(R,)],
        output_dtypes=[mx.int32],
    )
    return slot


def slot_selftest(backend: str) -> None:
    """Bit-exact check on rows with score ties and shuffled positions (slots out of order)."""
    for R, n in ((3, 77), (5, 1000)):
        k1, k2 = mx.random.split(mx.random.key(n), 2)
        evict_by = mx.floor(mx.random.uniform(shape=(R, n), key=k1) * 6)  # ties
        positions = mx.argsort(mx.random.uniform(shape=(R, n), key=k2), axis=1).astype(mx.int32) * 2
        args = (evict_by, positions, 3, 2 * n - 11)
        dispatch.assert_equal([evict_slot_fused(*args, backend=backend)], [evict_slot_reference(*args)], "evict_slot self-test")


def evict_slot(evict_by, positions, n_sink, recent_start):
    """One-pass eviction: the fused kernel where it passed its self-test on this machine, else the
    MLX reference (kvcompress/kernels/dispatch.py; KVCOMPRESS_KERNELS forces either)."""
    backend = dispatch.select("evict_slot", mx.float32, (), slot_selftest)
    if backend is None:
        return evict_slot_reference(evict_by, positions, n_sink, recent_start)
    return evict_slot_fused(evict_by, positions, n_sink, recent_start, backend)
