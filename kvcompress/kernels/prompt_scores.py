"""H2O's and Keyformer's prompt scores on tensor cores: every key's causal attention summed over a
prompt's queries.

s_j = sum over the query rows m (the G heads of a KV row times the L prompt queries) of
softmax(x_m)_j, x_mj = q_m . k_j (queries pre-scaled) for the keys j the query at position p(m) sees
(j <= p(m)); for Keyformer x_mj = (q_m . k_j + zeta_mj) / tau_m, its Gumbel noise drawn in the
kernels from the counter hash of kvcompress/methods/counter_hash.py (`PromptNoise`).
kvcompress/methods/prompt_scores.py computes it in MLX tiles: a matmul writes each tile of logits,
then a compiled chain, a softmax and a column sum each read and write it again; at 32k (8 KV heads
x 4, D 128, fp16) that made H2O's prefill ~3x the full cache's on the H200 and Keyformer's ~4.4x
(benchmarks/EVICTION_GPU_NOTES.md): the tiles' memory traffic, not their arithmetic, bounds it.
Here two kernels keep every logit on the chip (FlashAttention's two-pass form, Dao et al. 2022):

1. `row_lse`: one block per 64 query rows, their fragments in registers; over tiles of 64 keys
   streamed through shared memory, the logits q . k from tensor-core products (wmma 16x16x16,
   float accumulation) go through shared memory to the threads, which keep each row's running max
   and sum: the row's log-sum-exp lse_m.
2. `column_sums`: one block per 64 keys, their fragments in registers; over tiles of 64 query rows
   that see any of them, streamed the same way, the products k . q, then exp(x_mj - lse_m) summed
   along each key's row of the tile.

Each pass is one product per (query row, key) pair on tensor cores and no tile leaves the chip; a
prefill attention computes the same products once more for its output. The rows are query-major
(row m = query i, head g: m = i * G + g), so a 64-row tile holds 64 / G consecutive queries and the
causal limit of a tile is tight. The logits are rounded to the model's dtype before the softmax,
as the MLX path's product in that dtype rounds them.

CUDA only (fp16 / bf16: what tensor cores take), head dims 16..128 in steps of 16; Metal and the
rest run the MLX path. Also run on the CPU by tests/cuda_on_cpu.py (whose wmma stand-in keeps a
whole tile per thread, float32 instantiations); scripts/cuda_compile_check.py compiles them for
sm_90. Its dispatch self-test guards it (a compile error or a wrong number there: the MLX path
runs). Measured on the H200 (benchmarks/EVICTION_GPU_NOTES.md): one layer at 32k, 8 KV heads x
4, D 128, fp16, the two passes 25 + 36 ms for H2O (the MLX tiles: 131; SDPA's causal attention over
the same prompt: 14) and 48 + 53 ms with Keyformer's noise.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

import mlx.core as mx

from ..methods.counter_hash import gumbel_noise_from_streams, noise_streams
from . import dispatch
from .scored_attention import _EXTRA_HEADER

ROWS = 64  # query rows per tile
KEYS = 64  # keys per tile
THREADS = 128  # 4 warps, 16 rows of a tile each


class PromptNoise(NamedTuple):
    """Keyformer's transform for the kernels: the softmax is of (logit + zeta) / tau, zeta the Gumbel
    noise of kvcompress/methods/counter_hash.py for (query head, query position, key position)."""

    streams: mx.array  # [R, G] uint32 noise streams of the query heads (counter_hash.noise_streams)
    redraw: bool  # a draw per query position (else the frozen noise: one per key)
    tau: mx.array  # [L] float32, each query's temperature
    first: int  # the first query's position (n - L: tau[i] is query first + i's)

    def apply(self, logits: mx.array, query_positions: mx.array, key_positions: mx.array) -> mx.array:
        """logits [R, G, l, k] of queries and keys at these positions -> (logits + zeta) / tau in MLX
        ops (as Keyformer.transform): the transform of methods/prompt_scores.py's tiles too."""
        zeta = gumbel_noise_from_streams(self.streams, query_positions if self.redraw else None, key_positions[None])
        return (logits + zeta) / self.tau[query_positions - self.first][:, None]


def accumulated_attention_reference(queries: mx.array, keys: mx.array, scale: float,
                                    noise: PromptNoise | None = None) -> mx.array:
    """The sum in plain MLX ops (quadratic memory: tests and the self-test), [R, n] float32.

    queries [R, G, L, D] at the last L of the n key positions, keys [R, n, D]."""
    R, G, L, D = queries.shape
    n = keys.shape[1]
    q = (queries * scale).astype(keys.dtype).reshape(R, G * L, D)
    logits = (q @ keys.swapaxes(1, 2)).astype(mx.float32).reshape(R, G, L, n)
    query_positions = mx.arange(n - L, n, dtype=mx.int32)
    if noise is not None:
        logits = noise.apply(logits, query_positions, mx.arange(n, dtype=mx.int32))
    visible = mx.arange(n)[None, :] <= query_positions[:, None]  # [L, n]
    logits = mx.where(visible, logits, -mx.inf)
    return mx.softmax(logits, axis=-1, precise=True).sum(axis=(1, 2))


# One header and two bodies. `q` [R, M_pad, D] pre-scaled, query-major rows, zero rows past M;
# `keys` [R, n, D]; dims: M (rows), n, first (the first query's position), G, M_pad, redraw (NOISY:
# a draw per query); NOISY: `streams` [R, G] uint32, `taus` [L].
# Shared memory is padded so that no access waits on a bank: key rows KEY_LD = D + 8 elements apart
# (the tensor cores' 8-row loads land on 8 different 16-byte slots), logit rows S_LD = 68 floats
# apart (a warp's 16-byte reads of 8 rows: 8 different slots). Unpadded, the first version ran 3x
# slower than the MLX tiles on the H200 (32-way conflicts on every logit read).
_HEADER = """
#include <mma.h>
#define NEG_INF (-__int_as_float(0x7f800000))
#define S_LD 68
using namespace nvcuda;
""" + _EXTRA_HEADER["cuda"] + """
// Keyformer's Gumbel draw for a prompt's every logit: gumbel()'s (the decode kernel's) with the
// hardware's base-2 logarithm (lg2.approx) for its two precise logarithms, which cost about half of
// the noisy passes' time (measured on the H200). -log(u) for u near 1 from its series in
// v = 1 - u (exact there: Sterbenz), where the logarithm's absolute error would be large against
// it; elsewhere lg2's ~1e-7 absolute error. The draw then differs from the exact one by < 1e-4
// (v just above 2^-9), ~1e-7 typically: far below the logits' own rounding in fp16 / bf16.
__device__ __forceinline__ float gumbel_fast(unsigned int step_hash, unsigned int position) {
    const unsigned int h = mix32(step_hash ^ position);
    const float u = fminf(((float)(h >> 8) + 0.5f) * (1.0f / 16777216.0f), 1.0f - 5.9604644775390625e-08f);
    const float v = 1.0f - u;
    const float w = v < 0.001953125f ? v * (1.0f + v * (0.5f + v * (1.0f / 3.0f)))  // -log(1 - v), error v^4 / 4
                                     : -0.69314718f * __log2f(u);
    return -0.69314718f * __log2f(w);
}
// a tile of logits into shared `s`: the warp's 16 rows of A (fragments in registers: query rows in
// the row pass, keys in the column pass) times the 64 rows of `tile` in shared memory ([64][D + 8],
// row-major: the col-major B of a . tile^T)
template <typename T, int D>
__device__ inline void warp_logits(wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>* a,
                                   const T* tile, float* s, int warp) {
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    _Pragma("unroll") for (int col = 0; col < 4; ++col) {
        wmma::fill_fragment(c, 0.0f);
        _Pragma("unroll") for (int k = 0; k < D / 16; ++k) {
            wmma::load_matrix_sync(b, tile + col * 16 * (D + 8) + k * 16, D + 8);
            wmma::mma_sync(c, a[k], b, c);
        }
        wmma::store_matrix_sync(s + warp * 16 * S_LD + col * 16, c, S_LD, wmma::mem_row_major);
    }
}
// rows row0 .. row0 + 63 of a [count, D] matrix into a shared tile [64][D + 8], zeros past count:
// 16-byte loads (a row of D * sizeof(T) bytes is a whole number of them: D is a multiple of 16)
template <typename T, int D>
__device__ inline void load_rows(const T* matrix, T* tile, int row0, int count, int tid) {
    constexpr int PER_ROW = D * (int)sizeof(T) / 16;
    const uint4 zero = {0u, 0u, 0u, 0u};
    for (int e = tid; e < 64 * PER_ROW; e += 128) {
        const int j = e / PER_ROW;
        reinterpret_cast<uint4*>(tile + j * (D + 8))[e % PER_ROW] =
            row0 + j < count ? reinterpret_cast<const uint4*>(matrix + (long)(row0 + j) * D)[e % PER_ROW] : zero;
    }
}
"""

_COMMON = """
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const long r = blockIdx.y;
    const int M = dims[0];
    const int n = dims[1];
    const int first = dims[2];
    const int G = dims[3];
    const int M_pad = dims[4];
    const unsigned int redraw = (unsigned int)dims[5];
    // 64 rows of keys (the row pass; the column pass: its keys once, then query rows); wmma wants
    // 32-byte aligned tiles; raw bytes: a __shared__ array of a class type (__half) may not be declared
    __shared__ __align__(32) unsigned char tile_bytes[64 * (D + 8) * sizeof(T)];
    T* tile = reinterpret_cast<T*>(tile_bytes);
    __shared__ __align__(32) float s[64 * S_LD];
"""

_ROW_LSE_BODY = _COMMON + """
    // the last rows first: they see the most keys, and the blocks start in this order (a short
    // block last fills the tail)
    const int m0 = (gridDim.x - 1 - blockIdx.x) * 64;
    // this warp's 16 query rows as tensor-core fragments, kept in registers for every key tile
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a[D / 16];
    _Pragma("unroll") for (int k = 0; k < D / 16; ++k) {
        wmma::load_matrix_sync(a[k], q + (r * M_pad + m0 + warp * 16) * D + k * 16, D);
    }
    // lane l of warp w: row w * 16 + l % 16 of the tile, keys (l / 16) * 32 .. + 31 of each key tile
    const int row = warp * 16 + tid % 16;
    const int half = (tid % 32) / 16;
    const int m = m0 + row;
    const int position = first + min(m, M - 1) / G;
    const int last = first + (min(m0 + 63, M - 1)) / G;  // the tile's last query sees keys 0..last
    // NOISY: this row's (head's, query's) noise stream and temperature
    const unsigned int row_hash = NOISY ? mix32(streams[r * G + min(m, M - 1) % G] ^ (redraw * (position + 1))) : 0u;
    const float inv_tau = NOISY ? 1.0f / taus[position - first] : 1.0f;
    const float4* my_logits = reinterpret_cast<const float4*>(s + row * S_LD + half * 32);
    float run_max = NEG_INF, run_sum = 0.0f;
    for (int k0 = 0; k0 <= last; k0 += 64) {
        load_rows<T, D>(keys + r * n * D, tile, k0, n, tid);
        __syncthreads();
        warp_logits<T, D>(a, tile, s, warp);
        __syncwarp();  // a warp reads only its own rows of s
        // the lane's 32 logits: rounded as the MLX product in T, noised, masked past the position;
        // their max first, then one rescale of the running sum per tile
        float x[32];
        float tile_max = NEG_INF;
        _Pragma("unroll") for (int c4 = 0; c4 < 8; ++c4) {
            const float4 v = my_logits[c4];
            const float four[4] = {v.x, v.y, v.z, v.w};
            _Pragma("unroll") for (int e = 0; e < 4; ++e) {
                const int key = k0 + half * 32 + c4 * 4 + e;
                float value = (float)(T)four[e];
                if (NOISY) value = (value + gumbel_fast(row_hash, (unsigned int)key)) * inv_tau;
                x[c4 * 4 + e] = key <= position ? value : NEG_INF;
                tile_max = fmaxf(tile_max, x[c4 * 4 + e]);
            }
        }
        if (tile_max > NEG_INF) {
            const float top = fmaxf(run_max, tile_max);
            run_sum *= __expf(run_max - top);  // 0 * 0 while run_max is still -inf
            _Pragma("unroll") for (int c = 0; c < 32; ++c) run_sum += __expf(x[c] - top);
            run_max = top;
        }
        __syncthreads();  // the next tile overwrites tile and s
    }
    // the row's two lanes (l, l + 16) combine
    const float other_max = __shfl_xor_sync(0xffffffffu, run_max, 16);
    const float other_sum = __shfl_xor_sync(0xffffffffu, run_sum, 16);
    const float top = fmaxf(run_max, other_max);
    const float total = (run_max == NEG_INF ? 0.0f : run_sum * __expf(run_max - top))
                      + (other_max == NEG_INF ? 0.0f : other_sum * __expf(other_max - top));
    if (half == 0 && m < M) lse[r * M + m] = top + __logf(total);
"""

_COLUMN_SUMS_BODY = _COMMON + """
    const int k0 = blockIdx.x * 64;
    // the block's 64 keys through shared memory into registers: this warp's 16 as the A of
    // k . q^T (so the query rows stream through shared memory as the row pass streams keys)
    load_rows<T, D>(keys + r * n * D, tile, k0, n, tid);
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a[D / 16];
    _Pragma("unroll") for (int k = 0; k < D / 16; ++k) {
        wmma::load_matrix_sync(a[k], tile + warp * 16 * (D + 8) + k * 16, D + 8);
    }
    // lane l of warp w: key w * 16 + l % 16 of the block, rows (l / 16) * 32 .. + 31 of each row tile
    const int key_in_block = warp * 16 + tid % 16;
    const int half = (tid % 32) / 16;
    const int key = k0 + key_in_block;
    const float4* my_logits = reinterpret_cast<const float4*>(s + key_in_block * S_LD + half * 32);
    float total = 0.0f;
    // the first row tile with a query that sees key k0 (query positions first + m / G)
    const int m_start = max(0, k0 - first) * G / 64 * 64;
    // the tile's rows: lse, the query's position (-1 past M: no key), noise stream and temperature
    __shared__ float row_lse[64];
    __shared__ int row_position[64];
    __shared__ float row_inv_tau[64];  // NOISY
    __shared__ unsigned int row_hash[64];
    for (int m0 = m_start; m0 < M; m0 += 64) {
        __syncthreads();  // the tile before (keys, then query rows) and its rows read by all
        load_rows<T, D>(q + r * M_pad * D, tile, m0, M_pad, tid);
        if (tid < 64) {
            const int m = m0 + tid;
            const int position = first + min(m, M - 1) / G;
            row_position[tid] = m < M ? position : -1;
            row_lse[tid] = lse[r * M + min(m, M - 1)];
            if (NOISY) {
                row_hash[tid] = mix32(streams[r * G + min(m, M - 1) % G] ^ (redraw * (position + 1)));
                row_inv_tau[tid] = 1.0f / taus[position - first];
            }
        }
        __syncthreads();
        warp_logits<T, D>(a, tile, s, warp);  // s[key][row] = k . q
        __syncwarp();  // a warp reads only its own keys' rows of s
        _Pragma("unroll") for (int c4 = 0; c4 < 8; ++c4) {
            const float4 v = my_logits[c4];
            const float four[4] = {v.x, v.y, v.z, v.w};
            _Pragma("unroll") for (int e = 0; e < 4; ++e) {
                const int i = half * 32 + c4 * 4 + e;
                float x = (float)(T)four[e];  // rounded as the MLX product in T
                if (NOISY) x = (x + gumbel_fast(row_hash[i], (unsigned int)key)) * row_inv_tau[i];
                if (key <= row_position[i]) total += __expf(x - row_lse[i]);
            }
        }
    }
    // the key's two lanes (l, l + 16) combine
    total += __shfl_xor_sync(0xffffffffu, total, 16);
    if (half == 0 && key < n) sums[r * n + key] = total;
"""

_kernels: dict[str, object] = {}


def _kernel(which: str):
    if which not in _kernels:
        body = _ROW_LSE_BODY if which == "row_lse" else _COLUMN_SUMS_BODY
        inputs = ["q", "keys", "dims", "streams", "taus"] + (["lse"] if which == "column_sums" else [])
        outputs = ["lse"] if which == "row_lse" else ["sums"]
        # MLX caches compiled kernels by name: a name per source text, so an edited source recompiles
        name = f"prompt_{which}_{zlib.crc32((_HEADER + body).encode()):08x}"
        _kernels[which] = mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs,
                                              source=body, header=_HEADER)
    return _kernels[which]


def shape_supported(head_dim: int, dtype) -> bool:
    return head_dim % 16 == 0 and 16 <= head_dim <= 128 and dtype in (mx.float16, mx.bfloat16)


def accumulated_attention_fused(queries: mx.array, keys: mx.array, scale: float,
                                noise: PromptNoise | None = None) -> mx.array:
    """The two kernels; the same contract as `accumulated_attention_reference`."""
    R, G, L, D = queries.shape
    n = keys.shape[1]
    M = G * L
    M_pad = -(-M // ROWS) * ROWS
    # query-major rows (m = i * G + g), pre-scaled in the keys' dtype, zero rows up to a whole tile
    q = (queries * scale).astype(keys.dtype).transpose(0, 2, 1, 3).reshape(R, M, D)
    if M_pad > M:
        q = mx.concatenate([q, mx.zeros((R, M_pad - M, D), q.dtype)], axis=1)
    if noise is not None and noise.first != n - L:
        raise ValueError(f"prompt_scores: noise.first is {noise.first}, the queries start at {n - L} (n - L)")
    redraw = noise is not None and noise.redraw
    dims = dispatch.constant((M, n, n - L, G, M_pad, int(redraw)), mx.int32)
    streams = noise.streams if noise is not None else dispatch.constant((0,), mx.uint32)  # placeholders: not read
    taus = noise.tau.astype(mx.float32) if noise is not None else dispatch.constant((1.0,), mx.float32)
    template = [("T", keys.dtype), ("D", D), ("NOISY", noise is not None)]
    (lse,) = _kernel("row_lse")(inputs=[q, keys, dims, streams, taus], template=template,
                                grid=(M_pad // ROWS * THREADS, R, 1), threadgroup=(THREADS, 1, 1),
                                output_shapes=[(R, M)], output_dtypes=[mx.float32])
    (sums,) = _kernel("column_sums")(inputs=[q, keys, dims, streams, taus, lse], template=template,
                                     grid=(-(-n // KEYS) * THREADS, R, 1), threadgroup=(THREADS, 1, 1),
                                     output_shapes=[(R, n)], output_dtypes=[mx.float32])
    return sums


_SELFTEST_TOLERANCE = {mx.float16: 2e-3, mx.bfloat16: 1e-2, mx.float32: 1e-5}  # float32: the CPU emulator


def random_case(R: int, G: int, L: int, n: int, D: int, dtype, seed: int = 0):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((R, G, L, D), key=k1).astype(dtype), (2 * mx.random.normal((R, n, D), key=k2)).astype(dtype)


def random_noise(R: int, G: int, L: int, n: int, redraw: bool = True, seed: int = 0) -> PromptNoise:
    """Keyformer-like noise for L queries at the last of n positions: layer `seed`'s streams,
    temperatures between 0.5 and 2."""
    tau = mx.random.uniform(0.5, 2.0, (L,), key=mx.random.key(seed))
    return PromptNoise(noise_streams(seed, 3, mx.arange(R * G, dtype=mx.uint32).reshape(R, G)), redraw, tau, n - L)


def _selftest(backend: str, dtype, variant: tuple) -> None:
    D, noisy = variant
    if backend != "cuda":
        raise NotImplementedError("prompt_scores kernels: CUDA only")
    queries, keys = random_case(2, 3, 150, 200, D, dtype, seed=1)
    noise = random_noise(2, 3, 150, 200, seed=2) if noisy else None
    got = accumulated_attention_fused(queries, keys, D**-0.5, noise)
    with mx.stream(mx.cpu):  # the same roundings (queries and logits in the dtype), float32 sums
        want = accumulated_attention_reference(queries, keys, D**-0.5, noise)
        mx.eval(want)
    dispatch.assert_close(got, want, _SELFTEST_TOLERANCE[dtype], "prompt_scores self-test")


def fuses(queries: mx.array, keys: mx.array, noisy: bool = False) -> bool:
    """Whether the kernels run for these inputs (and Keyformer's noise) here (self-test on first use)."""
    D = queries.shape[-1]
    if not (shape_supported(D, keys.dtype) and queries.dtype == keys.dtype and keys.shape[-1] == D):
        return False
    variant = (D, noisy)
    return dispatch.select("prompt_scores", keys.dtype, variant, lambda b: _selftest(b, keys.dtype, variant)) is not None
