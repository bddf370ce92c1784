"""KIVI decode attention on the tensor cores (CUDA, fp16 codes of 2 or 4 bits): the packed bulk of the tokens.

Why: the scalar kernel of kivi_attention.py turns every code into a float and spends M FMAs on it
(M = the query rows of a KV head); measured with Nsight Compute on the H200 (32k tokens, KIVI-2, 8
KV heads x 4 rows, D 128) it issued ~25 M warp instructions in 82 us at 0.37 instructions a cycle
per scheduler, with 8 warps an SM. Here the products run as `mma.sync` m16n8k16 (fp16 in, fp32
accumulation) and a code costs ~2.5 integer/half2 instructions on its way into a fragment.

Status: opt-in (`decode_attention_fused(..., tensor_cores=True)`), not the dispatch's choice. On the
H200 it is correct (tests/test_kivi_attention.py) but not faster: at 32k, 4 steps a warp, KIVI-2
84 us a layer against the scalar kernel's 94 (SDPA 68), KIVI-4 98 against 93; at 128k KIVI-2 231
against 250, KIVI-4 320 against 258 (benchmarks/KIVI_GPU_NOTES.md, stop 19). Nsight Compute: 144
registers (3 blocks an SM, 12 warps), latency-bound on loads (L1 41%, DRAM 7%, compute 22%): the 8
lanes of a fragment row load the same key words and scales, one chunk's loads at a time.

The problem is the one of kivi_attention.py (rows rep-major, post-RoPE queries); this kernel takes
the tokens [0, n_full) with n_full a multiple of 64 that every row sees (below the key and value
residuals and the causal band), and the scalar kernel the rest, in the same softmax: both leave
partial outputs with their running max and sum, and one combine merges them (kivi_attention.py).

Each warp is on its own (no block barrier until the end): it walks steps of 64 tokens, keeping an
online softmax per query row. With lane l, r = l / 4 and k = l % 4:
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
  are quantized per token, so the scale is folded into P (P s, per value group) and the zero's
  term sum_t p_t z_t is one more product per chunk (A = z broadcast over its 16 channels):
  out = sum_t p_t s_t c_t + sum_t p_t z_t, exact products of fp16 numbers in fp32 sums.
At the end the block's warps meet once in shared memory and leave one partial per block.

Supported (`supported`): fp16, key and value bits 2 or 4, D 64, 128 or 256, group size
a multiple of 32 dividing D, 1..8 rows. CUDA only: the fragments are PTX's; Metal runs the scalar
kernel. The CPU emulator (tests/cuda_on_cpu.py) has its own mma, movmatrix and half2 arithmetic,
so the fragment bookkeeping is tested without a GPU.
"""

from __future__ import annotations

import zlib

import mlx.core as mx

BITS = (2, 4)
STEP = 64  # tokens a warp takes at a time: 4 sub-blocks of 16
WARPS = 4
THREADS = 32 * WARPS

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
#endif
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
    constexpr int CH = D / 16;        // 16-channel chunks
    constexpr int NGV = D / G;        // value groups per token
    constexpr int KWS = 64 * KB / 32; // key words per channel per step
    constexpr int VWROW = D * VB / 32;
    constexpr unsigned int MAGIC = 0x64006400u;  // (1024, 1024) in half2
    const int n_steps = dims[9] / 64;
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

    const int step0 = (blk * NW + warp) * spw;
    const int step_end = min(step0 + spw, n_steps);
    for (int step = step0; step < step_end; ++step) {
        const int t_base = step * 64;
        // ---- scores of 4 sub-blocks of 16 tokens
        float sc[4][4];
        _Pragma("unroll") for (int sb = 0; sb < 4; ++sb) { _Pragma("unroll") for (int e = 0; e < 4; ++e) sc[sb][e] = 0.0f; }
        _Pragma("unroll") for (int c = 0; c < CH; ++c) {
            // this lane's channels 16c + 2k + {0, 1, 8, 9}: their words of the step and scales/zeros
            unsigned int w[4][KWS];
            unsigned short sv[4][2], zv[4][2];
            _Pragma("unroll") for (int i = 0; i < 4; ++i) {
                const long row = (long)bh * D + 16 * c + 2 * k + (i / 2) * 8 + i % 2;
                const unsigned int* src = kc + row * kwrow + t_base * KB / 32;
                _Pragma("unroll") for (int j = 0; j < KWS; j += 4) {  // 16-byte loads (kwrow % 4 == 0)
                    const uint4 x = *reinterpret_cast<const uint4*>(src + j);
                    w[i][j] = x.x; w[i][j + 1] = x.y; w[i][j + 2] = x.z; w[i][j + 3] = x.w;
                }
                const long g0 = row * kgrow + t_base / G;
                if (G == 32) {  // the step's two groups in one 32-bit load (kgrow is even)
                    const unsigned int s2 = reinterpret_cast<const unsigned int*>(ksh + g0)[0];
                    const unsigned int z2 = reinterpret_cast<const unsigned int*>(kzh + g0)[0];
                    sv[i][0] = s2 & 0xFFFFu; sv[i][1] = s2 >> 16;
                    zv[i][0] = z2 & 0xFFFFu; zv[i][1] = z2 >> 16;
                } else {
                    sv[i][0] = ksh[g0];
                    zv[i][0] = kzh[g0];
                }
            }
            _Pragma("unroll") for (int sb = 0; sb < 4; ++sb) {
                const int gi = G == 32 ? sb / 2 : 0;  // the step's key group of this sub-block
                // (s, z) pairs for channels (2k, 2k + 1) and (2k + 8, 2k + 9)
                const unsigned int s01 = sv[0][gi] | ((unsigned int)sv[1][gi] << 16);
                const unsigned int s89 = sv[2][gi] | ((unsigned int)sv[3][gi] << 16);
                const unsigned int z01 = zv[0][gi] | ((unsigned int)zv[1][gi] << 16);
                const unsigned int z89 = zv[2][gi] | ((unsigned int)zv[3][gi] << 16);
                const unsigned int* ws0 = &w[0][sb * KWS / 4];
                const unsigned int* ws1 = &w[1][sb * KWS / 4];
                const unsigned int* ws2 = &w[2][sb * KWS / 4];
                const unsigned int* ws3 = &w[3][sb * KWS / 4];
                const unsigned int x0 = codes_pair<KB>(ws0, r);
                const unsigned int x1 = codes_pair<KB>(ws1, r);
                const unsigned int x2 = codes_pair<KB>(ws2, r);
                const unsigned int x3 = codes_pair<KB>(ws3, r);
                unsigned int a[4];
                a[0] = h2_fma(h2_sub(__byte_perm(x0, x1, 0x5410), MAGIC), s01, z01);  // token rho(r), channels 2k, 2k+1
                a[1] = h2_fma(h2_sub(__byte_perm(x0, x1, 0x7632), MAGIC), s01, z01);  // token rho(r + 8)
                a[2] = h2_fma(h2_sub(__byte_perm(x2, x3, 0x5410), MAGIC), s89, z89);  // channels 2k + 8, 2k + 9
                a[3] = h2_fma(h2_sub(__byte_perm(x2, x3, 0x7632), MAGIC), s89, z89);
                mma_f16(sc[sb], a, bq[c]);
            }
        }
        // ---- online softmax over the step: row 2k in e = 0, 2; row 2k + 1 in e = 1, 3
        float step_max[2];
        _Pragma("unroll") for (int j = 0; j < 2; ++j) {
            float x = NEG_INF;
            _Pragma("unroll") for (int sb = 0; sb < 4; ++sb) x = FMAX(x, FMAX(sc[sb][j], sc[sb][j + 2]) * qscale);
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
        _Pragma("unroll") for (int sb = 0; sb < 4; ++sb) {
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
            // ---- values: this lane's tokens of the sub-block (its A columns)
            const int tb = t_base + 16 * sb;
            int tok[4];
            tok[0] = tb + rho<KB>(2 * k);
            tok[1] = tb + rho<KB>(2 * k + 1);
            tok[2] = tb + rho<KB>(2 * k + 8);
            tok[3] = tb + rho<KB>(2 * k + 9);
            // the tokens' scales and zeros (NGV a token), then per group: the zero's term and P s
            constexpr int NGW = (NGV + 1) / 2;
            unsigned int vsw[4][NGW], vzw[4][NGW];
            _Pragma("unroll") for (int i = 0; i < 4; ++i) {
                const long row = (long)bh * vcap + tok[i];
                load_halves<NGV>(vsh + row * NGV, vsw[i]);
                load_halves<NGV>(vzh + row * NGV, vzw[i]);
            }
            unsigned int bs[NGV][2];
            _Pragma("unroll") for (int g = 0; g < NGV; ++g) {
                // zero's term, into every chunk of the group: A = the tokens' zeros, alike in each channel row
                unsigned int az[4];
                az[0] = az[1] = half_of<NGV>(vzw[0], g) | (half_of<NGV>(vzw[1], g) << 16);
                az[2] = az[3] = half_of<NGV>(vzw[2], g) | (half_of<NGV>(vzw[3], g) << 16);
                _Pragma("unroll") for (int cc = 0; cc < G / 16; ++cc) mma_f16(oc[g * (G / 16) + cc], az, bp);
                // the group's scales folded into P
                bs[g][0] = h2_mul(bp[0], half_of<NGV>(vsw[0], g) | (half_of<NGV>(vsw[1], g) << 16));
                bs[g][1] = h2_mul(bp[1], half_of<NGV>(vsw[2], g) | (half_of<NGV>(vsw[3], g) << 16));
            }
            // the code words, 4 at a time per token (16 bytes: 4 chunks of 2-bit codes, 2 of 4-bit)
            constexpr int CPU_ = 8 / VB;  // chunks a 4-word unit holds
            _Pragma("unroll") for (int u = 0; u < VWROW / 4; ++u) {
                unsigned int vw[4][4];
                _Pragma("unroll") for (int i = 0; i < 4; ++i) {
                    const uint4 x = reinterpret_cast<const uint4*>(vc + ((long)bh * vcap + tok[i]) * VWROW)[u];
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
    }

    // ---- the block's warps meet: each leaves its max, sum and output rows, then one combine
    KV_SHARED float w_max[NW][8];
    KV_SHARED float w_sum[NW][8];
    KV_SHARED float w_out[NW][8][D];
    _Pragma("unroll") for (int j = 0; j < 2; ++j) {
        float x = run_sum[j];
        x += SHFL_XOR(x, 4);
        x += SHFL_XOR(x, 8);
        x += SHFL_XOR(x, 16);
        run_sum[j] = x;
    }
    if (r == 0) {
        _Pragma("unroll") for (int j = 0; j < 2; ++j) {
            w_max[warp][2 * k + j] = run_max[j];
            w_sum[warp][2 * k + j] = run_sum[j];
        }
    }
    _Pragma("unroll") for (int c = 0; c < CH; ++c) {
        _Pragma("unroll") for (int e = 0; e < 4; ++e) {
            const int m = 2 * k + e % 2;
            const int d = 16 * c + rho<VB>(r + 8 * (e / 2));
            w_out[warp][m][d] = oc[c][e];
        }
    }
    KV_BARRIER();
    const long out_base = ((long)bh * nbm + blk) * M;
    for (int i = tid; i < M * D; i += NT) {
        const int m = i / D;
        const int d = i % D;
        float gmax = NEG_INF;
        _Pragma("unroll") for (int w2 = 0; w2 < NW; ++w2) gmax = FMAX(gmax, w_max[w2][m]);
        float num = 0.0f;
        float den = 0.0f;
        if (gmax != NEG_INF) {
            _Pragma("unroll") for (int w2 = 0; w2 < NW; ++w2) {
                if (w_max[w2][m] == NEG_INF) continue;
                const float f = EXP2(w_max[w2][m] - gmax);
                num += f * w_out[w2][m][d];
                den += f * w_sum[w2][m];
            }
        }
        o_mma[out_base * D + i] = num;
        if (d == 0) {
            st_mma[(out_base + m) * 2] = gmax;
            st_mma[(out_base + m) * 2 + 1] = den;
        }
    }
"""

def source(scalar_body: str) -> str:
    """One kernel of two kinds of blocks: the first dims[7] run the scalar kernel's body (the tokens
    from dims[9] on: residuals and the rest), the others this one's. The scalar blocks come first so
    the GPU starts them first, and their few long tiles overlap the many tensor-core steps instead of
    running after them as a second launch (a launch of 8 blocks at 32k: latency, not work)."""
    return ("const int tid = threadIdx.x; const long bh = blockIdx.y;\n"
            "if ((int)blockIdx.x < dims[7]) {\n const int blk = blockIdx.x;\n" + scalar_body + "\n} else {\n"
            " const int blk = blockIdx.x - dims[7];\n" + BODY + "\n}\n")


INPUTS = ["q", "kc", "ks", "kz", "kr", "vc", "vs", "vz", "vr", "dims", "params"]
OUTPUTS = ["o_part", "stats", "o_mma", "st_mma"]
_kernels: dict[tuple[str, str], object] = {}  # (header, scalar body) -> kernel


def _kernel(header: str, scalar_body: str):
    key = (header, scalar_body)  # str hashes are cached: a cheap lookup per layer and step
    if key not in _kernels:
        full, body = header + HEADER, source(scalar_body)
        # MLX caches compiled kernels by name: a name per source text, so an edited source recompiles
        name = f"kivi_decode_attention_mma_{zlib.crc32((full + body).encode()):08x}"
        _kernels[key] = mx.fast.cuda_kernel(name=name, input_names=INPUTS, output_names=OUTPUTS, source=body,
                                            header=full)
    return _kernels[key]


def supported(queries, key_bits: int, value_bits: int, group_size: int, rows: int) -> bool:
    """Whether this kernel covers a decode call (fp16 codes of 2/4 bits; see the module docstring)."""
    D = queries.shape[-1]
    return (queries.dtype == mx.float16 and key_bits in BITS and value_bits in BITS
            and D % 64 == 0 and D <= 256 and group_size % 32 == 0 and D % group_size == 0 and rows <= 8)


def tokens_covered(n_keys_packed: int, n_values_packed: int, total: int, query_positions: int, causal: bool) -> int:
    """The tokens [0, n) this kernel takes: codes on both sides, seen by every row, whole steps."""
    seen_by_all = total - query_positions + 1 if causal else total
    return min(n_keys_packed, n_values_packed, seen_by_all) // STEP * STEP


def default_steps_per_warp(steps: int, rows: int) -> int:
    """About 1024 warps in all: 4 steps a warp at 32k x 8 KV heads, the fastest of 1/2/3/4/8 measured
    there on the H200 (KIVI-2 84 us a layer; 1 step: 99 us)."""
    return max(1, -(-steps * rows // 1024))


def partials(inputs: list, dims_values: list[int], template: list, D: int, M: int, rows: int, header: str,
             scalar_body: str):
    """Launch both kinds of blocks: the scalar kernel's partials [rows, dims[7], M, D] and (max, sum)
    [rows, dims[7], M, 2], then this kernel's [rows, dims[10], ...]."""
    nb, nbm = dims_values[7], dims_values[10]
    return _kernel(header, scalar_body)(
        inputs=inputs,
        template=template,
        grid=((nb + nbm) * THREADS, rows, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, max(nb, 1), M, D), (rows, max(nb, 1), M, 2), (rows, nbm, M, D), (rows, nbm, M, 2)],
        output_dtypes=[mx.float32] * 4,
    )
