"""KIVI decode attention on packed codes: one fused kernel body for CUDA and Metal, MLX reference beside it.

The problem: 1..8 query rows per KV head (a decode step's GQA group, rep * L rows folded into one
matrix, as in kvcompress/methods/quantization/kivi.py) attend over T tokens whose first `n_packed` keys are KIVI
codes (per channel, K^T [D, T*kb/32] in MLX's layout, groups of G tokens) and whose first
`n_packed` values are codes (per token, [T, D*vb/32], groups of G channels); the remaining tokens of
each side are a full-precision residual. Keys and values may have different numbers of codes (the
paper's residual policy quantizes keys R at a time and values one at a time). The plain reference
is `decode_attention_reference` (MLX ops: `mx.quantized_matmul` on the codes, softmax, residuals):
the dispatch self-test and the tests compare the kernels here, in kivi_attention_mma.py and in
kivi_attention_cpu.py with it.

The fused kernel is flash-decoding (Dao et al., 2023): the token axis is cut into tiles of 256;
each thread block takes `tiles_per_block` consecutive tiles of one (batch, KV head) row and keeps a
running max and sum per query row (online softmax), so the partial output of a block is exact up to
one rescale. A second tiny kernel combines the blocks. Inside a tile:
- scores: warp w sums channels [w*D/4, (w+1)*D/4) for all 256 tokens (8 per lane). Each lane reads
  its 8 tokens' codes of one channel as one 16/32/64-bit piece of a code word, consecutive lanes
  consecutive pieces (coalesced), dequantizes in registers with the channel's scale and zero, and
  accumulates all query rows at once: every code byte is read once for the whole query group.
  Score = sum_d q_d * (z_d + s_d * c_d) = sum_d (q_d s_d) c_d + sum_d q_d z_d.
- residual keys (full precision) are read directly in the same tile loop, so the residual joins
  the same softmax.
- the warps' partial scores meet in shared memory behind one barrier (a slice per warp, summed in
  warp order by the softmax), not one barrier per warp.
- values: each thread owns 8 channels of the output and a 32-token slice of the tile; it reads the
  8 codes of a token as one piece, out_c += (p s) c + p z; residual values likewise in full precision.
  Where the slice is all codes, the loads of 8 tokens are issued before any is used (a token-by-token
  loop waited one memory latency per token: 96 -> 68-84 us per layer at 32k on the H200).
Accumulation is float32 throughout; the query is pre-scaled by scale * log2(e) and exp2 is used.

Supported: key/value bits 2, 4, 8 (3-bit codes straddle words: reference only), head_dim 32, 64,
128 or 256, 1..8 rows, mask None or "causal" (bottom-right aligned over the L query positions);
on Metal 1..7 rows (1..6 at D 256): 8 exceed a threadgroup's 32 KiB (`metal_fits`).
Everything else runs the reference. On CUDA, fp16 calls with 2-bit keys and values give their packed
bulk to the tensor-core kernel (kivi_attention_mma.py) and keep the rest (residuals, the causal band)
here, in one launch and one softmax. `decode_attention` picks the path through kernels/dispatch.py;
on the CPU the same cases (float32, whole key groups) run a C++ kernel (kivi_attention_cpu.py).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import mlx.core as mx

from . import dispatch, kivi_attention_mma
from .kivi_attention_cpu import decode_attention_cpu
from .kivi_attention_cpu import supported as cpu_supported

FUSED_BITS = (2, 4, 8)
# head dims the scalar kernel's thread layout covers: D / 8 channel groups, a power of two dividing a
# warp, and its 128 threads an exact multiple of them (at D 96 a tile's last 6 tokens had no thread)
FUSED_HEAD_DIMS = (32, 64, 128, 256)
MAX_ROWS = 8
TILE = 256  # tokens per tile: 32 lanes x 8 tokens
THREADS = 128  # 4 warps
COMBINE_THREADS = 256  # a (row, query row) of the combine: at least D (<= 256) threads


class PackedSide(NamedTuple):
    """One side (keys or values) of a KIVI cache as attention sees it.

    packed: (codes, scales, zeros) or None. Keys: K^T codes [B, H, D, >= n*kb/32], scales/zeros
    [B, H, D, >= n/G]. Values: codes [B, H, >= n, D*vb/32], scales/zeros [B, H, >= n, D/G]. Arrays
    may hold spare capacity past the first n tokens.
    n_packed: tokens held as codes (the first n_packed positions).
    residual: [B, H, T - n_packed, D] full precision, the positions after the codes.
    """

    packed: tuple | None
    n_packed: int
    residual: mx.array

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype attention sees (the residual's): Phi-2 casts its attention output to it."""
        return self.residual.dtype


# The used part of arrays with spare capacity is copied: quantized_matmul on CUDA has no
# implementation for strided weights ("No implementation for problem shape"), measured on the H200.


def used_keys(side: PackedSide, bits: int, group_size: int):
    """The key codes of the first n_packed tokens, contiguous."""
    codes, scales, zeros = side.packed
    n = side.n_packed
    if codes.shape[-1] * 32 // bits == n:
        return codes, scales, zeros
    G = group_size
    return tuple(mx.contiguous(a) for a in (codes[..., : n * bits // 32], scales[..., : n // G], zeros[..., : n // G]))


def used_values(side: PackedSide, contiguous: bool = True):
    """The value codes of the first n_packed tokens: a contiguous copy, or views with
    contiguous=False (CPU: MLX's CPU quantized_matmul reads the strided rows, and a decode step
    then does not copy every value code)."""
    codes, scales, zeros = side.packed
    n = side.n_packed
    if codes.shape[-2] == n:
        return codes, scales, zeros
    used = tuple(a[..., :n, :] for a in (codes, scales, zeros))
    return tuple(mx.contiguous(a) for a in used) if contiguous else used


def decode_attention_reference(queries, keys: PackedSide, values: PackedSide, scale: float, mask,
                               key_bits: int, value_bits: int, group_size: int) -> mx.array:
    """Attention straight on the codes with `mx.quantized_matmul` (MLX ops only; any rows, any mask).

    queries [B, H_q, L, D] post-RoPE; returns [B, H_q, L, D]. GQA: the query group is folded into
    the row axis (query head h uses KV head h // rep), which is exact on CPU and CUDA alike (the
    broadcast-over-an-inserted-axis form of quantized_matmul is wrong on CUDA)."""
    B, n_q, L, D = queries.shape
    n_kv = keys.residual.shape[1]
    rep = n_q // n_kv
    G = group_size
    q = (queries * scale).reshape(B, n_kv, rep * L, D)
    scores = []
    if keys.n_packed:
        scores.append(mx.quantized_matmul(q, *used_keys(keys, key_bits, G), transpose=False, group_size=G, bits=key_bits))
    if keys.residual.shape[2]:
        scores.append(q @ keys.residual.swapaxes(-1, -2))
    scores = mx.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
    T = scores.shape[-1]
    scores = scores.reshape(B, n_q, L, T)
    if isinstance(mask, str):  # "causal", bottom-right aligned
        mask = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    probs = mx.softmax(scores, axis=-1, precise=True).reshape(B, n_kv, rep * L, T)
    n_v = values.n_packed
    out = None
    if values.residual.shape[2]:
        out = probs[..., n_v:] @ values.residual
    if n_v:
        rows = used_values(values, contiguous=mx.default_device() != mx.cpu)
        packed = mx.quantized_matmul(probs[..., :n_v], *rows, transpose=False, group_size=G, bits=value_bits)
        out = packed if out is None else out + packed
    return out.reshape(B, n_q, L, D)


# The end of a flash-decoding block, this kernel's and TurboQuant's (turboquant_attention.py): the
# warps' partial sums of the block's output rows meet in shared memory, in warp order, then the block
# writes its partial output [M, D] and each row's running max and sum for the combine kernel.
BLOCK_PARTIAL_STORE = """\
    for (int w = 0; w < NW; ++w) {
        if (warp == w && lane < CG) {
            KV_UNROLL for (int m = 0; m < M; ++m) {
                KV_UNROLL for (int j = 0; j < 8; ++j) {
                    const int idx = m * D + c0 + j;
                    sc[idx] = (w == 0 ? 0.0f : sc[idx]) + acc[m][j];
                }
            }
        }
        KV_BARRIER();
    }
    const long out_base = ((long)bh * nb + blk) * M;
    for (int i = tid; i < M * D; i += NT) o_part[out_base * D + i] = sc[i];
    if (tid < M) {
        stats[(out_base + tid) * 2] = run_max[tid];
        stats[(out_base + tid) * 2 + 1] = run_sum[tid];
    }
"""

# ---------------------------------------------------------------------------------------------
# Fused kernel. Template constants: T (dtype of q, scales, zeros, residuals), KB, VB, G, D, M
# (rows per KV head), L (query positions; rows are rep-major, row m is position m % L), CAUSAL.
# dims: [T_total, n_k (key codes), n_v (value codes), tiles_per_block, key words per channel row,
# key groups per channel row, value capacity rows, blocks per (batch, head) row, rows, t_begin (this
# kernel's first token: the tokens before it are kivi_attention_mma's), that kernel's blocks per row,
# and its steps per warp].

_ATTN_BODY = """
    constexpr int NW = NT / 32;
    constexpr int TILE = 256;
    constexpr int DW = D / NW;
    constexpr int DCH = DW < 8 ? DW : 8;
    constexpr int CG = D / 8;
    constexpr int TL = NT / CG;
    constexpr int TPL = TILE / TL;
    constexpr unsigned int KMASK = (1u << KB) - 1u;
    constexpr unsigned int VMASK = (1u << VB) - 1u;
    constexpr int VWROW = D * VB / 32;
    constexpr int VGROW = D / G;
    const int T_total = dims[0];
    const int nk = dims[1];
    const int nv = dims[2];
    const int tiles_per_block = dims[3];
    const int kwrow = dims[4];
    const int kgrow = dims[5];
    const int vcap = dims[6];
    const int nb = dims[7];
    const int t_begin = dims[9];
    const int trk = T_total - nk;
    const int trv = T_total - nv;
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int cg = tid % CG;
    const int tl = tid / CG;
    const int c0 = cg * 8;

    // one value token of codes into the outputs: tile token TK (its probabilities' column in sc), code
    // words W0 (W1: 8-bit codes' second word), scale SV and zero ZV of this thread's 8 channels:
    // out_c += (p s) c + p z, the p z term summed apart (zacc)
#define ADD_CODED_TOKEN(TK, W0, W1, SV, ZV) do { \
        const int pos_ = ((TK) % 8) * 32 + (TK) / 8; \
        float ps_[M]; \
        KV_UNROLL for (int m = 0; m < M; ++m) { \
            const float p_ = sc[m * TILE + pos_]; \
            ps_[m] = p_ * (SV); \
            zacc[m] += p_ * (ZV); \
        } \
        KV_UNROLL for (int j = 0; j < 8; ++j) { \
            const int bit = j * VB; \
            const unsigned int code = ((bit < 32) ? ((W0) >> (vsh + bit)) : ((W1) >> (bit - 32))) & VMASK; \
            const float cf = CODE_TO_FLOAT(code); \
            KV_UNROLL for (int m = 0; m < M; ++m) acc[m][j] += ps_[m] * cf; \
        } \
    } while (0)

    KV_SHARED float qs[D * M];
    KV_SHARED float sc[NW * M * TILE];  // partial scores, then probabilities (slice 0), then the output reduction
    KV_SHARED float run_max[M];
    KV_SHARED float run_sum[M];
    KV_SHARED float corr[M];

    const float qscale = params[0];
    for (int i = tid; i < D * M; i += NT) {
        const int m = i % M;
        const int d = i / M;
        qs[i] = static_cast<float>(q[((long)bh * M + m) * D + d]) * qscale;
    }
    if (tid < M) {
        run_max[tid] = NEG_INF;
        run_sum[tid] = 0.0f;
    }
    float acc[M][8];
    float zacc[M];
    KV_UNROLL for (int m = 0; m < M; ++m) {
        zacc[m] = 0.0f;
        KV_UNROLL for (int j = 0; j < 8; ++j) acc[m][j] = 0.0f;
    }
    KV_BARRIER();

    const int tile0 = blk * tiles_per_block;
    for (int tile = tile0; tile < tile0 + tiles_per_block; ++tile) {
        const int start = t_begin + tile * TILE;
        if (start >= T_total) break;

        // ---- scores of this tile: lane owns tokens t0..t0+7, warp owns channels [warp*DW, +DW)
        float s[M][8];
        KV_UNROLL for (int m = 0; m < M; ++m) {
            KV_UNROLL for (int j = 0; j < 8; ++j) s[m][j] = 0.0f;
        }
        const int t0 = start + lane * 8;
        if (t0 + 8 <= nk) {
            const int g = t0 / G;
            const int sh = (t0 * KB) % 32;
            // this warp's first channel row; rows of one (batch, head) are kwrow words apart
            const long row0 = (long)bh * D + warp * DW;
            const KV_DEVICE unsigned int* kcp = kc + row0 * kwrow + (t0 * KB) / 32;
            const KV_DEVICE T* ksp = ks + row0 * kgrow + g;
            const KV_DEVICE T* kzp = kz + row0 * kgrow + g;
            float zs[M];
            KV_UNROLL for (int m = 0; m < M; ++m) zs[m] = 0.0f;
            // channels DCH at a time: their loads are in flight together, and registers stay bounded
            KV_NO_UNROLL for (int d0 = 0; d0 < DW; d0 += DCH) {
                KV_UNROLL for (int dd = d0; dd < d0 + DCH; ++dd) {
                    const int d = warp * DW + dd;
                    const unsigned int w0 = kcp[dd * kwrow];
                    const unsigned int w1 = (KB == 8) ? kcp[dd * kwrow + 1] : 0u;
                    const float sk = static_cast<float>(ksp[dd * kgrow]);
                    const float zk = static_cast<float>(kzp[dd * kgrow]);
                    float a[M];
                    KV_UNROLL for (int m = 0; m < M; ++m) {
                        const float qv = qs[d * M + m];
                        a[m] = qv * sk;
                        zs[m] += qv * zk;
                    }
                    KV_UNROLL for (int j = 0; j < 8; ++j) {
                        const int bit = j * KB;
                        const unsigned int code = ((bit < 32) ? (w0 >> (sh + bit)) : (w1 >> (bit - 32))) & KMASK;
                        const float cf = CODE_TO_FLOAT(code);
                        KV_UNROLL for (int m = 0; m < M; ++m) s[m][j] += a[m] * cf;
                    }
                }
            }
            KV_UNROLL for (int m = 0; m < M; ++m) {
                KV_UNROLL for (int j = 0; j < 8; ++j) s[m][j] += zs[m];
            }
        } else if (t0 < T_total) {
            // residual keys (nk % 8 == 0: all 8 tokens of the lane are residual or past the end): DCH
            // channels of the 8 tokens loaded before any is used, so the tile waits DW / DCH memory
            // latencies, not one per token and channel (which made a residual tile the launch's longest)
            KV_NO_UNROLL for (int d0 = 0; d0 < DW; d0 += DCH) {
                float kv[8][DCH];
                KV_UNROLL for (int j = 0; j < 8; ++j) {
                    const int t = min(t0 + j, T_total - 1);  // past the end: a real row, masked by the softmax
                    const long base = ((long)bh * trk + (t - nk)) * D + warp * DW + d0;
                    KV_UNROLL for (int dd = 0; dd < DCH; ++dd) kv[j][dd] = static_cast<float>(kr[base + dd]);
                }
                KV_UNROLL for (int dd = 0; dd < DCH; ++dd) {
                    const int d = warp * DW + d0 + dd;
                    KV_UNROLL for (int m = 0; m < M; ++m) {
                        const float qv = qs[d * M + m];
                        KV_UNROLL for (int j = 0; j < 8; ++j) s[m][j] += qv * kv[j][dd];
                    }
                }
            }
        }
        // each warp leaves its partial scores in its own slice (one barrier, not one per warp); the
        // softmax adds the slices in warp order. Token lane*8+j of row m, warp w: sc[(w*M + m)*TILE + j*32 + lane]
        KV_UNROLL for (int m = 0; m < M; ++m) {
            KV_UNROLL for (int j = 0; j < 8; ++j) sc[(warp * M + m) * TILE + j * 32 + lane] = s[m][j];
        }
        KV_BARRIER();

        // ---- online softmax: warp w owns rows w, w + NW, ...
        for (int m = warp; m < M; m += NW) {
            const int last = CAUSAL ? T_total - L + (m % L) : T_total - 1;
            float v[8];
            float tile_max = NEG_INF;
            KV_UNROLL for (int j = 0; j < 8; ++j) {
                const int t = start + lane * 8 + j;
                float x = 0.0f;
                for (int w = 0; w < NW; ++w) x += sc[(w * M + m) * TILE + j * 32 + lane];
                v[j] = (t <= last) ? x : NEG_INF;
                tile_max = FMAX(tile_max, v[j]);
            }
            for (int off = 16; off > 0; off /= 2) tile_max = FMAX(tile_max, SHFL_XOR(tile_max, off));
            const float old_max = run_max[m];
            const float new_max = FMAX(old_max, tile_max);
            float tile_sum = 0.0f;
            KV_UNROLL for (int j = 0; j < 8; ++j) {
                const float p = (v[j] == NEG_INF) ? 0.0f : EXP2(v[j] - new_max);
                sc[m * TILE + j * 32 + lane] = p;
                tile_sum += p;
            }
            for (int off = 16; off > 0; off /= 2) tile_sum += SHFL_XOR(tile_sum, off);
            if (lane == 0) {
                const float c = (old_max == NEG_INF) ? 0.0f : EXP2(old_max - new_max);
                corr[m] = c;
                run_sum[m] = run_sum[m] * c + tile_sum;
                run_max[m] = new_max;
            }
        }
        KV_BARRIER();

        // ---- values: thread owns channels c0..c0+7 and tokens tl*TPL .. tl*TPL+TPL-1 of the tile
        KV_UNROLL for (int m = 0; m < M; ++m) {
            const float c = corr[m];
            zacc[m] *= c;
            KV_UNROLL for (int j = 0; j < 8; ++j) acc[m][j] *= c;
        }
        const int vt0 = start + tl * TPL;
        const int vwi = (c0 * VB) / 32;
        const int vsh = (c0 * VB) % 32;
        if (vt0 + TPL <= nv) {
            // all of this thread's tokens are codes: load 8 tokens' words, scales and zeros before
            // using any, so the loads are in flight together instead of one latency per token
            const long row0 = (long)bh * vcap + vt0;
            KV_UNROLL for (int i0 = 0; i0 < TPL; i0 += 8) {
                unsigned int cw0[8];
                unsigned int cw1[8];
                float sv[8];
                float zv[8];
                KV_UNROLL for (int i = 0; i < 8; ++i) {
                    const long row = row0 + i0 + i;
                    cw0[i] = vc[row * VWROW + vwi];
                    cw1[i] = (VB == 8) ? vc[row * VWROW + vwi + 1] : 0u;
                    sv[i] = static_cast<float>(vs[row * VGROW + c0 / G]);
                    zv[i] = static_cast<float>(vz[row * VGROW + c0 / G]);
                }
                KV_UNROLL for (int i = 0; i < 8; ++i) ADD_CODED_TOKEN(tl * TPL + i0 + i, cw0[i], cw1[i], sv[i], zv[i]);
            }
        } else {  // a tile with residual tokens or the cache's end: codes, then residual values, 4 tokens
            // at a time with their loads first (token by token, the tile waited a memory latency per token)
            const int c_end = min(vt0 + TPL, nv);
            KV_NO_UNROLL for (int t = vt0; t < c_end; t += 4) {
                unsigned int w0[4], w1[4];
                float sv[4], zv[4];
                KV_UNROLL for (int i = 0; i < 4; ++i) {
                    const long row = (long)bh * vcap + min(t + i, c_end - 1);
                    w0[i] = vc[row * VWROW + vwi];
                    w1[i] = (VB == 8) ? vc[row * VWROW + vwi + 1] : 0u;
                    sv[i] = static_cast<float>(vs[row * VGROW + c0 / G]);
                    zv[i] = static_cast<float>(vz[row * VGROW + c0 / G]);
                }
                KV_UNROLL for (int i = 0; i < 4; ++i) {
                    if (t + i < c_end) ADD_CODED_TOKEN(t + i - start, w0[i], w1[i], sv[i], zv[i]);
                }
            }
            const int r_end = min(vt0 + TPL, T_total);
            KV_NO_UNROLL for (int t = max(vt0, nv); t < r_end; t += 4) {
                float x[4][8];
                KV_UNROLL for (int i = 0; i < 4; ++i) {
                    const long base = ((long)bh * trv + (min(t + i, r_end - 1) - nv)) * D + c0;
                    KV_UNROLL for (int j = 0; j < 8; ++j) x[i][j] = static_cast<float>(vr[base + j]);
                }
                KV_UNROLL for (int i = 0; i < 4; ++i) {
                    if (t + i < r_end) {
                        const int tk = t + i - start;
                        const int pos = (tk % 8) * 32 + tk / 8;
                        KV_UNROLL for (int m = 0; m < M; ++m) {
                            const float p = sc[m * TILE + pos];
                            KV_UNROLL for (int j = 0; j < 8; ++j) acc[m][j] += p * x[i][j];
                        }
                    }
                }
            }
        }
        KV_BARRIER();
    }

    // ---- reduce the token lanes: inside a warp by shuffles, across warps in turn through shared memory
    KV_UNROLL for (int m = 0; m < M; ++m) {
        float z = zacc[m];
        for (int off = CG; off < 32; off *= 2) z += SHFL_XOR(z, off);
        KV_UNROLL for (int j = 0; j < 8; ++j) {
            float x = acc[m][j];
            for (int off = CG; off < 32; off *= 2) x += SHFL_XOR(x, off);
            acc[m][j] = x + z;
        }
    }
""" + BLOCK_PARTIAL_STORE

# Combine the blocks of each (batch, head) row, this kernel's and the tensor-core kernel's
# (kivi_attention_mma.py, dims[10] blocks a row; none where it did not run): one block of CT threads per
# (row, query row). The partials are read in parallel: thread t owns channels 4 (t % (D/4)) .. +3 of every
# (CT / (D/4))-th partial, and the slots meet in shared memory once. (One thread per output element
# looping over every partial, as before, waited one memory latency per partial, twice: 25 us of a 32k
# layer's ~80 on the H200 with 33 partials, Nsight Compute.)
_COMBINE_BODY = """
    constexpr int QUADS = D / 4;  // threads across the channels, 4 channels each
    constexpr int SLOTS = CT / QUADS;  // partials read at once
    constexpr int NW = CT / 32;
    static_assert(CT % QUADS == 0 && D <= CT, "the combine's threads: whole slots, a thread per channel");
    KV_SHARED float warp_max[NW];
    KV_SHARED float warp_sum[NW];
    KV_SHARED float slot_out[SLOTS * D];
    const int nb = dims[7];
    const int nbm = dims[10];
    const int n = nb + nbm;
    const long bh = row / M;
    const int m = row % M;
    const int lane = tid % 32;
    const int warp = tid / 32;
    // partial c: this kernel's blocks [0, nb), then the tensor-core kernel's
#define PARTIAL_INDEX(c) ((c) < nb ? (bh * nb + (c)) * M + m : (bh * nbm + (c) - nb) * M + m)
#define PARTIAL_STATS(c) ((c) < nb ? stats : st_mma)
#define PARTIAL_OUT(c) ((c) < nb ? o_part : o_mma)
    float top = NEG_INF;
    for (int c = tid; c < n; c += CT) {
        top = FMAX(top, PARTIAL_STATS(c)[PARTIAL_INDEX(c) * 2]);
    }
    KV_UNROLL for (int s = 16; s >= 1; s /= 2) top = FMAX(top, SHFL_XOR(top, s));
    if (lane == 0) warp_max[warp] = top;
    KV_BARRIER();
    float gmax = warp_max[0];
    KV_UNROLL for (int w = 1; w < NW; ++w) gmax = FMAX(gmax, warp_max[w]);
    float den = 0.0f;
    for (int c = tid; c < n; c += CT) {
        const long i = PARTIAL_INDEX(c);
        const float mc = PARTIAL_STATS(c)[i * 2];
        den += mc == NEG_INF ? 0.0f : EXP2(mc - gmax) * PARTIAL_STATS(c)[i * 2 + 1];
    }
    KV_UNROLL for (int s = 16; s >= 1; s /= 2) den += SHFL_XOR(den, s);
    if (lane == 0) warp_sum[warp] = den;
    const int d = 4 * (tid % QUADS);
    const int slot = tid / QUADS;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    #pragma unroll 4
    for (int c = slot; c < n; c += SLOTS) {  // independent loads: several in flight per thread
        const long i = PARTIAL_INDEX(c);
        const float mc = PARTIAL_STATS(c)[i * 2];
        const KV_DEVICE float* part = PARTIAL_OUT(c) + i * D + d;
        const float w = EXP2(mc - gmax);
        KV_UNROLL for (int j = 0; j < 4; ++j) acc[j] += mc == NEG_INF ? 0.0f : w * part[j];
    }
    KV_UNROLL for (int j = 0; j < 4; ++j) slot_out[slot * D + d + j] = acc[j];
#undef PARTIAL_INDEX
#undef PARTIAL_STATS
#undef PARTIAL_OUT
    KV_BARRIER();
    if (tid < D) {
        float total_den = 0.0f;
        KV_UNROLL for (int w = 0; w < NW; ++w) total_den += warp_sum[w];
        float num = 0.0f;
        KV_UNROLL for (int s = 0; s < SLOTS; ++s) num += slot_out[s * D + tid];
        out[row * D + tid] = static_cast<T>(num / total_den);
    }
"""

CUDA_HEADER = """
#define KV_SHARED __shared__
#define KV_BARRIER() __syncthreads()
#define SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define EXP2 exp2f
#define FMAX fmaxf
#define NEG_INF (-__int_as_float(0x7f800000))
#define KV_UNROLL _Pragma("unroll")
#define KV_NO_UNROLL _Pragma("unroll 1")
#define KV_DEVICE
// an integer below 2^23 as float without a conversion instruction (I2F issues at a fraction of the
// FMA rate): OR it into the mantissa of 2^23, then subtract 2^23; exact
#define CODE_TO_FLOAT(u) (__uint_as_float(0x4B000000u | (u)) - 8388608.0f)
"""
CUDA_ATTN_SOURCE = "const int tid = threadIdx.x; const int blk = blockIdx.x; const long bh = blockIdx.y;\n" + _ATTN_BODY
_CUDA_ATTN_BODY = CUDA_ATTN_SOURCE.split("\n", 1)[1]  # without its first line (tid, blk, bh): for the one launch
CUDA_COMBINE_SOURCE = "const int tid = threadIdx.x; const long row = blockIdx.x;\n" + _COMBINE_BODY

# Metal: simdgroups of 32 threads stand in for warps; the body is the CUDA one, only these macros
# differ. Never run on an Apple GPU: emulated on the CPU (tests/test_metal_on_cpu.py), and the dispatch
# self-tests it on first use and falls back to the reference if it fails.
METAL_HEADER = """
#define KV_SHARED threadgroup
#define KV_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define SHFL_XOR(v, m) simd_shuffle_xor((v), (ushort)(m))
#define EXP2 metal::exp2
#define FMAX metal::fmax
#define NEG_INF (-INFINITY)
#define KV_UNROLL _Pragma("clang loop unroll(full)")
#define KV_NO_UNROLL _Pragma("clang loop unroll(disable)")
#define KV_DEVICE device
#define CODE_TO_FLOAT(u) (as_type<float>(0x4B000000u | (u)) - 8388608.0f)
"""
METAL_ATTN_SOURCE = (
    "const int tid = (int)thread_position_in_threadgroup.x; const int blk = (int)threadgroup_position_in_grid.x;"
    " const long bh = (long)threadgroup_position_in_grid.y;\n" + _ATTN_BODY
)
METAL_COMBINE_SOURCE = ("const int tid = (int)thread_position_in_threadgroup.x;"
                        " const long row = (long)threadgroup_position_in_grid.x;\n" + _COMBINE_BODY)


def scalar_shared_bytes(D: int, M: int) -> int:
    """Static shared memory of the scalar kernel's blocks (_ATTN_BODY: the queries, a tile's scores
    per warp, three row statistics), which the tensor-core kernel's one launch declares too."""
    return 4 * (D * M + THREADS // 32 * M * TILE + 3 * M)


_ATTN_INPUTS = ["q", "kc", "ks", "kz", "kr", "vc", "vs", "vz", "vr", "dims", "params"]
_kernels = dispatch.kernel_cache()


def _kernel(which: str, backend: str):
    key = (which, backend)
    if key not in _kernels:
        if which == "attn":
            name, inputs, outputs = "kivi_decode_attention", _ATTN_INPUTS, ["o_part", "stats"]
            source = CUDA_ATTN_SOURCE if backend == "cuda" else METAL_ATTN_SOURCE
        else:
            name, inputs, outputs = "kivi_decode_combine", ["o_part", "stats", "o_mma", "st_mma", "dims"], ["out"]
            source = CUDA_COMBINE_SOURCE if backend == "cuda" else METAL_COMBINE_SOURCE
        header = CUDA_HEADER if backend == "cuda" else METAL_HEADER
        _kernels[key] = dispatch.fast_kernel(backend, name, source, header, inputs, outputs)
    return _kernels[key]


def default_tiles_per_block(n_tiles: int, rows: int) -> int:
    """About 256+ blocks (two per SM of an H200): 4 tiles per block at 32k x 8 heads, the fastest
    of 1/2/4/8 measured there; fewer partial outputs to combine."""
    return max(1, (n_tiles * rows) // 256)


_params_cache: dict[float, mx.array] = {}


def _params(scale: float) -> mx.array:
    # one small array per softmax scale, not one per call (decode calls this per layer per step)
    if scale not in _params_cache:
        _params_cache[scale] = mx.array([scale * math.log2(math.e)], dtype=mx.float32)
    return _params_cache[scale]


# Tokens of codes from which 2-bit caches take the tensor-core kernel by default. Measured on the H200
# with each layer waiting for the one before, as in a model (docs/learned.md; us a layer,
# 8 KV heads x 4 rows, D 128): 8k / 16k / 32k / 128k tokens, this module's kernel 71.4 / 81.0 / 130.7 /
# 301.9, tensor cores (4 steps a warp) 85.1 / 90.4 / 116.3 / 226.5. The switch lies between 16k and 32k
# (the tensor-core kernel's share of those caches: 16256 and 32640 tokens, the values' residual below
# it); the threshold is halfway, where nothing was measured.
TENSOR_CORE_MIN_TOKENS = 24576


def tensor_cores_by_default(key_bits: int, value_bits: int, n_covered: int) -> bool:
    """Whether decode_attention_fused uses the tensor-core kernel where it covers a call
    (tensor_cores=None): 2-bit keys and values, with at least TENSOR_CORE_MIN_TOKENS tokens for it
    (n_covered: the packed tokens it would take).
    4-bit codes stay here (32k: 122.8 us a layer against the tensor cores' 136.7, same measurement)."""
    return key_bits == 2 and value_bits == 2 and n_covered >= TENSOR_CORE_MIN_TOKENS


_stand_ins: dict[tuple, mx.array] = {}


def _stand_in(dtype) -> mx.array:
    """A small array for an absent input (a side without codes or residual) or the partials of a kernel
    that did not run: one per dtype and device, not a new array per layer and step. Never read, but
    of METAL_CONSTANT_BELOW elements: smaller, Metal gets it as a constant pointer, which the bodies'
    device pointers (`c < nb ? o_part : o_mma`, `const device uint* row = kc + ...`) cannot take."""
    key = (dtype, mx.default_device().type)  # not their str() (0.8 us): this runs up to 4 times a layer and step
    if key not in _stand_ins:
        _stand_ins[key] = mx.zeros((dispatch.METAL_CONSTANT_BELOW,), dtype=dtype)
    return _stand_ins[key]


def metal_fits(D: int, M: int) -> bool:
    """Whether the scalar kernel's threadgroup arrays fit a Metal threadgroup (32 KiB): not at 8 query
    rows a KV head (D 32 to 256), nor at 7 with D 256; CUDA's 48 KiB take every supported shape."""
    return scalar_shared_bytes(D, M) <= dispatch.METAL_THREADGROUP_MEMORY


def tensor_cores_cover(queries, keys: PackedSide, values: PackedSide, key_bits: int, value_bits: int,
                       group_size: int, backend: str) -> bool:
    """Whether kivi_attention_mma can take this call's packed tokens (CUDA, its dtypes, bits, shapes and
    shared memory, code arrays laid out in whole steps)."""
    B, n_q, L, D = queries.shape
    M = n_q // keys.residual.shape[1] * L
    kwrow, kgrow = (keys.packed[0].shape[-1], keys.packed[1].shape[-1]) if keys.n_packed else (0, 0)
    vcap = values.packed[0].shape[-2] if values.n_packed else 0
    launch = _launch(queries.dtype, key_bits, value_bits, group_size, D, M, L, False, backend, 0, THREADS)
    return _tensor_cores_cover(launch, kwrow, kgrow, vcap, D, group_size)


def _tensor_cores_cover(launch: "_Launch", kwrow: int, kgrow: int, vcap: int, D: int, group_size: int) -> bool:
    # the same, from the code arrays' row lengths decode_attention_fused has already read
    return launch.tensor_cores_fit and kivi_attention_mma.aligned(kwrow, kgrow, vcap, D // group_size, group_size,
                                                                  launch.step_tokens)


class _Launch(NamedTuple):
    """What every decode call of one signature launches alike (made once per signature by `_launch`:
    a decode step calls the kernels per layer, and each Python line costs host time there)."""

    template: list  # the scalar kernel's
    mma_template: list  # the tensor-core kernel's
    header: str
    step_tokens: int  # the tensor-core kernel's tokens a step
    tensor_cores_fit: bool  # CUDA, and kivi_attention_mma.supported: its dtype, bits, shapes and shared memory
    combine: dict  # the combine kernel's keyword arguments but its inputs


@functools.lru_cache(maxsize=1024)
def _launch(dtype, key_bits: int, value_bits: int, group_size: int, D: int, M: int, L: int, causal: bool,
            backend: str, l2_prefetch: int, threads: int) -> _Launch:
    # threads: THREADS, an argument so that a benchmark that sets another (kernel_scaling.py) gets its own
    template = [("T", dtype), ("KB", key_bits), ("VB", value_bits), ("G", group_size), ("D", D), ("M", M),
                ("L", L), ("CAUSAL", causal), ("NT", threads)]
    step_tokens = kivi_attention_mma.step_tokens(key_bits, value_bits)
    fit = backend == "cuda" and kivi_attention_mma.supported(dtype, D, key_bits, value_bits, group_size, M,
                                                             scalar_shared_bytes(D, M))
    combine = dict(template=[("T", dtype), ("D", D), ("M", M), ("CT", COMBINE_THREADS)],
                   threadgroup=(COMBINE_THREADS, 1, 1), output_dtypes=[dtype])
    return _Launch(template, template + [("ST", step_tokens), ("PF", l2_prefetch)],
                   CUDA_HEADER if backend == "cuda" else METAL_HEADER, step_tokens, fit, combine)


def decode_attention_fused(queries, keys: PackedSide, values: PackedSide, scale: float, causal: bool,
                           key_bits: int, value_bits: int, group_size: int, backend: str = "cuda",
                           tiles_per_block: int | None = None, tensor_cores: bool | None = None,
                           steps_per_warp: int | None = None, one_launch: bool = True,
                           l2_prefetch: int = 0) -> mx.array:
    """The fused kernels; same contract as `decode_attention_reference` for supported inputs.

    tensor_cores (CUDA, where kivi_attention_mma covers the call: fp16, 2/4-bit codes, D 64/128, the
    shared memory fits): the tensor-core kernel takes the packed tokens [0, n_full) and this module's
    kernel the rest (residuals, the causal band, a part step); one combine merges their partials.
    None: `tensor_cores_by_default` (2-bit codes, 24k+ tokens); True where it does not cover the call: ValueError.
    one_launch: both kernels' blocks in one launch (default; measured faster at 8k and 32k) or two.
    l2_prefetch (0, 64, 128, 256): the tensor-core kernel's key copies ask the L2 for that many bytes
    around each (a channel row is read 16 bytes a step); 0, the measured default, asks nothing."""
    if l2_prefetch not in (0, 64, 128, 256):
        raise ValueError(f"l2_prefetch: expected 0, 64, 128 or 256, got {l2_prefetch}")
    B, n_q, L, D = queries.shape
    n_kv = keys.residual.shape[1]
    M = n_q // n_kv * L
    if backend == "metal" and not metal_fits(D, M):
        raise ValueError(f"the Metal kernel takes at most {dispatch.METAL_THREADGROUP_MEMORY} bytes of threadgroup "
                         f"memory: {scalar_shared_bytes(D, M)} at D {D}, {M} query rows a KV head")
    dtype = queries.dtype
    rows = B * n_kv
    T = keys.n_packed + keys.residual.shape[2]
    launch = _launch(dtype, key_bits, value_bits, group_size, D, M, L, causal, backend, l2_prefetch, THREADS)
    dummy = _stand_in

    if keys.n_packed:
        kc, ks, kz = keys.packed
        kwrow, kgrow = kc.shape[-1], ks.shape[-1]
    else:
        kc, ks, kz, kwrow, kgrow = dummy(mx.uint32), dummy(dtype), dummy(dtype), 0, 0
    if values.n_packed:
        vc, vs, vz = values.packed
        vcap = vc.shape[-2]
    else:
        vc, vs, vz, vcap = dummy(mx.uint32), dummy(dtype), dummy(dtype), 0
    n_full = 0
    covered = _tensor_cores_cover(launch, kwrow, kgrow, vcap, D, group_size)
    if covered:
        n_full = kivi_attention_mma.tokens_covered(keys.n_packed, values.n_packed, T, L, causal)
    if tensor_cores is None:
        tensor_cores = covered and tensor_cores_by_default(key_bits, value_bits, n_full)
    if not tensor_cores:
        n_full = 0
    elif not covered:
        raise ValueError("tensor_cores=True: kivi_attention_mma does not cover this call")
    n_tiles = -(-(T - n_full) // TILE)
    tpb = tiles_per_block or default_tiles_per_block(n_tiles, rows)
    nb = -(-n_tiles // tpb)
    steps = n_full // launch.step_tokens
    spw = steps_per_warp or kivi_attention_mma.STEPS_PER_WARP
    nbm = -(-steps // (spw * kivi_attention_mma.WARPS)) if steps else 0
    kr = keys.residual if keys.residual.shape[2] else dummy(dtype)
    vr = values.residual if values.residual.shape[2] else dummy(dtype)
    q = queries.reshape(B, n_kv, M, D)  # rows rep-major: row m is query position m % L
    dims_values = [T, keys.n_packed, values.n_packed, tpb, kwrow, kgrow, vcap, nb, rows, n_full, nbm, spw]
    dims = mx.array(dims_values, dtype=mx.int32)
    inputs = [q, kc, ks, kz, kr, vc, vs, vz, vr, dims, _params(scale)]
    if nbm and one_launch:  # the scalar kernel's blocks and the tensor-core kernel's
        assert THREADS == kivi_attention_mma.THREADS
        o_part, stats, o_mma, st_mma = kivi_attention_mma.partials(inputs, dims_values, launch.mma_template, D, M, rows,
                                                                   launch.header, _CUDA_ATTN_BODY)
    else:
        o_mma, st_mma = dummy(mx.float32), dummy(mx.float32)
        if nbm:
            o_mma, st_mma = kivi_attention_mma.partials(inputs, dims_values, launch.mma_template, D, M, rows,
                                                        launch.header, None)
        o_part, stats = dummy(mx.float32), dummy(mx.float32)
        if nb:  # none where the tensor-core kernel took every token
            o_part, stats = _kernel("attn", backend)(
                inputs=inputs,
                template=launch.template,
                grid=(nb * THREADS, rows, 1),
                threadgroup=(THREADS, 1, 1),
                output_shapes=[(rows, nb, M, D), (rows, nb, M, 2)],
                output_dtypes=[mx.float32, mx.float32],
            )
    if stats.size < dispatch.METAL_CONSTANT_BELOW:  # a Metal constant pointer otherwise (see _stand_in)
        stats = mx.concatenate([stats.reshape(-1), mx.zeros((dispatch.METAL_CONSTANT_BELOW - stats.size,), mx.float32)])
    (out,) = _kernel("combine", backend)(
        inputs=[o_part, stats, o_mma, st_mma, dims],
        grid=(rows * M * COMBINE_THREADS, 1, 1),
        output_shapes=[(rows, M, D)],
        **launch.combine,
    )
    return out.reshape(B, n_q, L, D)


def fused_supported(queries, keys: PackedSide, values: PackedSide, mask, key_bits: int, value_bits: int) -> bool:
    """Whether the fused kernel covers this call (see module docstring)."""
    B, n_q, L, D = queries.shape
    n_kv = keys.residual.shape[1]
    dtypes = {queries.dtype, keys.residual.dtype, values.residual.dtype}
    if keys.packed is not None:
        dtypes.add(keys.packed[1].dtype)
    if values.packed is not None:
        dtypes.add(values.packed[1].dtype)
    return (
        key_bits in FUSED_BITS and value_bits in FUSED_BITS
        and D in FUSED_HEAD_DIMS
        and n_q // n_kv * L <= MAX_ROWS
        and (mask is None or (isinstance(mask, str) and mask == "causal"))
        and len(dtypes) == 1 and queries.dtype in (mx.float16, mx.bfloat16, mx.float32)
        and keys.n_packed % 8 == 0
        and (keys.n_packed > 0 or values.n_packed > 0)
    )


def random_case(key_bits: int, value_bits: int, group_size: int, D: int, M: int, L: int, dtype, seed: int = 0,
                T: int = 700, n_k: int = 640, n_v: int = 572, heads: int = 2):
    """A random decode problem with codes from the reference quantizer: (queries, keys, values).

    Used by the self-test, the tests and the benchmark; the defaults span three tiles, a boundary
    inside a tile for both sides, and value codes fewer than key codes (the paper's policy)."""
    from .kivi_quant import quantize_pack_reference

    rep = M // L
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    k = mx.random.normal((1, heads, T, D), key=k1).astype(dtype)
    v = mx.random.normal((1, heads, T, D), key=k2).astype(dtype)
    q = mx.random.normal((1, heads * rep, L, D), key=k3).astype(dtype)
    kp = quantize_pack_reference(k[:, :, :n_k], key_bits, group_size, per_channel=True) if n_k else None
    vp = quantize_pack_reference(v[:, :, :n_v], value_bits, group_size, per_channel=False) if n_v else None
    return q, PackedSide(kp, n_k, k[:, :, n_k:]), PackedSide(vp, n_v, v[:, :, n_v:])


# float32 accumulation everywhere; the gap to the reference is the reference's own rounding
_SELFTEST_TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}


def selftest(backend: str, dtype, variant: tuple) -> None:
    key_bits, value_bits, group_size, D, M, L, causal = variant
    q, keys, values = random_case(key_bits, value_bits, group_size, D, M, L, dtype, seed=1)
    mask = "causal" if causal else None
    if backend == "cpu":
        got = decode_attention_cpu(q, keys, values, D**-0.5, causal, key_bits, value_bits, group_size)
    else:
        got = decode_attention_fused(q, keys, values, D**-0.5, causal, key_bits, value_bits, group_size, backend,
                                     tiles_per_block=2, tensor_cores=False)
    with mx.stream(mx.cpu):  # float32 on the CPU: a GPU matmul may round through TF32
        want = decode_attention_reference(q.astype(mx.float32), _as_f32(keys), _as_f32(values), D**-0.5, mask,
                                          key_bits, value_bits, group_size)
        mx.eval(want)
    dispatch.assert_close(got, want, _SELFTEST_TOLERANCE[dtype], "kivi_decode_attention self-test")
    # long caches of 2-bit codes run the tensor-core kernel (tensor_cores_by_default): check it too, on
    # this short case, wherever it covers the variant
    if key_bits == value_bits == 2 and tensor_cores_cover(q, keys, values, 2, 2, group_size, backend):
        got = decode_attention_fused(q, keys, values, D**-0.5, causal, 2, 2, group_size, backend, tensor_cores=True)
        dispatch.assert_close(got, want, _SELFTEST_TOLERANCE[dtype], "kivi_decode_attention self-test (tensor cores)")


def _as_f32(side: PackedSide) -> PackedSide:
    packed = None if side.packed is None else (side.packed[0], *(a.astype(mx.float32) for a in side.packed[1:]))
    return PackedSide(packed, side.n_packed, side.residual.astype(mx.float32))


def decode_attention(queries, keys: PackedSide, values: PackedSide, scale: float, mask,
                     key_bits: int, value_bits: int, group_size: int) -> mx.array:
    """KIVI attention on codes: the fused kernel where it applies and passes its self-test, else the reference."""
    if fused_supported(queries, keys, values, mask, key_bits, value_bits):
        B, n_q, L, D = queries.shape
        M = n_q // keys.residual.shape[1] * L
        causal = mask is not None and L > 1
        variant = (key_bits, value_bits, group_size, D, M, L, causal)
        if not metal_fits(D, M) and dispatch.gpu_backend() == "metal":  # (the cheap test first: per layer and step)
            dispatch.record_reference("kivi_decode_attention", queries.dtype)
            return decode_attention_reference(queries, keys, values, scale, mask, key_bits, value_bits, group_size)
        backend = dispatch.select("kivi_decode_attention", queries.dtype, variant,
                                  lambda b: selftest(b, queries.dtype, variant),
                                  cpu=cpu_supported(queries, keys, group_size))
        if backend == "cpu":
            return decode_attention_cpu(queries, keys, values, scale, causal, key_bits, value_bits, group_size)
        if backend is not None:
            return decode_attention_fused(queries, keys, values, scale, causal, key_bits, value_bits, group_size, backend)
    else:
        dispatch.record_reference("kivi_decode_attention", queries.dtype)
    return decode_attention_reference(queries, keys, values, scale, mask, key_bits, value_bits, group_size)
