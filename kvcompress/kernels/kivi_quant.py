"""KIVI's fused quantize-and-pack: group min/max, codes, bit packing, scales and zeros in one pass.

KIVI (Liu et al., ICML 2024, arXiv:2402.02750), Eq. 1 with asymmetric min/max groups:
    zero = min(X_g),  scale = (max(X_g) - min(X_g)) / (2^b - 1),  code = round((X - zero) / scale)
Keys are quantized per channel (groups of G tokens along the token axis), values per token (groups
of G channels). Codes are written in MLX's quantized layout (an LSB-first bit stream in uint32
words, groups along the last axis) so `mx.dequantize` and `mx.quantized_matmul` read them directly.

Exact semantics shared by every path (the reference, `quantize_pack_reference`, defines them; the
kernels must match it bit for bit):
- min and max in float32 of the input values; `zero` = the group minimum (exact in the input dtype);
- `scale` is computed in float32, then stored in the input dtype; codes use the *stored* scale, so
  dequantization `zero + code * scale` is consistent with how the codes were chosen;
- codes = round-half-to-even((x - zero) / scale), clipped to [0, 2^b - 1]; a constant group
  (scale 0) gets code 0 and dequantizes exactly to its value.

`quantize_pack` goes through kvcompress/kernels/dispatch.py: a CUDA kernel (`mx.fast.cuda_kernel`,
tested on an H200) or a Metal kernel (`mx.fast.metal_kernel`, same body, never run on an Apple GPU:
bit-exact in the CPU emulator, tests/test_metal_on_cpu.py), each used only after a bit-exact self-test on first use, for 2/4/8-bit codes (3-bit
codes and rows the kernel's loads do not tile run the reference, see `kernel_supported`); on CPU the
MLX reference.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from . import dispatch
from .dispatch import gpu_backend  # noqa: F401  (re-exported: tests and benchmarks import it from here)

BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128)


def _check(x: mx.array, bits: int, group_size: int, per_channel: bool) -> int:
    """Length of the quantized axis, after checking that groups tile it."""
    if bits not in BITS:
        raise ValueError(f"bits: expected one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size: expected one of {GROUP_SIZES}, got {group_size}")
    axis_len = x.shape[-2] if per_channel else x.shape[-1]
    if x.ndim < 2 or axis_len % group_size:
        raise ValueError(f"quantized axis of length {axis_len} is not a multiple of group_size {group_size}")
    return axis_len


_shifts: dict[tuple[int, int], mx.array] = {}


def _shift_array(count: int, step: int) -> mx.array:
    # made once per width: a decode step packs one token per layer, and each op costs host time
    if (count, step) not in _shifts:
        _shifts[count, step] = mx.arange(count, dtype=mx.uint32) * step
        mx.eval(_shifts[count, step])
    return _shifts[count, step]


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """Pack integer codes [..., N] (N * bits a multiple of 32) into MLX's uint32 layout [..., N * bits / 32]."""
    *lead, n = codes.shape
    codes = codes.astype(mx.uint32)
    if 32 % bits == 0:  # whole codes per word: code i of a word sits at bit i * bits
        per_word = 32 // bits
        return (codes.reshape(*lead, n // per_word, per_word) << _shift_array(per_word, bits)).sum(-1).astype(mx.uint32)
    # 3 bits: codes straddle words; expand to single bits and regroup the bit stream by 32
    code_bits = (codes[..., None] >> _shift_array(bits, 1)) & 1  # [..., N, bits]
    stream = code_bits.reshape(*lead, n * bits // 32, 32)
    return (stream << _shift_array(32, 1)).sum(-1).astype(mx.uint32)


def quantize_pack_reference(x: mx.array, bits: int, group_size: int, per_channel: bool = False):
    """Plain MLX KIVI quantize-and-pack; the definition the kernels are tested against.

    per_channel=False: x [..., N, C], groups along C -> codes [..., N, C*b/32], scales/zeros [..., N, C/G]
    per_channel=True:  x [..., T, C], groups along T -> transposed: codes [..., C, T*b/32],
                       scales/zeros [..., C, T/G] (keys as K^T, ready for quantized_matmul)
    """
    _check(x, bits, group_size, per_channel)
    return _reference(x, bits, group_size, per_channel)


def _reference(x: mx.array, bits: int, group_size: int, per_channel: bool):
    # quantize_pack_reference after its checks
    levels = 2**bits - 1
    rows = x.swapaxes(-1, -2) if per_channel else x
    *lead, n = rows.shape
    groups = rows.astype(mx.float32).reshape(*lead, n // group_size, group_size)
    lo = groups.min(-1, keepdims=True)
    hi = groups.max(-1, keepdims=True)
    scale = ((hi - lo) / levels).astype(x.dtype)
    s = scale.astype(mx.float32)
    positive = s > 0
    safe = mx.where(positive, s, 1.0)
    codes = mx.where(positive, mx.clip(mx.round((groups - lo) / safe), 0, levels), 0)
    packed = pack_codes(codes.reshape(*lead, n), bits)
    return packed, scale.squeeze(-1), lo.astype(x.dtype).squeeze(-1)


# Warp-cooperative: each lane owns pieces of 8 consecutive codes of a group, so P = G / 8
# neighbouring lanes hold a group and meet by shuffles (the group's min and max; two lanes' 16-bit
# pieces into one 2-bit word). Every element is read once, with 16-byte loads, all of a lane's loads
# issued before any is used. dims = [pieces, C (innermost length of x), L (quantized-axis length)].
# Per token (values): groups tile the flat input, so piece i is elements [8i, 8i + 8); a lane takes
# ITEMS = 4 pieces 32 apart (its fixed work, the group's scale and reciprocal, spread over 32 codes),
# so each warp load reads 512 contiguous bytes and each warp store writes contiguous words.
# Per channel (keys): piece (p, chunk) is tokens [8p, 8p + 8) of a group for CV = 16 / sizeof(T)
# channels (one 16-byte load per token); a lane takes one (64 elements already) and writes each
# channel's 8 codes into that channel's row of K^T. A warp takes 2 neighbouring chunks (32 bytes of a
# token row: whole sectors) of GS = 16 / P neighbouring groups, so a store instruction writes each of
# its rows of K^T 32 contiguous bytes of codes (2-bit) and its scales GS neighbours: with the
# warp's lanes spread over 8 chunks of one group instead, it wrote 8 rows 8 bytes each (a quarter
# of each 32-byte sector) and each scale alone (H200, 256 MiB, G 32: 46-53% of the copy's speed ->
# 55-62% at 2/4 bits, docs/learned.md). With 2-bit codes two lanes hold the
# halves of a word; per channel they swap one half for two channels at a time and both write, so
# every lane of a store is busy (half the store instructions).
# 3-bit codes straddle words (a lane's 24 bits are no whole piece of one): the reference runs them.
_BODY = """
    constexpr int P = GROUP / 8;
    constexpr int VEC = 16 / (int)sizeof(T);
    constexpr int CV = PER_CHANNEL ? VEC : 1;
    constexpr int ITEMS = PER_CHANNEL ? 1 : 4;
    using V = typename kq_pick<PER_CHANNEL, T, float>::type;  // per channel: as loaded (half the registers)
    const long pieces = dims[0];
    const long C = dims[1];
    const long L = dims[2];
    const int p = (int)(gid % P);  // this lane's place in its groups (the same for all its pieces)
    const float levels = (float)((1 << BITS) - 1);

    bool active[ITEMS];  // pieces past the end are whole groups: they take part in shuffles only
    long piece[ITEMS];   // pieces before this one: per token in the flat stream, per channel in its rows
    long group[ITEMS];   // per token: the flat group index; per channel: the group along its rows
    long row[ITEMS];     // per channel: the first of its CV rows of K^T; per token: 0
    V v[ITEMS][8 * CV];  // code i of channel j at v[k][i * CV + j]
    KQ_UNROLL for (int k = 0; k < ITEMS; ++k) {
        const long idx = gid / 32 * (32 * ITEMS) + 32 * k + gid % 32;
        active[k] = idx < pieces;
        long src = idx * 8;
        piece[k] = idx;
        group[k] = idx / P;
        row[k] = 0;
        if (PER_CHANNEL) {  // a warp: 2 chunks x GS groups of one outer (lanes: p, then group, then chunk)
            constexpr int GS = 16 / P;
            const unsigned int chunks = (unsigned int)(C / CV);
            const unsigned int groups = (unsigned int)(L / GROUP);
            const unsigned int chunk_pairs = (chunks + 1) / 2;
            const unsigned int group_blocks = (groups + GS - 1) / GS;
            const unsigned int warp_ = (unsigned int)(idx / 32);
            const unsigned int lane_ = (unsigned int)(idx % 32);
            const unsigned int chunk = warp_ % chunk_pairs * 2 + lane_ / (P * GS);
            const unsigned int block_ = warp_ / chunk_pairs;
            const long c0 = (long)chunk * CV;
            const long outer = block_ / group_blocks;
            group[k] = (long)(block_ % group_blocks * GS + lane_ / P % GS);
            active[k] = chunk < chunks && group[k] < groups && outer * chunks * groups * P < pieces;
            src = (outer * L + group[k] * GROUP + 8 * p) * C + c0;
            piece[k] = group[k] * P + p;
            row[k] = outer * C + c0;
        }
        KQ_UNROLL for (int i = 0; i < 8 * CV; ++i) v[k][i] = static_cast<V>(0.0f);
        if (active[k]) {
            if (PER_CHANNEL) {
                KQ_UNROLL for (int i = 0; i < 8; ++i) { KQ_LOAD16(x + src + i * C, v[k] + i * CV) }
            } else {
                KQ_UNROLL for (int i = 0; i < 8; i += VEC) { KQ_LOAD16(x + src + i, v[k] + i) }
            }
        }
    }

    KQ_UNROLL for (int k = 0; k < ITEMS; ++k) {
        unsigned int held = 0u;  // 2-bit, per channel: this lane's half word of the even channel before
        KQ_UNROLL for (int j = 0; j < CV; ++j) {
            float lo = static_cast<float>(v[k][j]);
            float hi = lo;
            KQ_UNROLL for (int i = 1; i < 8; ++i) {
                lo = FMIN(lo, static_cast<float>(v[k][i * CV + j]));
                hi = FMAX(hi, static_cast<float>(v[k][i * CV + j]));
            }
            KQ_UNROLL for (int off = 1; off < P; off *= 2) {
                lo = FMIN(lo, SHFL_XOR(lo, off));
                hi = FMAX(hi, SHFL_XOR(hi, off));
            }
            const T scale_t = static_cast<T>(FDIV(hi - lo, levels));
            const float s = static_cast<float>(scale_t);
            const float inv = (s > 0.0f) ? FDIV(1.0f, s) : 0.0f;  // scale 0: every quotient 0, every code 0
            float q[8];  // quotients
            float t[8];  // quotient + 2^23: rounded, the code in its low bits
            bool near_half = false;
            KQ_UNROLL for (int i = 0; i < 8; ++i) {
                q[i] = FMUL_RN(static_cast<float>(v[k][i * CV + j]) - lo, inv);
                t[i] = q[i] + KQ_MAGIC;
                near_half = near_half || KQ_NEAR_HALF(q[i], t[i]);
            }
            if (near_half) {  // rare: the correctly rounded division decides (see _CODE_RULE)
                KQ_UNROLL for (int i = 0; i < 8; ++i) {
                    if (KQ_NEAR_HALF(q[i], t[i])) t[i] = FDIV(static_cast<float>(v[k][i * CV + j]) - lo, s) + KQ_MAGIC;
                }
            }
            // codes are the words' fields: adding each field's biased code (its bits of t, clipped to
            // levels) and taking the bias off at once is the same arithmetic mod 2^32 as or-ing codes
            unsigned int w0 = 0u;
            unsigned int w1 = 0u;
            KQ_UNROLL for (int i = 0; i < 8; ++i) {
                const unsigned int biased = min(FLOAT_BITS(t[i]), KQ_MAGIC_BITS + (1u << BITS) - 1u);
                if (i * BITS < 32) w0 += biased << (i * BITS);
                else w1 += biased << (i * BITS - 32);
            }
            KQ_UNROLL for (int i = 0; i < 8; ++i) {
                if (i * BITS < 32) w0 -= KQ_MAGIC_BITS << (i * BITS);
                else w1 -= KQ_MAGIC_BITS << (i * BITS - 32);
            }
            const long r = row[k] + j;
            KQ_DEVICE unsigned int* dst = packed + r * (L * BITS / 32);
            if (BITS == 2 && PER_CHANNEL) {  // lanes p, p ^ 1 hold the low and high halves of the words of
                if (j % 2 == 0) {            // channels j - 1 and j: one swap, then the even lane writes
                    held = w0;               // channel j - 1's word (the row before) and the odd lane j's
                } else {
                    const bool odd = p % 2 == 1;
                    const unsigned int got = SHFL_XOR(odd ? held : w0, 1);
                    const unsigned int word = odd ? got | (w0 << 16) : held | (got << 16);
                    if (active[k]) dst[piece[k] / 2 - (odd ? 0 : L * BITS / 32)] = word;
                }
            } else if (BITS == 2) {
                const unsigned int next = SHFL_XOR(w0, 1);
                if (active[k] && p % 2 == 0) dst[piece[k] / 2] = w0 | (next << 16);
            } else if (active[k]) {
                dst[piece[k] * (BITS / 4)] = w0;
                if (BITS == 8) dst[piece[k] * 2 + 1] = w1;
            }
            if (active[k] && (PER_CHANNEL ? j % P == p : p == 0)) {  // one lane writes each group's scale and zero
                scales[r * (L / GROUP) + group[k]] = scale_t;
                zeros[r * (L / GROUP) + group[k]] = static_cast<T>(lo);
            }
        }
    }
"""

# The code of one value, in both backends: round_half_even(d / s) clipped to [0, levels], bit for bit
# as the reference's float32 division (_CODE_RULE). The quotient is a product with the group's
# reciprocal (two roundings: within 2^-23 relative of the division, < 3.1e-5 absolute below 257);
# only where it lies within 1e-4 of a half-integer, where that error could round the other way,
# does the correctly rounded division decide (a division is ~10 instructions, the product one; a
# warp takes the division's branch when any of its lanes needs it, ~5% of warps at this window). Adding 2^23 to a quotient in
# [0, 2^22) rounds it half to even (as rint) and leaves the integer in the low mantissa bits: the
# code without a float-to-int conversion, which issues at a fraction of the add's rate.
_CODE_RULE = """
template <bool B, typename A, typename F> struct kq_pick { using type = A; };
template <typename A, typename F> struct kq_pick<false, A, F> { using type = F; };
#define KQ_MAGIC 8388608.0f
#define KQ_MAGIC_BITS 0x4B000000u
#define KQ_NEAR_HALF(q, t) (FABS((q) - ((t) - KQ_MAGIC)) > 0.4999f)
"""

# The body spells float ops as macros; each backend's header defines them. CUDA: __fdiv_rn is the
# IEEE round-to-nearest division even under fast-math flags.
CUDA_HEADER = """
#define FDIV(a, b) __fdiv_rn((a), (b))
#define FMIN fminf
#define FMAX fmaxf
#define FABS fabsf
#define FLOAT_BITS __float_as_uint
#define FMUL_RN __fmul_rn
#define SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))

#define KQ_DEVICE
#define KQ_UNROLL _Pragma("unroll")
#define KQ_LOAD16(p, out) { \\
    const uint4 raw_ = *reinterpret_cast<const uint4*>(p); \\
    const T* e_ = reinterpret_cast<const T*>(&raw_); \\
    KQ_UNROLL for (int k_ = 0; k_ < VEC; ++k_) (out)[k_] = static_cast<V>(e_[k_]); }
""" + _CODE_RULE
CUDA_SOURCE = "const long gid = (long)blockIdx.x * blockDim.x + threadIdx.x;\n" + _BODY

# Metal: compiled with math_mode "safe" so `/` is correctly rounded; simdgroups of 32 stand in for
# warps. Never run on an Apple GPU (emulated on the CPU: tests/test_metal_on_cpu.py); only these
# macros differ from CUDA, and the dispatch self-tests the kernel bit for bit on first use.
METAL_HEADER = """
#define FDIV(a, b) ((a) / (b))
#define FMIN metal::fmin
#define FMAX metal::fmax
#define FABS metal::fabs
#define FLOAT_BITS as_type<uint>
#define FMUL_RN(a, b) ((a) * (b))
#define SHFL_XOR(v, m) simd_shuffle_xor((v), (ushort)(m))

#define KQ_DEVICE device
#define KQ_UNROLL _Pragma("clang loop unroll(full)")
#define KQ_LOAD16(p, out) { KQ_UNROLL for (int k_ = 0; k_ < VEC; ++k_) (out)[k_] = static_cast<V>((p)[k_]); }
""" + _CODE_RULE
METAL_SOURCE = "const long gid = (long)thread_position_in_grid.x;\n" + _BODY

_kernels = dispatch.kernel_cache()


def _kernel(backend: str):
    if backend not in _kernels:
        source, header = (CUDA_SOURCE, CUDA_HEADER) if backend == "cuda" else (METAL_SOURCE, METAL_HEADER)
        options = {} if backend == "cuda" else {"compile_options": {"math_mode": "safe"}}
        _kernels[backend] = dispatch.fast_kernel(backend, "kivi_quantize_pack", source, header, ["x", "dims"],
                                                 ["packed", "scales", "zeros"], **options)
    return _kernels[backend]


KERNEL_BITS = (2, 4, 8)


def kernel_supported(x: mx.array, bits: int, per_channel: bool) -> bool:
    """Whether the fused kernel covers this call: 2/4/8-bit codes (a lane's 8 codes are a whole
    piece of a word), and per channel a row of whole 16-byte loads (channels a multiple of 16 /
    itemsize: 8 in fp16/bf16, 4 in float32)."""
    return bits in KERNEL_BITS and (not per_channel or x.shape[-1] * x.dtype.size % 16 == 0)


def quantize_pack_kernel(
    x: mx.array, bits: int, group_size: int, per_channel: bool = False, backend: str = "cuda", init_value=None
):
    """The fused GPU kernel (backend "cuda" or "metal"); same contract as `quantize_pack_reference`.

    init_value pre-fills the outputs (tests poison them to prove every element is written)."""
    axis_len = _check(x, bits, group_size, per_channel)
    if not kernel_supported(x, bits, per_channel):
        raise ValueError(f"the fused kernel takes bits {KERNEL_BITS} and, per channel, a channel count times "
                         f"the itemsize a multiple of 16 bytes; got bits {bits}, shape {x.shape}, {x.dtype}")
    return _launch(x, bits, group_size, per_channel, backend, init_value, axis_len)


def _launch(x: mx.array, bits: int, group_size: int, per_channel: bool, backend: str, init_value, axis_len: int):
    # quantize_pack_kernel after its checks
    plan = _plan(x.shape, x.dtype, bits, group_size, per_channel, axis_len)
    packed, scales, zeros = _kernel(backend)(inputs=[x, plan["dims"]], **plan["launch"], init_value=init_value)
    return packed, scales, zeros


THREADS = 256


@functools.lru_cache(maxsize=256)
def _plan(shape: tuple, dtype, bits: int, group_size: int, per_channel: bool, axis_len: int) -> dict:
    """Grid, template, output shapes and the `dims` array of one input shape, made once: a decode
    step quantizes the same shapes every step, per layer."""
    channels = shape[-1]
    lead = shape[:-2] if per_channel else shape[:-1]
    rows = lead + (channels,) if per_channel else lead
    elements = channels
    for n in shape[:-1]:
        elements *= n
    # pieces of 8 codes (per channel: 8 tokens x 16 bytes of channels), ITEMS a lane, whole warps
    pieces = elements // 8 // (16 // dtype.size if per_channel else 1)
    if pieces >= 2**31:
        raise ValueError(f"quantize_pack: {elements} elements in one call; the kernel indexes pieces of 8 in 32 bits")
    if per_channel:  # whole warps of 2 chunks x 16 / P groups (see _BODY)
        chunks, groups, per_warp = channels * dtype.size // 16, axis_len // group_size, 128 // group_size
        lanes = elements // (axis_len * channels) * -(-chunks // 2) * -(-groups // per_warp) * 32
    else:  # 4 pieces a lane
        lanes = -(-pieces // (32 * 4)) * 32
    dims = mx.array((pieces, channels, axis_len), dtype=mx.int64)
    launch = dict(
        template=[("T", dtype), ("BITS", bits), ("GROUP", group_size), ("PER_CHANNEL", per_channel)],
        grid=(-(-lanes // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[rows + (axis_len * bits // 32,), rows + (axis_len // group_size,), rows + (axis_len // group_size,)],
        output_dtypes=[mx.uint32, dtype, dtype],
    )
    return {"dims": dims, "launch": launch}


def selftest(backend: str, dtype, bits: int, group_size: int, per_channel: bool) -> None:
    """Bit-exact check of the kernel against the reference on a small random input (with a
    constant group and exact ties), outputs poisoned so an unwritten element cannot pass."""
    shape = (2, 3, 2 * group_size, 64) if per_channel else (2, 5, 2 * group_size)
    x = mx.random.normal(shape, key=mx.random.key(bits * 1000 + group_size)) * 3
    x = mx.where(mx.arange(shape[-1]) % 7 == 0, mx.round(x * 2) / 2, x)  # ties on the code grid
    x = x.astype(dtype)
    got = quantize_pack_kernel(x, bits, group_size, per_channel, backend, init_value=3.0)
    with mx.stream(mx.cpu):
        want = quantize_pack_reference(x, bits, group_size, per_channel)
        mx.eval(want)
    dispatch.assert_equal(got, want, "kivi_quantize_pack self-test")


def quantize_pack(x: mx.array, bits: int, group_size: int, per_channel: bool = False):
    """KIVI quantize-and-pack on the fused kernel where it covers the call and passed its self-test,
    else the reference."""
    axis_len = _check(x, bits, group_size, per_channel)  # once: a decode step calls this per layer
    if not kernel_supported(x, bits, per_channel):
        dispatch.record_reference("kivi_quantize_pack", x.dtype)
        return _reference(x, bits, group_size, per_channel)
    backend = dispatch.select("kivi_quantize_pack", x.dtype, (bits, group_size, per_channel),
                              lambda b: selftest(b, x.dtype, bits, group_size, per_channel))
    if backend is None:
        return _reference(x, bits, group_size, per_channel)
    return _launch(x, bits, group_size, per_channel, backend, None, axis_len)
