"""KIVI decode attention on the tensor cores (CUDA, fp16 codes of 2 or 4 bits): the packed bulk of the tokens.

Why: the scalar kernel of kivi_attention.py turns every code into a float and spends M FMAs on it
(M = the query rows of a KV head); measured with Nsight Compute on the H200 (32k tokens, KIVI-2, 8
KV heads x 4 rows, D 128) it issued ~25 M warp instructions in 82 us at 0.37 instructions a cycle
per scheduler, with 8 warps an SM. Here the products run as `mma.sync` m16n8k16 (fp16 in, fp32
accumulation) and a code costs ~2.5 integer/half2 instructions on its way into a fragment.

Status: the default for 2-bit keys and values on CUDA from 24k tokens of codes on
(kivi_attention.tensor_cores_by_default), opt-in for 4-bit codes (`decode_attention_fused(...,
tensor_cores=True)`). On the H200, layers waiting on each other as in a model, KIVI-2 at 32k tokens:
116 us a layer against the scalar kernel's 131 and SDPA's 78 on the full cache; at 16k 90 against 81
(docs/learned.md, "KIVI's kernels"). Nsight Compute, 32k, 4 steps a warp: 45 us of GPU
time for the launch (with the residual tail's blocks: 264 blocks, 2 an SM, 175 registers), 1.73 warps a
scheduler active, one instruction issued every 3.4 cycles a scheduler, DRAM at 12%. Twice the warps
(`__launch_bounds__` for 4 blocks an SM, with 1 or 2 steps a warp for the blocks to fill them) issued
no faster (0.22-0.31 instructions a cycle a scheduler) and took as long or longer: the bound is not
latency hiding by more warps. `l2_prefetch` (an L2 hint on the key copies) measured no gain.

The problem is the one of kivi_attention.py (rows rep-major, post-RoPE queries); this kernel takes
the tokens [0, n_full) with n_full a multiple of 64 that every row sees (below the key and value
residuals and the causal band), and the scalar kernel the rest, in the same softmax: both leave
partial outputs with their running max and sum, and one combine merges them (kivi_attention.py).
Its reference is that module's `decode_attention_reference` (tests/test_kernel_sources.py, on the CPU
emulator; on a GPU, tests/test_kivi_attention.py checks it against mx.dequantize then attention).

Each warp is on its own (no block barrier until the end): it walks steps of ST tokens (64 for 2-bit
codes, 32 where either side has 4-bit codes: 16 bytes of key codes a channel), keeping an online
softmax per query row. A step's key codes, key scales and zeros, value codes, value scales and zeros
come into the warp's own area of shared memory by asynchronous copies (cp.async), each byte copied
once by one lane, one phase ahead: the next step's keys while this step's values are used, the next
step's values while its scores are computed. (Before, each lane loaded its own fragments' words
from global memory, the 8 lanes of a fragment row the same ones, and each chunk waited for its loads:
84 us a layer at 32k.) With lane l, r = l / 4 and k = l % 4:
- scores S^T [16 tokens x 8 rows] = K [16 x D] . Q^T [D x 8]: the key codes are the A operand.
  A key word holds 32 / KB tokens of one channel; `(w >> shift) & mask` puts the codes of two
  tokens (one per 16-bit half, r and r + 8 of the sub-block; for KB = 4, r's word and offset
  differ, the "rho" token order below) into place, OR 0x6400 makes each half the fp16 number
  1024 + code, a byte permute pairs channels 2k, 2k + 1 (and 2k + 8, 2k + 9) as the fragment
  wants, and `(x - 1024) * s + z` in half2 dequantizes as mx.dequantize does (fp16 keys).
  The query rows are B (8 columns: M <= 8 rows, the rest zero), unscaled fp16; the softmax scale
  is applied to the fp32 scores.
- probabilities: exp2 of the scores less the running max, rounded to fp16 (as the reference's
  fp16 softmax output is) and moved into the B layout of the value product by `movmatrix` (an
  8 x 8 transpose across the warp).
- outputs O^T [16 channels x 8 rows] = V^T [16 x tokens] . P^T: the value codes are A, from one
  word per token (16 / VB channels a half), the same token order as the scores' (rho). Values
  are quantized per token, so the scale is folded into P (P s, per value group) and the zeros'
  terms sum_t p_t z_{t,g} of all groups are one more product per sub-block (A's row g = group g's
  zeros, C's row g its term), kept apart and added to the group's channels when the warps meet:
  out = sum_t p_t s_t c_t + sum_t p_t z_t, exact products of fp16 numbers in fp32 sums. (Before, the
  zero's term was one product per chunk with z broadcast over its 16 channels: 8 of a sub-block's 16
  value products at D 128, G 32.)
At the end the block's warps meet once in shared memory and leave one partial per block.

Supported (`supported`, `aligned`): fp16, key and value bits 2 or 4, D 64 or 128, group size a
multiple of 32 dividing D, 1..8 rows where the one launch's static shared memory fits in 48 KiB (the
scalar kernel's tile scores grow with the rows: at D 128, 2-bit codes fit up to 4 rows, 4-bit up to 5). CUDA only: the fragments are PTX's; Metal runs the scalar
kernel. The CPU emulator (tests/cuda_on_cpu.py) has its own mma, movmatrix and half2 arithmetic,
so the fragment bookkeeping is tested without a GPU.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from . import dispatch

BITS = (2, 4)
STEP = 64  # the tokens this kernel takes are a multiple of this (both step sizes below divide it)
WARPS = 4
THREADS = 32 * WARPS
SHARED_LIMIT = 48 * 1024  # static shared memory a CUDA block may declare
# Steps a warp takes by default, measured on the H200 with each layer waiting for the one before (as in
# a model; docs/learned.md): KIVI-2, 32k tokens x 8 KV heads, 2 / 4 / 8 / 16 steps a warp
# 112.2 / 116.3 / 138.6 / 149.9 us a layer; 8k 95.6 / 85.1 / 93.6 / 126.5. (Stop 20 picked 16 from layers
# timed side by side, which overlap on the GPU: a launch that leaves SMs idle looked cheap there.)
STEPS_PER_WARP = 4


def step_tokens(key_bits: int, value_bits: int) -> int:
    """Tokens a warp takes at a time: 16 bytes of key codes per channel (64 tokens at 2 bits, 32 at 4),
    fewer where the values are wider, so a step's staging stays within a quarter of the block's
    shared memory."""
    return 128 // max(key_bits, value_bits)


def shared_bytes(D: int, M: int, key_bits: int, value_bits: int, group_size: int, scalar_bytes: int) -> int:
    """Static shared memory of the one launch: the scalar kernel's blocks (`scalar_bytes`, from
    kivi_attention.scalar_shared_bytes: that module owns its kernel's arrays and imports this one, not
    the other way) and this kernel's (the staging areas of its warps, which the warps' partials reuse
    at the end). Both kinds of blocks declare both."""
    ST = step_tokens(key_bits, value_bits)
    n_groups = D // group_size
    stage = D * ST * key_bits // 32 + 2 * D + ST * (D * value_bits // 32 + 4) + ST * n_groups
    meet = WARPS * 8 * D + 2 * WARPS * 8 + WARPS * 8 * n_groups
    return scalar_bytes + 4 * max(WARPS * stage, meet)

HEADER = """
// The GPU's own instructions (PTX); the CPU emulator (tests/cuda_on_cpu.py) has its own of each
#ifdef __CUDACC__
// c += a b, m16n8k16, fp16 in, fp32 accumulation; lane l = 4 r + k holds
//   a[0..3]: A (16 x 16) row r (a0, a2) / r + 8 (a1, a3), columns 2k + {0, 1} (a0, a1) / + 8 (a2, a3)
//   b[0..1]: B (16 x 8) rows 2k + {0, 1} (b0) / + 8 (b1), column r
//   c[0..3]: C (16 x 8) row r (c0, c1) / r + 8 (c2, c3), columns 2k + {0, 1}
__device__ __forceinline__ void mma_f16(float* c, const unsigned int* a, const unsigned int* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// an 8 x 8 matrix of 16-bit elements (lane 4 r + k holds row r, columns 2k, 2k + 1) transposed
__device__ __forceinline__ unsigned int movmatrix_trans(unsigned int x) {
    unsigned int y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}
// half2 arithmetic on 32-bit registers (low half = first element), correctly rounded
__device__ __forceinline__ unsigned int h2_sub(unsigned int a, unsigned int b) {
    unsigned int d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ unsigned int h2_mul(unsigned int a, unsigned int b) {
    unsigned int d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ unsigned int h2_fma(unsigned int a, unsigned int b, unsigned int c) {
    unsigned int d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ unsigned int h2_pack(float lo, float hi) {
    unsigned int d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
// N bytes (4, 8 or 16) from global to shared memory without passing through registers (cp.async);
// a commit closes a group of them, a wait leaves at most PENDING of this thread's groups in flight.
// PF (0, 64, 128 or 256): the L2 also fetches the PF-byte block around the source (a hint, same
// result), for rows read a few bytes a step
template <int N, int PF = 0> __device__ __forceinline__ void copy_async(void* shared, const void* global) {
    const unsigned int address = (unsigned int)__cvta_generic_to_shared(shared);
    if (PF == 256) {
        asm volatile("cp.async.ca.shared.global.L2::256B [%0], [%1], %2;" :: "r"(address), "l"(global), "n"(N) : "memory");
    } else if (PF == 128) {
        asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], %2;" :: "r"(address), "l"(global), "n"(N) : "memory");
    } else if (PF == 64) {
        asm volatile("cp.async.ca.shared.global.L2::64B [%0], [%1], %2;" :: "r"(address), "l"(global), "n"(N) : "memory");
    } else if (N == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(address), "l"(global) : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" :: "r"(address), "l"(global), "n"(N) : "memory");
    }
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING> __device__ __forceinline__ void copies_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory");
}
#endif
// N = 2 or 4 consecutive 32-bit words in one 8- or 16-byte load (p aligned to it)
template <int N> __device__ __forceinline__ void load_words(const unsigned int* p, unsigned int* out) {
    if (N == 4) {
        const uint4 x = *reinterpret_cast<const uint4*>(p);
        out[0] = x.x; out[1] = x.y; out[N - 2] = x.z; out[N - 1] = x.w;
    } else {
        const uint2 x = *reinterpret_cast<const uint2*>(p);
        out[0] = x.x; out[1] = x.y;
    }
}
// the token (or channel) of fragment row i of a 16-row sub-block: codes of B bits sit 16 / B to a
// 16-bit half, so row i's code and row i + 8's share a word and an offset (B = 2: rows are tokens in
// order; B = 4: two words of 8, rows 0-3 and 8-11 from the first's halves, 4-7 and 12-15 from the second's)
template <int B> __device__ __forceinline__ int rho(int i) {
    if (B == 2) return i;
    const int j = i % 8;
    return 8 * (j / 4) + j % 4 + 4 * (i / 8);
}
// the two codes of fragment rows i and i + 8 (i < 8) of a 16-row sub-block, each in its 16-bit half
// as the fp16 number 1024 + code; `words` are the sub-block's (B = 2: one, B = 4: two)
template <int B> __device__ __forceinline__ unsigned int codes_pair(const unsigned int* words, int i) {
    constexpr unsigned int MASK = B == 2 ? 0x00030003u : 0x000F000Fu;
    // a select, not words[i / 4]: a register array indexed at run time would live in local memory
    const unsigned int w = (B == 2 || i < 4) ? words[0] : words[1];
    const int shift = B == 2 ? 2 * i : 4 * (i % 4);
    return ((w >> shift) & MASK) | 0x64006400u;
}

// N consecutive 16-bit values (scales or zeros of one row) in N / 2 rounded up 32-bit words, with the
// widest loads the row's alignment allows (rows of N halves start at multiples of N halves)
template <int N> __device__ __forceinline__ void load_halves(const unsigned short* p, unsigned int* out) {
    if (N % 8 == 0) {
        _Pragma("unroll") for (int j = 0; j < N / 8; ++j) {
            const uint4 x = reinterpret_cast<const uint4*>(p)[j];
            out[4 * j] = x.x; out[4 * j + 1] = x.y; out[4 * j + 2] = x.z; out[4 * j + 3] = x.w;
        }
    } else if (N % 4 == 0) {
        const uint2 x = reinterpret_cast<const uint2*>(p)[0];
        out[0] = x.x; out[1] = x.y;
    } else if (N % 2 == 0) {
        out[0] = reinterpret_cast<const unsigned int*>(p)[0];
    } else {
        out[0] = p[0];
    }
}
template <int N> __device__ __forceinline__ unsigned int half_of(const unsigned int* words, int j) {
    return (words[j / 2] >> (16 * (j % 2))) & 0xFFFFu;
}
"""

BODY = """
    constexpr int NW = NT / 32;
    constexpr int CH = D / 16;           // 16-channel chunks
    constexpr int SB = ST / 16;          // 16-token sub-blocks a step
    constexpr int NGV = D / G;           // value groups per token
    constexpr int KWS = ST * KB / 32;    // key words per channel per step (2 or 4)
    constexpr int VWROW = D * VB / 32;   // value words per token
    constexpr int VROW = VWROW + 4;      // a token's words in shared memory, padded against bank conflicts
    constexpr unsigned int MAGIC = 0x64006400u;  // (1024, 1024) in half2
    // a warp's staging words: key codes [D][KWS], key (scale, zero) words [D][2], value codes
    // [ST][VROW], value scales and zeros [ST * NGV / 2] each; all multiples of 4 words (16 bytes)
    constexpr int S_KW = 0;
    constexpr int S_KSZ = S_KW + D * KWS;
    constexpr int S_VW = S_KSZ + 2 * D;
    constexpr int S_VS = S_VW + ST * VROW;
    constexpr int S_VZ = S_VS + ST * NGV / 2;
    constexpr int STAGE = S_VZ + ST * NGV / 2;
    constexpr int MEET = NW * 8 * D + 2 * NW * 8 + NW * 8 * NGV;  // the warps' partials at the end
    constexpr int SMEM = NW * STAGE > MEET ? NW * STAGE : MEET;
    const int n_steps = dims[9] / ST;
    const int kwrow = dims[4];
    const int kgrow = dims[5];
    const int vcap = dims[6];
    const int nbm = dims[10];
    const int spw = dims[11];
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int r = lane / 4;
    const int k = lane % 4;
    const float qscale = params[0];
    const unsigned short* ksh = reinterpret_cast<const unsigned short*>(ks);
    const unsigned short* kzh = reinterpret_cast<const unsigned short*>(kz);
    const unsigned short* vsh = reinterpret_cast<const unsigned short*>(vs);
    const unsigned short* vzh = reinterpret_cast<const unsigned short*>(vz);

    KV_SHARED uint4 smem4[SMEM / 4];
    unsigned int* const smem = reinterpret_cast<unsigned int*>(smem4);
    unsigned int* const stage = smem + warp * STAGE;

    // A step's codes and scales come into the warp's staging area by asynchronous copies issued
    // one phase ahead: the next step's keys load while this step's values are used, and the next
    // step's values while the next step's scores are computed. The lanes copy the step's bytes
    // once (before, each of the 8 lanes of a fragment row loaded the same words and scales itself,
    // and each chunk waited for its own loads).
    auto copy_keys = [&](int step) {
        const int t_base = step * ST;
        _Pragma("unroll 1") for (int ch = lane; ch < D; ch += 32) {
            const long row = (long)bh * D + ch;
            copy_async<4 * KWS, PF>(stage + S_KW + ch * KWS, kc + row * kwrow + t_base * KB / 32);
            // the aligned 32-bit pair of halves holding the step's group(s) (both of them where G < ST:
            // then kgrow is even, so the step's first group starts a pair)
            const long g = (row * kgrow + t_base / G) & ~1L;
            copy_async<4, PF>(stage + S_KSZ + 2 * ch, ksh + g);
            copy_async<4, PF>(stage + S_KSZ + 2 * ch + 1, kzh + g);
        }
    };
    auto copy_values = [&](int step) {
        const long row0 = (long)bh * vcap + step * ST;  // the step's tokens are consecutive rows
        _Pragma("unroll 1") for (int j = lane; j < ST * VWROW / 4; j += 32) {
            const int t = j / (VWROW / 4);
            const int u = j % (VWROW / 4);
            copy_async<16>(stage + S_VW + t * VROW + 4 * u, vc + row0 * VWROW + 4 * j);
        }
        // ST * NGV halves each, in pieces of VSB bytes (a token's NGV halves start at a multiple of
        // 2 NGV bytes; one group a token: vcap is even)
        constexpr int VSB = NGV >= 8 ? 16 : (NGV >= 2 ? 2 * NGV : 4);
        _Pragma("unroll 1") for (int j = lane; j < ST * NGV * 2 / VSB; j += 32) {
            copy_async<VSB>(stage + S_VS + j * VSB / 4, vsh + row0 * NGV + j * VSB / 2);
            copy_async<VSB>(stage + S_VZ + j * VSB / 4, vzh + row0 * NGV + j * VSB / 2);
        }
    };

    // Q^T as B fragments of the score product: query row r, channels 16c + 2k (+1) and + 8 (+9)
    unsigned int bq[CH][2];
    const unsigned int* qw = reinterpret_cast<const unsigned int*>(q);
    _Pragma("unroll") for (int c = 0; c < CH; ++c) {
        const long e = ((long)bh * M + r) * D + 16 * c + 2 * k;
        bq[c][0] = r < M ? qw[e / 2] : 0u;
        bq[c][1] = r < M ? qw[e / 2 + 4] : 0u;
    }
    float run_max[2] = {NEG_INF, NEG_INF};  // query rows 2k, 2k + 1 (log2 units)
    float run_sum[2] = {0.0f, 0.0f};              // this lane's share of the sums
    float oc[CH][4];   // O^T [16 channels x 8 rows] per chunk: channels rho(r), rho(r + 8); rows 2k, 2k + 1
    _Pragma("unroll") for (int c = 0; c < CH; ++c) { _Pragma("unroll") for (int e = 0; e < 4; ++e) oc[c][e] = 0.0f; }
    // the value zeros' terms [16 x 8 rows]: row g (lanes r = g < NGV, in zc[0], zc[1]) is group g's sum_t p_t z_{t,g}
    static_assert(NGV <= 8, "one zeros' product a sub-block holds 8 value groups (A's rows r < 8)");
    float zc[4] = {0.0f, 0.0f, 0.0f, 0.0f};

    const int step0 = (blk * NW + warp) * spw;
    const int step_end = min(step0 + spw, n_steps);
    if (step0 < step_end) {
        copy_keys(step0);
        copies_commit();
        copy_values(step0);
        copies_commit();
    }
    for (int step = step0; step < step_end; ++step) {
        const bool next = step + 1 < step_end;
        copies_wait<1>();  // this step's keys are in (its values may still be on their way)
        __syncwarp();
        // ---- scores of SB sub-blocks of 16 tokens
        float sc[SB][4];
        _Pragma("unroll") for (int sb = 0; sb < SB; ++sb) { _Pragma("unroll") for (int e = 0; e < 4; ++e) sc[sb][e] = 0.0f; }
        _Pragma("unroll") for (int c = 0; c < CH; ++c) {
            // this lane's channels 16c + 2k + {0, 1, 8, 9}: their words of the step and (scale, zero) words
            unsigned int w[4][KWS];
            uint2 sz[4];
            _Pragma("unroll") for (int i = 0; i < 4; ++i) {
                const int ch = 16 * c + 2 * k + (i / 2) * 8 + i % 2;
                load_words<KWS>(stage + S_KW + ch * KWS, w[i]);
                sz[i] = *reinterpret_cast<const uint2*>(stage + S_KSZ + 2 * ch);
            }
            _Pragma("unroll") for (int sb = 0; sb < SB; ++sb) {
                // the sub-block's group is the half (index & 1) of each channel's word: channel rows
                // 2k + 8i' are even, 2k + 1 + 8i' odd, so their indices' parities differ where kgrow is odd
                const int g_even = (step * ST + 16 * sb) / G;
                const int g_odd = g_even + (kgrow & 1);
                // (s, z) pairs for channels (2k, 2k + 1) and (2k + 8, 2k + 9): the even channel's half
                // low, the odd one's high
                const unsigned int perm = ((g_odd & 1) ? 0x7600u : 0x5400u) | ((g_even & 1) ? 0x32u : 0x10u);
                const unsigned int s01 = __byte_perm(sz[0].x, sz[1].x, perm);
                const unsigned int s89 = __byte_perm(sz[2].x, sz[3].x, perm);
                const unsigned int z01 = __byte_perm(sz[0].y, sz[1].y, perm);
                const unsigned int z89 = __byte_perm(sz[2].y, sz[3].y, perm);
                const unsigned int x0 = codes_pair<KB>(&w[0][sb * KB / 2], r);
                const unsigned int x1 = codes_pair<KB>(&w[1][sb * KB / 2], r);
                const unsigned int x2 = codes_pair<KB>(&w[2][sb * KB / 2], r);
                const unsigned int x3 = codes_pair<KB>(&w[3][sb * KB / 2], r);
                unsigned int a[4];
                a[0] = h2_fma(h2_sub(__byte_perm(x0, x1, 0x5410), MAGIC), s01, z01);  // token rho(r), channels 2k, 2k+1
                a[1] = h2_fma(h2_sub(__byte_perm(x0, x1, 0x7632), MAGIC), s01, z01);  // token rho(r + 8)
                a[2] = h2_fma(h2_sub(__byte_perm(x2, x3, 0x5410), MAGIC), s89, z89);  // channels 2k + 8, 2k + 9
                a[3] = h2_fma(h2_sub(__byte_perm(x2, x3, 0x7632), MAGIC), s89, z89);
                mma_f16(sc[sb], a, bq[c]);
            }
        }
        __syncwarp();  // every lane has read the keys: the next step's may come in
        if (next) copy_keys(step + 1);
        copies_commit();
        // ---- online softmax over the step: row 2k in e = 0, 2; row 2k + 1 in e = 1, 3
        float step_max[2];
        _Pragma("unroll") for (int j = 0; j < 2; ++j) {
            float x = NEG_INF;
            _Pragma("unroll") for (int sb = 0; sb < SB; ++sb) x = FMAX(x, FMAX(sc[sb][j], sc[sb][j + 2]) * qscale);
            x = FMAX(x, SHFL_XOR(x, 4));
            x = FMAX(x, SHFL_XOR(x, 8));
            x = FMAX(x, SHFL_XOR(x, 16));
            step_max[j] = x;
        }
        float corr[2];
        _Pragma("unroll") for (int j = 0; j < 2; ++j) {
            const float new_max = FMAX(run_max[j], step_max[j]);
            corr[j] = run_max[j] == NEG_INF ? 0.0f : EXP2(run_max[j] - new_max);
            run_max[j] = new_max;
            run_sum[j] *= corr[j];
        }
        _Pragma("unroll") for (int c = 0; c < CH; ++c) {
            _Pragma("unroll") for (int e = 0; e < 4; ++e) oc[c][e] *= corr[e % 2];
        }
        _Pragma("unroll") for (int e = 0; e < 4; ++e) zc[e] *= corr[e % 2];
        copies_wait<1>();  // this step's values are in (the next step's keys may still be on their way)
        __syncwarp();
        _Pragma("unroll") for (int sb = 0; sb < SB; ++sb) {
            float p[4];
            _Pragma("unroll") for (int e = 0; e < 4; ++e) {
                p[e] = EXP2(sc[sb][e] * qscale - run_max[e % 2]);
                run_sum[e % 2] += p[e];
            }
            // P^T as the B fragment of the value product: query row r, tokens rho(2k), rho(2k+1) (b0)
            // and rho(2k + 8), rho(2k + 9) (b1) of the sub-block
            unsigned int bp[2];
            bp[0] = movmatrix_trans(h2_pack(p[0], p[1]));
            bp[1] = movmatrix_trans(h2_pack(p[2], p[3]));
            // ---- values: this lane's tokens of the sub-block (its A columns), as rows of the step
            int tok[4];
            tok[0] = 16 * sb + rho<KB>(2 * k);
            tok[1] = 16 * sb + rho<KB>(2 * k + 1);
            tok[2] = 16 * sb + rho<KB>(2 * k + 8);
            tok[3] = 16 * sb + rho<KB>(2 * k + 9);
            // the zeros' terms of every group in one product: A's row g holds group g's zeros of the
            // lane's tokens (the lane's row r: group r, where r < NGV; the other rows are zero)
            {
                const unsigned short* vz_stage = reinterpret_cast<const unsigned short*>(stage + S_VZ);
                unsigned int az[4] = {0u, 0u, 0u, 0u};
                if (r < NGV) {
                    az[0] = (unsigned int)vz_stage[tok[0] * NGV + r] | ((unsigned int)vz_stage[tok[1] * NGV + r] << 16);
                    az[2] = (unsigned int)vz_stage[tok[2] * NGV + r] | ((unsigned int)vz_stage[tok[3] * NGV + r] << 16);
                }
                mma_f16(zc, az, bp);
            }
            // the tokens' scales (NGV a token), folded into P per group
            constexpr int NGW = (NGV + 1) / 2;
            unsigned int vsw[4][NGW];
            _Pragma("unroll") for (int i = 0; i < 4; ++i) {
                load_halves<NGV>(reinterpret_cast<const unsigned short*>(stage + S_VS) + tok[i] * NGV, vsw[i]);
            }
            unsigned int bs[NGV][2];
            _Pragma("unroll") for (int g = 0; g < NGV; ++g) {
                bs[g][0] = h2_mul(bp[0], half_of<NGV>(vsw[0], g) | (half_of<NGV>(vsw[1], g) << 16));
                bs[g][1] = h2_mul(bp[1], half_of<NGV>(vsw[2], g) | (half_of<NGV>(vsw[3], g) << 16));
            }
            // the code words, 4 at a time per token (16 bytes: 4 chunks of 2-bit codes, 2 of 4-bit)
            constexpr int CPU_ = 8 / VB;  // chunks a 4-word unit holds
            _Pragma("unroll") for (int u = 0; u < VWROW / 4; ++u) {
                unsigned int vw[4][4];
                _Pragma("unroll") for (int i = 0; i < 4; ++i) {
                    const uint4 x = *reinterpret_cast<const uint4*>(stage + S_VW + tok[i] * VROW + 4 * u);
                    vw[i][0] = x.x; vw[i][1] = x.y; vw[i][2] = x.z; vw[i][3] = x.w;
                }
                _Pragma("unroll") for (int cc = 0; cc < CPU_; ++cc) {
                    const int c = u * CPU_ + cc;
                    unsigned int x[4];
                    _Pragma("unroll") for (int i = 0; i < 4; ++i) x[i] = codes_pair<VB>(&vw[i][cc * VB / 2], r);
                    unsigned int a[4];
                    a[0] = h2_sub(__byte_perm(x[0], x[1], 0x5410), MAGIC);  // channel rho(r), tokens 0, 1 of the lane
                    a[1] = h2_sub(__byte_perm(x[0], x[1], 0x7632), MAGIC);  // channel rho(r + 8)
                    a[2] = h2_sub(__byte_perm(x[2], x[3], 0x5410), MAGIC);  // tokens 2, 3
                    a[3] = h2_sub(__byte_perm(x[2], x[3], 0x7632), MAGIC);
                    mma_f16(oc[c], a, bs[c / (G / 16)]);
                }
            }
        }
        __syncwarp();  // every lane has read the values: the next step's may come in
        if (next) copy_values(step + 1);
        copies_commit();
    }
    copies_wait<0>();

    // ---- the block's warps meet (in the staging area, once every warp is done with its own):
    // each leaves its max, sum and output rows, then one combine
    KV_BARRIER();
    float* const w_out = reinterpret_cast<float*>(smem);   // [NW][8][D]
    float* const w_max = w_out + NW * 8 * D;               // [NW][8]
    float* const w_sum = w_max + NW * 8;                   // [NW][8]
    float* const w_zero = w_sum + NW * 8;                  // [NW][8][NGV]: the value zeros' terms
    _Pragma("unroll") for (int j = 0; j < 2; ++j) {
        float x = run_sum[j];
        x += SHFL_XOR(x, 4);
        x += SHFL_XOR(x, 8);
        x += SHFL_XOR(x, 16);
        run_sum[j] = x;
    }
    if (r == 0) {
        _Pragma("unroll") for (int j = 0; j < 2; ++j) {
            w_max[warp * 8 + 2 * k + j] = run_max[j];
            w_sum[warp * 8 + 2 * k + j] = run_sum[j];
        }
    }
    if (r < NGV) {
        _Pragma("unroll") for (int j = 0; j < 2; ++j) w_zero[(warp * 8 + 2 * k + j) * NGV + r] = zc[j];
    }
    _Pragma("unroll") for (int c = 0; c < CH; ++c) {
        _Pragma("unroll") for (int e = 0; e < 4; ++e) {
            const int m = 2 * k + e % 2;
            const int d = 16 * c + rho<VB>(r + 8 * (e / 2));
            w_out[(warp * 8 + m) * D + d] = oc[c][e];
        }
    }
    KV_BARRIER();
    const long out_base = ((long)bh * nbm + blk) * M;
    for (int i = tid; i < M * D; i += NT) {
        const int m = i / D;
        const int d = i % D;
        float gmax = NEG_INF;
        _Pragma("unroll") for (int w2 = 0; w2 < NW; ++w2) gmax = FMAX(gmax, w_max[w2 * 8 + m]);
        float num = 0.0f;
        float den = 0.0f;
        if (gmax != NEG_INF) {
            _Pragma("unroll") for (int w2 = 0; w2 < NW; ++w2) {
                if (w_max[w2 * 8 + m] == NEG_INF) continue;
                const float f = EXP2(w_max[w2 * 8 + m] - gmax);
                num += f * (w_out[(w2 * 8 + m) * D + d] + w_zero[(w2 * 8 + m) * NGV + d / G]);
                den += f * w_sum[w2 * 8 + m];
            }
        }
        o_mma[out_base * D + i] = num;
        if (d == 0) {
            st_mma[(out_base + m) * 2] = gmax;
            st_mma[(out_base + m) * 2 + 1] = den;
        }
    }
"""

def source(scalar_body: str | None) -> str:
    """With a scalar body: one kernel of two kinds of blocks, the first dims[7] running the scalar
    kernel's body (the tokens from dims[9] on: residuals and the rest), the others this one's. Without:
    this kernel's blocks alone (the scalar kernel then runs as its own launch)."""
    if scalar_body is None:
        return "const int tid = threadIdx.x; const long bh = blockIdx.y; const int blk = blockIdx.x;\n" + BODY
    return ("const int tid = threadIdx.x; const long bh = blockIdx.y;\n"
            "if ((int)blockIdx.x < dims[7]) {\n const int blk = blockIdx.x;\n" + scalar_body + "\n} else {\n"
            " const int blk = blockIdx.x - dims[7];\n" + BODY + "\n}\n")


INPUTS = ["q", "kc", "ks", "kz", "kr", "vc", "vs", "vz", "vr", "dims", "params"]
OUTPUTS = ["o_part", "stats", "o_mma", "st_mma"]
_kernels = dispatch.kernel_cache()  # (header, scalar body) -> kernel


def _kernel(header: str, scalar_body: str | None):
    key = (header, scalar_body)  # str hashes are cached: a cheap lookup per layer and step
    if key not in _kernels:
        full, body = header + HEADER, source(scalar_body)
        outputs = OUTPUTS if scalar_body is not None else OUTPUTS[2:]
        _kernels[key] = dispatch.fast_kernel("cuda", "kivi_decode_attention_mma", body, full, INPUTS, outputs)
    return _kernels[key]


@functools.lru_cache(maxsize=None)
def supported(dtype, D: int, key_bits: int, value_bits: int, group_size: int, rows: int, scalar_bytes: int) -> bool:
    """Whether this kernel covers decode calls of this signature (fp16 queries of head dim D, 2/4-bit
    codes, the shapes and shared memory with the scalar kernel's `scalar_bytes`; see the module
    docstring)."""
    return (dtype == mx.float16 and key_bits in BITS and value_bits in BITS and D in (64, 128)
            and group_size % 32 == 0 and D % group_size == 0 and rows <= 8
            and shared_bytes(D, rows, key_bits, value_bits, group_size, scalar_bytes) <= SHARED_LIMIT)


def aligned(key_words_per_row: int, key_groups_per_row: int, value_rows: int, value_groups: int,
            group_size: int, step: int) -> bool:
    """Whether the arrays' rows allow the kernel's copies: key rows of whole 16-byte units; where a
    step holds two key groups (G < step), an even number of groups a row, so the two are one 32-bit
    word; with one value group a token, an even number of value rows (its scales are copied 4 bytes
    at a time)."""
    return (key_words_per_row % 4 == 0 and (group_size >= step or key_groups_per_row % 2 == 0)
            and (value_groups >= 2 or value_rows % 2 == 0))


def tokens_covered(n_keys_packed: int, n_values_packed: int, total: int, query_positions: int, causal: bool) -> int:
    """The tokens [0, n) this kernel takes: codes on both sides, seen by every row, whole steps."""
    seen_by_all = total - query_positions + 1 if causal else total
    return min(n_keys_packed, n_values_packed, seen_by_all) // STEP * STEP


def partials(inputs: list, dims_values: list[int], template: list, D: int, M: int, rows: int, header: str,
             scalar_body: str | None):
    """This kernel's partials [rows, dims[10], M, D] and (max, sum) [rows, dims[10], M, 2]; with a
    scalar body, first the scalar kernel's [rows, dims[7], ...] from the same launch."""
    nb, nbm = dims_values[7], dims_values[10]
    shapes = [(rows, nbm, M, D), (rows, nbm, M, 2)]
    if scalar_body is not None:
        shapes = [(rows, max(nb, 1), M, D), (rows, max(nb, 1), M, 2)] + shapes
    return _kernel(header, scalar_body)(
        inputs=inputs,
        template=template,
        grid=((nbm + (nb if scalar_body is not None else 0)) * THREADS, rows, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=shapes,
        output_dtypes=[mx.float32] * len(shapes),
    )
