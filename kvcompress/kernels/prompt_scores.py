"""H2O's and Keyformer's prompt scores on tensor cores: every key's causal attention summed over a
prompt's queries.

s_j = sum over the query rows m (the G heads of a KV row times the L prompt queries) of
softmax(x_m)_j, x_mj = q_m . k_j (queries pre-scaled) for the keys j the query at position p(m) sees
(j <= p(m)); for Keyformer x_mj = (q_m . k_j + zeta_mj) / tau_m, its Gumbel noise drawn in the
kernels from the counter hash of kvcompress/kernels/counter_hash.py (`PromptNoise`).
kvcompress/methods/eviction/scoring/prompt_scores.py computes it in MLX tiles: a matmul writes each tile of logits,
then a compiled chain, a softmax and a column sum each read and write it again; at 32k (8 KV heads
x 4, D 128, fp16) that made H2O's prefill ~3x the full cache's on the H200 and Keyformer's ~4.4x
(docs/learned.md): the tiles' memory traffic, not their arithmetic, bounds it.
Here two kernels keep every logit on the chip (FlashAttention's two-pass form, Dao et al. 2022, in
FlashAttention-2's layout, Dao 2023). Their plain reference is `accumulated_attention_reference`
(MLX ops over the whole [rows x n] logits at once), which the self-test and the tests compare with:

1. `row_lse`: one block per 64 query rows, each warp's 16 as tensor-core A fragments in registers;
   over tiles of 64 keys streamed through shared memory (cp.async, two buffers: the next tile loads
   while this one computes), the logits q . k from m16n8k16 products (mma.sync, float
   accumulation) stay in the lanes' registers, which keep each row's running max and sum: the row's
   log-sum-exp lse_m.
2. `column_sums`: one block per 64 keys as the A fragments; over tiles of 64 query rows that see any
   of them, streamed the same way, the products k . q, then exp(x_mj - lse_m) summed along each
   key's row of the tile.

Each pass is one product per (query row, key) pair on tensor cores and no tile leaves the chip; a
prefill attention computes the same products once more for its output. The rows are query-major
(row m = query i, head g: m = i * G + g), so a 64-row tile holds 64 / G consecutive queries and the
causal limit of a tile is tight; only tiles across the diagonal pay for the mask. The logits are
rounded to the model's dtype before the softmax, as the MLX path's product in that dtype rounds them.

CUDA only (fp16 / bf16: what tensor cores take), head dims 16..128 in steps of 16; Metal and the
rest run the MLX path. Also run on the CPU by tests/cuda_on_cpu.py (whose product and matrix loads
follow PTX's fragment layouts lane by lane, float32 instantiations); scripts/cuda_compile_check.py
compiles them for sm_90. Its dispatch self-test guards it (a compile error or a wrong number there:
the MLX path runs). Measured on the H200 (docs/learned.md, 2026-12-01): one layer at
32k, 8 KV heads x 4, D 128, fp16, the two passes 17.6 + 17.8 ms for H2O (the earlier wmma kernels,
whose logits went through shared memory: 25.9 + 37.6; the MLX tiles: 131; SDPA's causal attention
over the same prompt: 14) and 36.6 + 37.4 ms with Keyformer's noise (47.8 + 52.5). The passes issue
an instruction in ~55% of cycles at 4 blocks (16 warps) an SM, bound by registers (127-150 a thread).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from .counter_hash import gumbel_noise_from_streams, noise_streams
from . import dispatch
from .scored_attention import _EXTRA_HEADER

ROWS = 64  # query rows per tile
KEYS = 64  # keys per tile
THREADS = 128  # 4 warps, 16 rows of a tile each


class PromptNoise(NamedTuple):
    """Keyformer's transform for the kernels: the softmax is of (logit + zeta) / tau, zeta the Gumbel
    noise of kvcompress/kernels/counter_hash.py for (query head, query position, key position)."""

    streams: mx.array  # [R, G] uint32 noise streams of the query heads (counter_hash.noise_streams)
    redraw: bool  # a draw per query position (else the frozen noise: one per key)
    tau: mx.array  # [L] float32, each query's temperature
    first: int  # the first query's position (n - L: tau[i] is query first + i's)

    def apply(self, logits: mx.array, query_positions: mx.array, key_positions: mx.array) -> mx.array:
        """logits [R, G, l, k] of queries and keys at these positions -> (logits + zeta) / tau in MLX
        ops (as Keyformer.transform): the transform of methods/eviction/scoring/prompt_scores.py's tiles too."""
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
# A warp's products are m16n8k16 tensor-core instructions (mma.sync) whose C fragments stay in the
# lanes' registers: the softmax reads its logits where the product left them (FlashAttention-2's
# layout, Dao 2023), never through shared memory (the first version stored every tile of logits to
# shared memory with wmma and read it back: 25 + 36 ms a layer at 32k for H2O's two passes). The
# streamed tiles come in by cp.async into two buffers: the next tile loads while this one computes.
# Key (or query) rows sit D + 8 elements apart in shared memory, so the 32 lanes' B-fragment reads
# (8 rows x 4 words) fall on 32 different banks for every D here.
_HEADER = """
#define NEG_INF (-__int_as_float(0x7f800000))
""" + _EXTRA_HEADER["cuda"] + """
// Keyformer's Gumbel draw for a prompt's every logit: gumbel()'s (the decode kernel's) with the
// hardware's base-2 logarithm (lg2.approx) for its two precise logarithms, which cost about half of
// the noisy passes' time (measured on the H200). -log(u) for u near 1 from its series in
// v = 1 - u (exact there: Sterbenz), where the logarithm's absolute error would be large against
// it; elsewhere lg2's ~1e-7 absolute error. The draw then differs from the exact one by < 1e-4
// (v just above 2^-9), ~1e-7 typically: far below the logits' own rounding in fp16 / bf16.
__device__ __forceinline__ float gumbel_fast(unsigned int step_hash, unsigned int position) {
    const unsigned int h = mix32(step_hash ^ position);
    // u = ((h >> 8) + 0.5) / 2^24 rounded once, as gumbel() has it, without converting an integer to a
    // float (as slow as a logarithm): the top 23 bits as 1.m - 1 (exact), then the 24th and the half
    const float u = fminf((__uint_as_float(0x3f800000u | (h >> 9)) - 1.0f)
                              + ((h & 0x100u) ? 8.940696716308594e-08f : 2.9802322387695312e-08f),
                          1.0f - 5.9604644775390625e-08f);
    const float v = 1.0f - u;
    float w = -0.69314718f * __log2f(u);
    if (v < 0.001953125f) w = v * (1.0f + v * (0.5f + v * (1.0f / 3.0f)));  // -log(1 - v), error v^4 / 4; rare: a branch
    return -0.69314718f * __log2f(w);
}
// two elements of T in one 32-bit register, as the tensor cores take fp16 / bf16 (the CPU emulator
// runs float32 instantiations: two floats)
struct FloatPair { float x, y; };
template <int BYTES> struct PairOf { typedef unsigned int type; };
template <> struct PairOf<4> { typedef FloatPair type; };
#define LOG2E 1.4426950408889634f
// a logit pair rounded to T and back, as the MLX product in T rounds its logits
template <typename T> __device__ __forceinline__ void round_pair(float& x, float& y) { x = (float)(T)x; y = (float)(T)y; }
// The GPU's own instructions (PTX); the CPU emulator (tests/cuda_on_cpu.py) has its own of each
#ifdef __CUDACC__
// one conversion instruction for the pair each way
template <> __device__ __forceinline__ void round_pair<__half>(float& x, float& y) {
    const float2 r = __half22float2(__floats2half2_rn(x, y));
    x = r.x;
    y = r.y;
}
template <> __device__ __forceinline__ void round_pair<__nv_bfloat16>(float& x, float& y) {
    const float2 r = __bfloat1622float2(__floats2bfloat162_rn(x, y));
    x = r.x;
    y = r.y;
}
// 2^x, the hardware's approximation (what __expf uses after its multiply by log2(e))
__device__ __forceinline__ float exp2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// c += a b, one m16n8k16 product of the warp (PTX ISA, "mma.m16n8k16"); lane l holds
//   a[0..3]: A (16 x 16, row-major) row l / 4 (a0, a2) and l / 4 + 8 (a1, a3), columns 2 (l % 4) + {0, 1} (a0, a1) and + 8 (a2, a3)
//   b[0..1]: B (16 x 8, column-major) rows 2 (l % 4) + {0, 1} (b0) and + 8 (b1), column l / 4
//   c[0..3]: C (16 x 8) row l / 4 (c0, c1) and l / 4 + 8 (c2, c3), columns 2 (l % 4) + {0, 1}
template <typename T> struct Mma;
template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float* c, const unsigned int* a, const unsigned int* b) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float* c, const unsigned int* a, const unsigned int* b) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
// 16 bytes from global to shared memory without passing through registers (cp.async), zeros where
// !valid; a commit closes a group of them, a wait leaves at most PENDING groups in flight
__device__ __forceinline__ void copy16_async(void* shared, const void* global, bool valid) {
    const unsigned int address = (unsigned int)__cvta_generic_to_shared(shared);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(address), "l"(global), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING> __device__ __forceinline__ void copies_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory");
}
// four 8 x 8 matrices of 16-bit elements from shared memory in one instruction (ldmatrix.x4): lanes
// 8i .. 8i + 7 give the row addresses of matrix i; lane l gets row l / 4's elements 2 (l % 4) + {0, 1}
// of matrix i in r[i], the layout of a B fragment's register
template <typename P, typename T> __device__ __forceinline__ void load_matrices_x4(P* r, const T* row) {
    const unsigned int address = (unsigned int)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address) : "memory");
}
#endif
// rows row0 .. row0 + 63 of a [count, D] matrix into a shared tile [64][D + 8], zeros past count:
// 16-byte asynchronous copies (a row of D * sizeof(T) bytes is a whole number of them), one group
template <typename T, int D>
__device__ inline void load_rows_async(const T* matrix, T* tile, int row0, int count, int tid) {
    constexpr int PER_ROW = D * (int)sizeof(T) / 16;
    _Pragma("unroll") for (int i = 0; i < 64 * PER_ROW / 128; ++i) {
        const int e = tid + 128 * i;
        const int j = e / PER_ROW;
        const bool valid = row0 + j < count;
        copy16_async(reinterpret_cast<uint4*>(tile + j * (D + 8)) + e % PER_ROW,
                     reinterpret_cast<const uint4*>(matrix + (long)(valid ? row0 + j : 0) * D) + e % PER_ROW, valid);
    }
    copies_commit();
}
// the lane's A fragments of 16 rows (the lane's two: `lo`, and `hi` 8 rows further) for D / 16
// products along the head dim
template <typename T, int D>
__device__ inline void load_a(typename PairOf<sizeof(T)>::type (*a)[4], const T* lo, const T* hi, int lane) {
    typedef typename PairOf<sizeof(T)>::type P;
    lo += 2 * (lane % 4);
    hi += 2 * (lane % 4);
    _Pragma("unroll") for (int k = 0; k < D / 16; ++k) {
        a[k][0] = *reinterpret_cast<const P*>(lo + k * 16);
        a[k][1] = *reinterpret_cast<const P*>(hi + k * 16);
        a[k][2] = *reinterpret_cast<const P*>(lo + k * 16 + 8);
        a[k][3] = *reinterpret_cast<const P*>(hi + k * 16 + 8);
    }
}
// the warp's 16 x 64 logits: its 16 rows (A fragments) times the 64 rows of a shared tile ([64][D + 8],
// row-major: the column-major B of a . tile^T); s[j] holds the lane's C elements of columns 8j .. 8j + 7.
// One ldmatrix.x4 brings the B fragments of two column blocks (j, j + 1) for a 16-deep product: lane l
// addresses row l % 8 of matrix l / 8 (keys 8j + l % 8 for matrices 0, 1 and 8 (j + 1) + l % 8 for
// 2, 3; head-dim elements 16k + {0, 8})
template <typename T, int D>
__device__ inline void warp_logits(typename PairOf<sizeof(T)>::type (*a)[4], const T* tile, float (*s)[4], int lane) {
    typedef typename PairOf<sizeof(T)>::type P;
    _Pragma("unroll") for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    const T* rows = tile + (lane % 8 + 8 * (lane / 16)) * (D + 8) + 8 * ((lane / 8) % 2);
    _Pragma("unroll") for (int k = 0; k < D / 16; ++k) {
        _Pragma("unroll") for (int j = 0; j < 8; j += 2) {
            P b[4];
            load_matrices_x4(b, rows + j * 8 * (D + 8) + k * 16);
            Mma<T>::run(s[j], a[k], b);
            Mma<T>::run(s[j + 1], a[k], b + 2);
        }
    }
}
// one key tile of a row pass, for the lane's two rows (h = 0, 1): the logits s (C fragments: keys
// key0 + 8j + {0, 1}) rounded as the MLX product in T rounds them, noised, masked past each row's
// query position (MASKED: a tile across the diagonal) and folded into the rows' running max and sum
template <typename T, bool NOISY, bool MASKED>
__device__ __forceinline__ void row_tile(float (*s)[4], int key0, const int* position, const unsigned int* row_hash,
                                         const float* inv_tau, float* run_max, float* run_sum) {
    float tile_max[2] = {NEG_INF, NEG_INF};
    _Pragma("unroll") for (int j = 0; j < 8; ++j) {
        round_pair<T>(s[j][0], s[j][1]);
        round_pair<T>(s[j][2], s[j][3]);
        _Pragma("unroll") for (int e = 0; e < 4; ++e) {
            const int h = e / 2;
            const int key = key0 + 8 * j + e % 2;
            if (NOISY) s[j][e] = (s[j][e] + gumbel_fast(row_hash[h], (unsigned int)key)) * inv_tau[h];
            if (MASKED && key > position[h]) s[j][e] = NEG_INF;
            tile_max[h] = fmaxf(tile_max[h], s[j][e]);
        }
    }
    // one rescale of each row's running sum per tile; exp(x - top) as 2^(x log2(e) - top log2(e)):
    // one fused multiply-add before the hardware's exp2
    _Pragma("unroll") for (int h = 0; h < 2; ++h) {
        if (tile_max[h] > NEG_INF) {
            const float top = fmaxf(run_max[h], tile_max[h]);
            const float shift = top * LOG2E;
            run_sum[h] *= exp2_fast(fmaf(run_max[h], LOG2E, -shift));  // 0 * 0 while run_max is still -inf
            _Pragma("unroll") for (int j = 0; j < 8; ++j) {
                run_sum[h] += exp2_fast(fmaf(s[j][2 * h], LOG2E, -shift)) + exp2_fast(fmaf(s[j][2 * h + 1], LOG2E, -shift));
            }
            run_max[h] = top;
        }
    }
}
// one row tile of a column pass, for the lane's two keys key[h]: the logits s (C fragments: tile rows
// col0 + 8j + {0, 1}) rounded, noised, their probabilities exp(x - lse) added to the keys' totals
// where the row's query sees the key (MASKED: a tile across the diagonal or past the last row).
// Per tile row i: lse2 = lse log2(e), scale = log2(e) / tau (NOISY), position (-1: no query)
template <typename T, bool NOISY, bool MASKED>
__device__ __forceinline__ void column_tile(float (*s)[4], int col0, const int* key, const float* lse2,
                                            const int* position, const unsigned int* row_hash, const float* scale,
                                            float* total) {
    _Pragma("unroll") for (int j = 0; j < 8; ++j) {
        round_pair<T>(s[j][0], s[j][1]);
        round_pair<T>(s[j][2], s[j][3]);
        _Pragma("unroll") for (int c = 0; c < 2; ++c) {
            const int i = 8 * j + col0 + c;
            _Pragma("unroll") for (int h = 0; h < 2; ++h) {
                const float x = s[j][2 * h + c];
                const float y = NOISY ? (x + gumbel_fast(row_hash[i], (unsigned int)key[h])) * scale[i] - lse2[i]
                                      : fmaf(x, LOG2E, -lse2[i]);
                if (!MASKED || key[h] <= position[i]) total[h] += exp2_fast(y);
            }
        }
    }
}
// (max, sum of exp(x - max)) of a row's logits, `other`'s folded into `mine`
__device__ __forceinline__ void merge_softmax(float& max_mine, float& sum_mine, float max_other, float sum_other) {
    const float top = fmaxf(max_mine, max_other);
    sum_mine = (max_mine == NEG_INF ? 0.0f : sum_mine * __expf(max_mine - top))
             + (max_other == NEG_INF ? 0.0f : sum_other * __expf(max_other - top));
    max_mine = top;
}
"""

_COMMON = """
    typedef typename PairOf<sizeof(T)>::type P;
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const long r = blockIdx.y;
    const int M = dims[0];
    const int n = dims[1];
    const int first = dims[2];
    const int G = dims[3];
    const int M_pad = dims[4];
    const unsigned int redraw = (unsigned int)dims[5];
    // two tiles of 64 streamed rows (keys in the row pass, query rows in the column pass); raw
    // bytes: a __shared__ array of a class type (__half) may not be declared
    __shared__ __align__(16) unsigned char tile_bytes[2][64 * (D + 8) * sizeof(T)];
    auto tile = [&](int b) { return reinterpret_cast<T*>(tile_bytes[b]); };
    // the lane's place in a warp's C fragments: rows (lane / 4) and (lane / 4 + 8), columns
    // 8j + col0 + {0, 1}
    const int col0 = 2 * (lane % 4);
    P a[D / 16][4];
    float s[8][4];
"""

_ROW_LSE_BODY = _COMMON + """
    // the last rows first: they see the most keys, and the blocks start in this order (a short
    // block last fills the tail)
    const int m0 = (gridDim.x - 1 - blockIdx.x) * 64;
    const T* warp_rows = q + (r * M_pad + m0 + warp * 16 + lane / 4) * D;
    load_a<T, D>(a, warp_rows, warp_rows + 8 * D, lane);  // kept in registers for every key tile
    // the lane's two rows (h = 0, 1): query position, noise stream and temperature
    int position[2];
    unsigned int row_hash[2];
    float inv_tau[2], run_max[2], run_sum[2];
    _Pragma("unroll") for (int h = 0; h < 2; ++h) {
        const int m = min(m0 + warp * 16 + lane / 4 + 8 * h, M - 1);
        position[h] = first + m / G;
        row_hash[h] = NOISY ? mix32(streams[r * G + m % G] ^ (redraw * (position[h] + 1))) : 0u;
        inv_tau[h] = NOISY ? 1.0f / taus[position[h] - first] : 1.0f;
        run_max[h] = NEG_INF;
        run_sum[h] = 0.0f;
    }
    const int first_position = first + m0 / G;  // the block's first query
    const int last = first + (min(m0 + 63, M - 1)) / G;  // its last query sees keys 0..last
    const int key_tiles = last / 64 + 1;
    const T* key_rows = keys + r * n * D;
    load_rows_async<T, D>(key_rows, tile(0), 0, n, tid);
    for (int t = 0; t < key_tiles; ++t) {
        if (t + 1 < key_tiles) {
            load_rows_async<T, D>(key_rows, tile((t + 1) % 2), (t + 1) * 64, n, tid);
            copies_wait<1>();
        } else {
            copies_wait<0>();
        }
        __syncthreads();  // tile t is in, for every thread
        warp_logits<T, D>(a, tile(t % 2), s, lane);
        if (t * 64 + 63 <= first_position) {  // every row of the block sees every key of the tile
            row_tile<T, NOISY, false>(s, t * 64 + col0, position, row_hash, inv_tau, run_max, run_sum);
        } else {
            row_tile<T, NOISY, true>(s, t * 64 + col0, position, row_hash, inv_tau, run_max, run_sum);
        }
        __syncthreads();  // every warp is done with tile t before tile t + 2 loads over it
    }
    // a row's four lanes (lane / 4 the same) combine
    _Pragma("unroll") for (int h = 0; h < 2; ++h) {
        _Pragma("unroll") for (int other = 1; other <= 2; other *= 2) {
            merge_softmax(run_max[h], run_sum[h], __shfl_xor_sync(0xffffffffu, run_max[h], other),
                          __shfl_xor_sync(0xffffffffu, run_sum[h], other));
        }
        const int m = m0 + warp * 16 + lane / 4 + 8 * h;
        if (lane % 4 == 0 && m < M) lse[r * M + m] = run_max[h] + __logf(run_sum[h]);
    }
"""

_COLUMN_SUMS_BODY = _COMMON + """
    const int k0 = blockIdx.x * 64;
    // this warp's 16 keys as A fragments of k . q^T, kept in registers (rows past n read key n - 1:
    // their sums are not written); the query rows stream through shared memory
    const T* key_rows = keys + r * n * D;
    const int key_lo = k0 + warp * 16 + lane / 4;
    load_a<T, D>(a, key_rows + (long)min(key_lo, n - 1) * D, key_rows + (long)min(key_lo + 8, n - 1) * D, lane);
    // row tile t (rows m_start + 64 t) goes to buffer t % 2 with its rows' lse (times log2(e)), query
    // positions (-1 past M: no key), noise hashes and log2(e) / tau
    __shared__ float row_lse2[2][64];
    __shared__ int row_position[2][64];
    __shared__ unsigned int row_hash[2][64];
    __shared__ float row_scale[2][64];  // NOISY
    const int m_start = max(0, k0 - first) * G / 64 * 64;  // the first row tile with a query that sees key k0
    const int row_tiles = (M - m_start + 63) / 64;
    const T* q_rows = q + r * M_pad * D;
    auto stage = [&](int t) {
        const int b = t % 2;
        load_rows_async<T, D>(q_rows, tile(b), m_start + t * 64, M_pad, tid);
        if (tid < 64) {
            const int m = m_start + t * 64 + tid;
            const int position = first + min(m, M - 1) / G;
            row_position[b][tid] = m < M ? position : -1;
            row_lse2[b][tid] = lse[r * M + min(m, M - 1)] * LOG2E;
            if (NOISY) {
                row_hash[b][tid] = mix32(streams[r * G + min(m, M - 1) % G] ^ (redraw * (position + 1)));
                row_scale[b][tid] = LOG2E / taus[position - first];
            }
        }
    };
    const int key[2] = {key_lo, key_lo + 8};
    float total[2] = {0.0f, 0.0f};
    stage(0);
    for (int t = 0; t < row_tiles; ++t) {
        if (t + 1 < row_tiles) {
            stage(t + 1);
            copies_wait<1>();
        } else {
            copies_wait<0>();
        }
        __syncthreads();  // tile t and its rows are in, for every thread
        const int b = t % 2;
        warp_logits<T, D>(a, tile(b), s, lane);  // s: the warp's keys x the tile's rows
        const int m0 = m_start + t * 64;
        if (m0 + 63 < M && first + m0 / G >= k0 + 63) {  // every row of the tile sees every key of the block
            column_tile<T, NOISY, false>(s, col0, key, row_lse2[b], row_position[b], row_hash[b], row_scale[b], total);
        } else {
            column_tile<T, NOISY, true>(s, col0, key, row_lse2[b], row_position[b], row_hash[b], row_scale[b], total);
        }
        __syncthreads();  // every warp is done with tile t before tile t + 2 loads over it
    }
    // a key's four lanes (lane / 4 the same) combine
    _Pragma("unroll") for (int h = 0; h < 2; ++h) {
        total[h] += __shfl_xor_sync(0xffffffffu, total[h], 1);
        total[h] += __shfl_xor_sync(0xffffffffu, total[h], 2);
        if (lane % 4 == 0 && key[h] < n) sums[r * n + key[h]] = total[h];
    }
"""


_kernels = dispatch.kernel_cache()


def _kernel(which: str):
    if which not in _kernels:
        body = _ROW_LSE_BODY if which == "row_lse" else _COLUMN_SUMS_BODY
        inputs = ["q", "keys", "dims", "streams", "taus"] + (["lse"] if which == "column_sums" else [])
        outputs = ["lse"] if which == "row_lse" else ["sums"]
        _kernels[which] = dispatch.fast_kernel("cuda", f"prompt_{which}", body, _HEADER, inputs, outputs)
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


def selftest(backend: str, dtype, variant: tuple) -> None:
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
    return dispatch.select("prompt_scores", keys.dtype, variant, lambda b: selftest(b, keys.dtype, variant)) is not None
