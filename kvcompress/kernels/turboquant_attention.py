"""TurboQuant decode attention on the packed codes: one fused kernel body for CUDA and Metal, the MLX
reference beside it.

The problem, per (batch, KV head) row: 1..8 query rows (a decode step's GQA group, rep * L rows
folded into one matrix, rep-major, as the cache's reference folds them) attend over the first `n`
tokens held as TurboQuant codes (kvcompress/methods/quantization/turboquant.py: per token the norm and the
Lloyd-Max codes of the rotated unit vector, packed little-endian in uint32 words; keys optionally the
1-bit QJL residual: the signs of S r packed, and ||r||). The result is the softmax-weighted sum of
the values over those tokens and the log-sum-exp of the logits per row: the cache merges in the
exact attention of the call's own fresh tokens with one log-sum-exp merge (TurboQuantCache.attention),
so the kernel needs neither a full-precision residual nor a mask (every held token precedes the
call's queries).

The math (the paper's TurboQuant_prod estimate, Zandieh et al. 2025, Algorithm 2 and Theorem 2):
the caller rotates the query once, q_rot = Pi q, and sketches it once, q_sk = S Pi q; then
    score_t = ||k_t|| ( sum_j q_rot_j c[code_tj] + sqrt(pi/2)/D ||r_t|| sum_j q_sk_j sign_tj )
    out_rot = sum_t p_t ||v_t|| c_v[vcode_t]        (the values' rotated space)
and out = out_rot Pi_v, rotated back once. The kernel never sees a rotation matrix and never
writes a dequantized copy of the cache: every code is read once, looked up in the codebook (2^b
floats in shared memory) and used in registers.

The reference is `attention_on_codes_reference`: the cache's own plain MLX path (Codec.scores and
Codec.weighted_sum, which gather the codebook entries of every held code into a [B, H, T, D]
float32 transient), a softmax and a log-sum-exp. The dispatch self-test and the tests compare the
kernel with it.

The kernel is flash-decoding (Dao et al., 2023), as kivi_attention.py's: the token axis is cut into
tiles of 128; each block takes `tiles_per_block` consecutive tiles of one row, keeps a running max
and sum per query row (online softmax, exp2 on logits pre-scaled by scale * log2(e)), and writes an
unnormalized partial output; a combine kernel merges the blocks and writes the log-sum-exp. In a tile:
- scores: the head's channels are cut into slices of 32, so a slice's codes of one token are exactly
  b whole words and its signs one word, at any code width 1..4 (a 3-bit code may straddle two words
  of the slice: it is put together from both). Warp w reads slice w % (D/32) of its tokens (D / 32
  a lane), all their words before any is used; the query values of a channel are read from
  shared memory once for all the lane's tokens. The slices' partial scores meet in shared memory.
- values: each thread owns 8 channels and every (NT / (D/8))-th token of the tile; it reads the one
  or two words that hold its 8 codes, 4 tokens' loads in flight at a time, and accumulates
  p_t ||v_t|| c_v[code] for every query row.
Accumulation is float32 throughout.

Supported (`fused_supported`): integer widths (key code bits 1..4: 2, 3, 4 bits with the QJL
residual, 2..4 without; value bits 2..4), head dims 32, 64, 128 (keys and values alike), 1..8 rows.
Fractional widths (2.5, 3.5: two codecs on two channel subsets) run the reference: their two score
sums would each need their own query rotation and codebook, left for later. The threadgroup memory
(queries, sketched queries, the tile's partial scores: at most 24.6 KiB at D 128 and 8 rows) fits
Metal's 32 KiB at every supported shape.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import mlx.core as mx

from . import dispatch
from .kivi_attention import BLOCK_PARTIAL_STORE
from .kivi_attention import CUDA_HEADER as _KIVI_CUDA_HEADER
from .kivi_attention import METAL_HEADER as _KIVI_METAL_HEADER
from .kivi_attention import default_tiles_per_block

KERNEL = "turboquant_decode_attention"
FUSED_CODE_BITS = (1, 2, 3, 4)  # key code bits (key_bits - 1 with the QJL residual)
FUSED_VALUE_BITS = (2, 3, 4)
FUSED_HEAD_DIMS = (32, 64, 128)  # whole slices of 32 channels, and at most one value channel group a thread
MAX_ROWS = 8
TILE = 128  # tokens per tile
THREADS = 128  # 4 warps


class Coded(NamedTuple):
    """One side (keys or values) of an integer-width TurboQuant cache as attention sees it.

    codec: the side's Codec (kvcompress/methods/quantization/turboquant.py: its rotation, sketch,
    codebook, `centroids` (the codebook as floats) and widths), passed in: a kernel imports no method.
    arrays: Codec.quantize's names -> buffers [B, H, cap, ...] ("codes" uint32 words, "norms" f16;
    with the QJL residual "signs" uint32 and "res_norms" f16), of which the first n rows are held
    (the rows past them are allocated capacity, never read).
    """

    codec: object
    arrays: dict


def attention_on_codes_reference(q: mx.array, keys: Coded, values: Coded, n: int, scale: float):
    """Softmax attention of q [B, H, M, Dk] (float32, unrotated) over the first n held tokens, through
    the codecs' plain MLX path: (out [B, H, M, Dv] float32, lse [B, H, M] float32, the natural log of
    the softmax's denominator)."""
    ka = {name: a[:, :, :n] for name, a in keys.arrays.items()}
    va = {name: a[:, :, :n] for name, a in values.arrays.items()}
    logits = keys.codec.scores(q, ka) * scale  # [B, H, M, n]
    lse = mx.logsumexp(logits, axis=-1)
    return values.codec.weighted_sum(mx.exp(logits - lse[..., None]), va), lse


# ---------------------------------------------------------------------------------------------
# Fused kernel. Template constants: KB (key code bits), VB (value bits), D, M (query rows a KV head),
# QJL (keys carry the sign sketch), NT (threads). dims: [n (held tokens), cap (rows of every
# buffer), tiles_per_block, blocks per row]. consts: [scale * log2(e), sqrt(pi/2)/D, the key
# codebook (2^KB), the value codebook (2^VB)], padded.

_ATTN_BODY = """
    constexpr int NW = NT / 32;
    constexpr int NS = D / 32;  // slices of 32 channels: KB whole code words and one sign word a token
    constexpr int TPL = TILE * NS / NT;  // tokens a lane scores in a tile
    constexpr int KW = D * KB / 32;
    constexpr int SW = D / 32;
    constexpr int VW = D * VB / 32;
    constexpr int CG = D / 8;  // value channel groups of 8
    constexpr int TL = NT / CG;  // threads over a tile's tokens in the value phase
    constexpr int TPV = TILE / TL;  // tokens a thread takes in the value phase
    constexpr unsigned int KMASK = (1u << KB) - 1u;
    constexpr unsigned int VMASK = (1u << VB) - 1u;
    const int n = dims[0];
    const int cap = dims[1];
    const int tiles_per_block = dims[2];
    const int nb = dims[3];
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int slice = warp % NS;
    const int part = warp / NS;  // which TPL * 32 tokens of the tile this warp scores
    const int cg = tid % CG;
    const int tl = tid / CG;
    const int c0 = cg * 8;

    KV_SHARED float q_rot[D * M];  // [d * M + m], scaled by scale * log2(e)
    KV_SHARED float q_sk[QJL ? D * M : 1];  // the sketched query, scaled by that and sqrt(pi/2)/D
    KV_SHARED float kbook[1 << KB];
    KV_SHARED float vbook[1 << VB];
    KV_SHARED float sc[NS * M * TILE];  // partial scores per slice, then probabilities (slice 0), then the output reduction
    KV_SHARED float run_max[M];
    KV_SHARED float run_sum[M];
    KV_SHARED float corr[M];

    const float qscale = consts[0];
    for (int i = tid; i < D * M; i += NT) {
        const int m = i % M;
        const int d = i / M;
        const long src = ((long)bh * M + m) * D + d;
        q_rot[i] = qr[src] * qscale;
        if (QJL) q_sk[i] = qs[src] * qscale * consts[1];
    }
    if (tid < (1 << KB)) kbook[tid] = consts[2 + tid];
    if (tid < (1 << VB)) vbook[tid] = consts[2 + (1 << KB) + tid];
    if (tid < M) {
        run_max[tid] = NEG_INF;
        run_sum[tid] = 0.0f;
    }
    float acc[M][8];
    KV_UNROLL for (int m = 0; m < M; ++m) {
        KV_UNROLL for (int j = 0; j < 8; ++j) acc[m][j] = 0.0f;
    }
    KV_BARRIER();

    const int tile0 = blk * tiles_per_block;
    for (int tile = tile0; tile < tile0 + tiles_per_block; ++tile) {
        const int start = tile * TILE;
        if (start >= n) break;

        // ---- scores: lane takes tokens (part * TPL + i) * 32 + lane of the tile, this warp's slice.
        // Past the end a lane reads the last held token (a real row), which the softmax masks.
        unsigned int kw[TPL][KB];
        unsigned int sg[TPL];
        float kn[TPL];
        float rn[TPL];
        KV_UNROLL for (int i = 0; i < TPL; ++i) {
            const long row = (long)bh * cap + min(start + (part * TPL + i) * 32 + lane, n - 1);
            KV_UNROLL for (int w = 0; w < KB; ++w) kw[i][w] = kc[row * KW + slice * KB + w];
            sg[i] = QJL ? ks[row * SW + slice] : 0u;
            kn[i] = static_cast<float>(kn_in[row]);
            rn[i] = QJL ? static_cast<float>(kr[row]) : 0.0f;
        }
        float dot[M][TPL];
        float qj[M][TPL];
        KV_UNROLL for (int m = 0; m < M; ++m) {
            KV_UNROLL for (int i = 0; i < TPL; ++i) {
                dot[m][i] = 0.0f;
                qj[m][i] = 0.0f;
            }
        }
        KV_UNROLL for (int j = 0; j < 32; ++j) {
            // code j of the slice: bits j*KB .. j*KB+KB-1 of its KB words (3-bit codes straddle words)
            const int bit = j * KB;
            const int wi = bit / 32;
            const int sh = bit % 32;
            const int d = slice * 32 + j;
            float c[TPL];
            float sgn[TPL];
            KV_UNROLL for (int i = 0; i < TPL; ++i) {
                unsigned int code = kw[i][wi] >> sh;
                if (sh + KB > 32) code |= kw[i][wi + 1] << (32 - sh);
                c[i] = kbook[code & KMASK];
                sgn[i] = ((sg[i] >> j) & 1u) ? 1.0f : -1.0f;
            }
            KV_UNROLL for (int m = 0; m < M; ++m) {
                const float qv = q_rot[d * M + m];
                KV_UNROLL for (int i = 0; i < TPL; ++i) dot[m][i] += qv * c[i];
                if (QJL) {
                    const float sv = q_sk[d * M + m];
                    KV_UNROLL for (int i = 0; i < TPL; ++i) qj[m][i] += sv * sgn[i];
                }
            }
        }
        // token (part * TPL + i) * 32 + lane of row m, slice s: sc[(s * M + m) * TILE + that]
        KV_UNROLL for (int m = 0; m < M; ++m) {
            KV_UNROLL for (int i = 0; i < TPL; ++i) {
                sc[(slice * M + m) * TILE + (part * TPL + i) * 32 + lane] = kn[i] * (dot[m][i] + rn[i] * qj[m][i]);
            }
        }
        KV_BARRIER();

        // ---- online softmax: warp w owns rows w, w + NW, ...; lane the tokens lane + 32 k
        for (int m = warp; m < M; m += NW) {
            float v[TILE / 32];
            float tile_max = NEG_INF;
            KV_UNROLL for (int k = 0; k < TILE / 32; ++k) {
                const int tk = k * 32 + lane;
                float x = 0.0f;
                for (int s = 0; s < NS; ++s) x += sc[(s * M + m) * TILE + tk];
                v[k] = (start + tk < n) ? x : NEG_INF;
                tile_max = FMAX(tile_max, v[k]);
            }
            for (int off = 16; off > 0; off /= 2) tile_max = FMAX(tile_max, SHFL_XOR(tile_max, off));
            const float old_max = run_max[m];
            const float new_max = FMAX(old_max, tile_max);
            float tile_sum = 0.0f;
            KV_UNROLL for (int k = 0; k < TILE / 32; ++k) {
                const float p = (v[k] == NEG_INF) ? 0.0f : EXP2(v[k] - new_max);
                sc[m * TILE + k * 32 + lane] = p;
                tile_sum += p;
            }
            for (int off = 16; off > 0; off /= 2) tile_sum += SHFL_XOR(tile_sum, off);
            if (lane == 0) {
                const float cr = (old_max == NEG_INF) ? 0.0f : EXP2(old_max - new_max);
                corr[m] = cr;
                run_sum[m] = run_sum[m] * cr + tile_sum;
                run_max[m] = new_max;
            }
        }
        KV_BARRIER();

        // ---- values: thread owns channels c0..c0+7 and tokens tl + TL k of the tile
        KV_UNROLL for (int m = 0; m < M; ++m) {
            const float cr = corr[m];
            KV_UNROLL for (int j = 0; j < 8; ++j) acc[m][j] *= cr;
        }
        const int vbit = c0 * VB;
        const int vwi = vbit / 32;
        const int vsh = vbit % 32;
        const bool two_words = vsh + 8 * VB > 32;  // 3-bit codes: 24 bits from a word's offset 8, 16 or 24
        KV_NO_UNROLL for (int k0 = 0; k0 < TPV; k0 += 4) {
            unsigned int w0[4];
            unsigned int w1[4];
            float vn[4];
            KV_UNROLL for (int i = 0; i < 4; ++i) {
                // past the end: the last held token, whose probability here is 0
                const long row = (long)bh * cap + min(start + tl + TL * (k0 + i), n - 1);
                w0[i] = vc[row * VW + vwi];
                w1[i] = two_words ? vc[row * VW + vwi + 1] : 0u;
                vn[i] = static_cast<float>(vn_in[row]);
            }
            KV_UNROLL for (int i = 0; i < 4; ++i) {
                const int tk = tl + TL * (k0 + i);
                float pn[M];
                KV_UNROLL for (int m = 0; m < M; ++m) pn[m] = sc[m * TILE + tk] * vn[i];
                KV_UNROLL for (int j = 0; j < 8; ++j) {
                    const int b = vsh + j * VB;
                    unsigned int code;
                    if (b >= 32) code = w1[i] >> (b - 32);
                    else code = (w0[i] >> b) | ((b + VB > 32) ? (w1[i] << (32 - b)) : 0u);
                    const float cv = vbook[code & VMASK];
                    KV_UNROLL for (int m = 0; m < M; ++m) acc[m][j] += pn[m] * cv;
                }
            }
        }
        KV_BARRIER();
    }

    // ---- reduce the token lanes: inside a warp by shuffles, across warps in turn through shared memory
    KV_UNROLL for (int m = 0; m < M; ++m) {
        KV_UNROLL for (int j = 0; j < 8; ++j) {
            float x = acc[m][j];
            for (int off = CG; off < 32; off *= 2) x += SHFL_XOR(x, off);
            acc[m][j] = x;
        }
    }
""" + BLOCK_PARTIAL_STORE

# Combine the blocks of a (batch, head) row: one threadgroup of D threads per (row, query row), a
# thread per channel; also the log-sum-exp (natural log) the cache merges the fresh tokens with.
_COMBINE_BODY = """
    const int nb = dims[3];
    const long bh = row / M;
    const int m = row % M;
    float gmax = NEG_INF;
    for (int c = 0; c < nb; ++c) gmax = FMAX(gmax, stats[((bh * nb + c) * M + m) * 2]);
    float den = 0.0f;
    float num = 0.0f;
    #pragma unroll 4
    for (int c = 0; c < nb; ++c) {
        const long i = (bh * nb + c) * M + m;
        const float mc = stats[i * 2];
        const float w = (mc == NEG_INF) ? 0.0f : EXP2(mc - gmax);
        den += w * stats[i * 2 + 1];
        num += w * o_part[i * D + tid];
    }
    out[row * D + tid] = num / den;
    if (tid == 0) lse[row] = (gmax + LOG2(den)) * 0.6931471805599453f;
"""

# kivi_attention.py's per-backend macros (shared memory, barriers, shuffles, exp2), and log2
CUDA_HEADER = _KIVI_CUDA_HEADER + "#define LOG2 log2f\n"
METAL_HEADER = _KIVI_METAL_HEADER + "#define LOG2 metal::log2\n"
CUDA_ATTN_SOURCE = ("constexpr int TILE = %d;\n" % TILE
                    + "const int tid = threadIdx.x; const int blk = blockIdx.x; const long bh = blockIdx.y;\n" + _ATTN_BODY)
METAL_ATTN_SOURCE = ("constexpr int TILE = %d;\n" % TILE
                     + "const int tid = (int)thread_position_in_threadgroup.x; const int blk = (int)threadgroup_position_in_grid.x;"
                     " const long bh = (long)threadgroup_position_in_grid.y;\n" + _ATTN_BODY)
CUDA_COMBINE_SOURCE = "const int tid = threadIdx.x; const long row = blockIdx.x;\n" + _COMBINE_BODY
METAL_COMBINE_SOURCE = ("const int tid = (int)thread_position_in_threadgroup.x;"
                        " const long row = (long)threadgroup_position_in_grid.x;\n" + _COMBINE_BODY)

_ATTN_INPUTS = ["qr", "qs", "kc", "kn_in", "ks", "kr", "vc", "vn_in", "consts", "dims"]
_kernels = dispatch.kernel_cache()


def _kernel(which: str, backend: str):
    key = (which, backend)
    if key not in _kernels:
        if which == "attn":
            name, inputs, outputs = KERNEL, _ATTN_INPUTS, ["o_part", "stats"]
            source = CUDA_ATTN_SOURCE if backend == "cuda" else METAL_ATTN_SOURCE
        else:
            name, inputs, outputs = "turboquant_decode_combine", ["o_part", "stats", "dims"], ["out", "lse"]
            source = CUDA_COMBINE_SOURCE if backend == "cuda" else METAL_COMBINE_SOURCE
        header = CUDA_HEADER if backend == "cuda" else METAL_HEADER
        _kernels[key] = dispatch.fast_kernel(backend, name, source, header, inputs, outputs)
    return _kernels[key]


def shared_bytes(D: int, M: int, qjl: bool, key_code_bits: int, value_bits: int) -> int:
    """Static threadgroup memory of the attention kernel's blocks (_ATTN_BODY's arrays; ptxas agreed for sm_90,
    less 4 bytes where the unread sketch array is dropped)."""
    return 4 * (D * M * (2 if qjl else 1) + (0 if qjl else 1) + 2**key_code_bits + 2**value_bits
                + D // 32 * M * TILE + 3 * M)


def _stand_in() -> mx.array:
    # an input the kernel does not read (no QJL: the sketched query, signs and residual norms); of
    # METAL_CONSTANT_BELOW elements so that Metal passes it as the others, a device pointer
    return dispatch.constant((0,) * dispatch.METAL_CONSTANT_BELOW, mx.uint32)


@functools.lru_cache(maxsize=256)
def _consts(scale: float, D: int, key_centroids: tuple, value_centroids: tuple) -> mx.array:
    # the softmax scale in log2 units, the QJL factor and both codebooks (the codecs' `centroids`):
    # one array per signature, not one written per layer and step
    values = [scale * math.log2(math.e), math.sqrt(math.pi / 2) / D, *key_centroids, *value_centroids]
    values += [0.0] * max(0, dispatch.METAL_CONSTANT_BELOW - len(values))
    return mx.array(values, dtype=mx.float32)


def attention_on_codes_fused(q: mx.array, keys: Coded, values: Coded, n: int, scale: float, backend: str = "cuda",
                             tiles_per_block: int | None = None):
    """The fused kernels; the contract of `attention_on_codes_reference` (n >= 1, supported shapes)."""
    B, H, M, D = q.shape
    kc, vc = keys.codec, values.codec
    rows = B * H
    ka, va = keys.arrays, values.arrays
    cap = ka["codes"].shape[2]
    # the query rotated (and sketched) once, in float32: Pi q and S Pi q, [B, H, M, D]
    q_rot = q.astype(mx.float32) @ kc.rotation.swapaxes(-1, -2)[None]
    q_sk = q_rot @ kc.sketch.swapaxes(-1, -2)[None] if kc.qjl else _stand_in()
    n_tiles = -(-n // TILE)
    tpb = tiles_per_block or default_tiles_per_block(n_tiles, rows)
    nb = -(-n_tiles // tpb)
    dims = dispatch.constant((n, cap, tpb, nb), mx.int32)
    consts = _consts(scale, D, kc.centroids, vc.centroids)
    signs, res_norms = (ka["signs"], ka["res_norms"]) if kc.qjl else (_stand_in(), _stand_in())
    template = [("KB", kc.code_bits), ("VB", vc.bits), ("D", D), ("M", M), ("QJL", kc.qjl), ("NT", THREADS)]
    o_part, stats = _kernel("attn", backend)(
        inputs=[q_rot, q_sk, ka["codes"], ka["norms"], signs, res_norms, va["codes"], va["norms"], consts, dims],
        template=template,
        grid=(nb * THREADS, rows, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, nb, M, D), (rows, nb, M, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    out_rot, lse = _kernel("combine", backend)(
        inputs=[o_part, stats, dims],
        template=[("D", D), ("M", M)],
        grid=(rows * M * D, 1, 1),
        threadgroup=(D, 1, 1),
        output_shapes=[(rows, M, D), (rows, M)],
        output_dtypes=[mx.float32, mx.float32],
    )
    # back from the values' rotated space, once: out = out_rot Pi_v
    return out_rot.reshape(B, H, M, D) @ vc.rotation[None], lse.reshape(B, H, M)


def fused_supported(q: mx.array, keys: Coded | None, values: Coded | None, n: int) -> bool:
    """Whether the fused kernel covers attention of q [B, H, M, D] over n held tokens (see the module
    docstring); keys / values None: a fractional width's side (two codecs)."""
    D, M = q.shape[-1], q.shape[-2]
    return (
        keys is not None and values is not None
        and keys.codec.code_bits in FUSED_CODE_BITS and values.codec.bits in FUSED_VALUE_BITS
        and D in FUSED_HEAD_DIMS and keys.codec.dim == values.codec.dim == D
        and M <= MAX_ROWS and n >= 1
    )


def with_fresh_tokens(out: mx.array, lse: mx.array, q: mx.array, fresh_k: mx.array, fresh_v: mx.array,
                      scale: float, positions: int, causal: bool) -> mx.array:
    """Attention over the held tokens (out [B, H, M, Dv], lse [B, H, M]: one softmax's normalized output
    and log-sum-exp) merged with exact attention over the call's own S fresh tokens (fresh_k / fresh_v
    [B, H, S, D], after the held ones) into one softmax over both: weights exp(lse_part - lse_all).
    q [B, H, M, Dk] float32, rows rep-major over `positions` query positions (row r is position
    r % positions, the last `positions` of the fresh tokens); causal: a position sees the fresh tokens
    up to itself."""
    M, S = q.shape[2], fresh_k.shape[2]
    logits = (q @ fresh_k.astype(mx.float32).swapaxes(-1, -2)) * scale  # [B, H, M, S]
    if causal:
        seen = (S - positions + mx.arange(M) % positions)[:, None] >= mx.arange(S)[None]  # [M, S]
        logits = mx.where(seen, logits, -mx.inf)
    lse_fresh = mx.logsumexp(logits, axis=-1)
    lse_all = mx.logaddexp(lse, lse_fresh)
    fresh = mx.exp(logits - lse_all[..., None]) @ fresh_v.astype(mx.float32)
    return out * mx.exp(lse - lse_all)[..., None] + fresh


# the rotated query is a float32 matmul outside the kernel, which a GPU may round through TF32 (KIVI's
# reference on the H200: 4e-4); a wrong kernel is off by far more
_SELFTEST_TOLERANCE = 2e-3


def selftest(backend: str, q: mx.array, keys: Coded, values: Coded, n: int) -> None:
    """The fused kernel against the reference on a random case of one variant (the method's
    `selftest_case`: real codes of a real cache, which only the method can make)."""
    D = q.shape[-1]
    out, lse = attention_on_codes_fused(q, keys, values, n, D**-0.5, backend, tiles_per_block=2)
    with mx.stream(mx.cpu):  # float32 on the CPU
        want_out, want_lse = attention_on_codes_reference(q, keys, values, n, D**-0.5)
        mx.eval(want_out, want_lse)
    dispatch.assert_close(out, want_out, _SELFTEST_TOLERANCE, f"{KERNEL} self-test (output)")
    dispatch.assert_close(lse, want_lse, _SELFTEST_TOLERANCE, f"{KERNEL} self-test (log-sum-exp)")


def decode_backend(q: mx.array, keys: Coded | None, values: Coded | None, n: int, dtype,
                   selftest_case: Callable[[tuple], tuple]) -> str | None:
    """The backend ("cuda" / "metal") to run this call's held tokens fused on, after the kernel's
    self-test for its variant on first use; None: the caller runs its reference (recorded as such).
    q [B, H, M, D] the folded queries; dtype: the model's (the path is recorded under it);
    selftest_case(variant) -> (q, keys, values, n): a random case of the variant, for the self-test."""
    if not fused_supported(q, keys, values, n):
        dispatch.record_reference(KERNEL, dtype)
        return None
    variant = (keys.codec.code_bits, values.codec.bits, q.shape[-1], q.shape[-2], keys.codec.qjl)
    return dispatch.select("turboquant_decode_attention", dtype, variant, lambda backend: selftest(backend, *selftest_case(variant)))
