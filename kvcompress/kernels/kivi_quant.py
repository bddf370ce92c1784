"""KIVI's fused quantize-and-pack: group min/max, codes, bit packing, scales and zeros in one pass.

KIVI (Liu et al., ICML 2024, arXiv:2402.02750), Eq. 1 with asymmetric min/max groups:
    zero = min(X_g),  scale = (max(X_g) - min(X_g)) / (2^b - 1),  code = round((X - zero) / scale)
Keys are quantized per channel (groups of G tokens along the token axis), values per token (groups
of G channels). Codes are written in MLX's quantized layout (an LSB-first bit stream in uint32
words, groups along the last axis) so `mx.dequantize` and `mx.quantized_matmul` read them directly.

Exact semantics shared by every path (the reference defines them; the kernels must match it bit
for bit):
- min and max in float32 of the input values; `zero` = the group minimum (exact in the input dtype);
- `scale` is computed in float32, then stored in the input dtype; codes use the *stored* scale, so
  dequantization `zero + code * scale` is consistent with how the codes were chosen;
- codes = round-half-to-even((x - zero) / scale), clipped to [0, 2^b - 1]; a constant group
  (scale 0) gets code 0 and dequantizes exactly to its value.

`quantize_pack` goes through kvcompress/kernels/dispatch.py: a CUDA kernel (`mx.fast.cuda_kernel`,
tested on an H200) or a Metal kernel (`mx.fast.metal_kernel`, same body, UNTESTED here: no Apple
GPU available), each used only after a bit-exact self-test on first use; on CPU the MLX reference.
"""

from __future__ import annotations

import functools
import zlib

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


# One thread per group; WORDS code words per group (a group's bit stream is whole words).
# dims = [n_groups, C (innermost length of x), L (quantized-axis length), channel tiles, group tiles].
# Per token (values): a thread reads its G contiguous elements with 16-byte vector loads, twice
# (min/max, then codes; the second pass hits the cache); its words and scale are contiguous with
# its neighbours'. Per channel (keys): a block takes 32 channels x GT token groups; consecutive
# threads take consecutive channels of one token row (coalesced reads), and the block stages its
# codes and scales in shared memory so each channel's row of words is written contiguously.
_BODY = """
    constexpr int WORDS = GROUP * BITS / 32;
    constexpr int GT = (WORDS <= 8) ? 8 : 4;
    constexpr int VEC = 16 / sizeof(T);
    const long C = dims[1];
    const long L = dims[2];
    const long groups_per_row = L / GROUP;
    const long words_per_row = groups_per_row * WORDS;
    const float levels = (float)((1 << BITS) - 1);
    float lo = 0.0f;
    float hi = 0.0f;
    unsigned int words[WORDS];
    KQ_UNROLL for (int w = 0; w < WORDS; ++w) words[w] = 0u;
    if (PER_CHANNEL) {
        KQ_SHARED unsigned int w_s[32 * GT * WORDS];
        KQ_SHARED T s_s[32 * GT];
        KQ_SHARED T z_s[32 * GT];
        const long n_ctiles = dims[3];
        const long n_gtiles = dims[4];
        const long gt = tile % n_gtiles;
        const long ct = (tile / n_gtiles) % n_ctiles;
        const long outer = tile / n_gtiles / n_ctiles;
        const int cl = tid % 32;
        const int gl = tid / 32;
        const long d = ct * 32 + cl;
        const long g = gt * GT + gl;
        if (d < C && g < groups_per_row) {
            const long in_base = (outer * L + g * GROUP) * C + d;
            lo = static_cast<float>(x[in_base]);
            hi = lo;
            KQ_UNROLL for (int i = 1; i < GROUP; ++i) {  // unrolled: the GROUP loads are issued together
                const float v = static_cast<float>(x[in_base + i * C]);
                lo = FMIN(lo, v);
                hi = FMAX(hi, v);
            }
            const T scale_t = static_cast<T>(FDIV(hi - lo, levels));
            const float s = static_cast<float>(scale_t);
            const float inv = (s > 0.0f) ? FDIV(1.0f, s) : 0.0f;
            KQ_UNROLL for (int i = 0; i < GROUP; ++i) {
                float q = 0.0f;
                if (s > 0.0f) {
                    const float v = static_cast<float>(x[in_base + i * C]);
                    q = KQ_CODE(v - lo, s, inv, levels);
                }
                const unsigned int c = (unsigned int)q;
                const int bit = i * BITS;
                words[bit / 32] |= c << (bit % 32);
                if ((bit % 32) + BITS > 32) words[bit / 32 + 1] |= c >> (32 - (bit % 32));
            }
            KQ_UNROLL for (int w = 0; w < WORDS; ++w) w_s[(cl * GT + gl) * WORDS + w] = words[w];
            s_s[cl * GT + gl] = scale_t;
            z_s[cl * GT + gl] = static_cast<T>(lo);
        }
        KQ_BARRIER();
        for (int i = tid; i < 32 * GT * WORDS; i += 32 * GT) {
            const int c2 = i / (GT * WORDS);
            const int k = i % (GT * WORDS);
            const long d2 = ct * 32 + c2;
            const long word = gt * GT * WORDS + k;
            if (d2 < C && word < words_per_row) packed[(outer * C + d2) * words_per_row + word] = w_s[i];
        }
        {
            const int c2 = tid / GT;
            const int k = tid % GT;
            const long d2 = ct * 32 + c2;
            const long g2 = gt * GT + k;
            if (d2 < C && g2 < groups_per_row) {
                scales[(outer * C + d2) * groups_per_row + g2] = s_s[c2 * GT + k];
                zeros[(outer * C + d2) * groups_per_row + g2] = z_s[c2 * GT + k];
            }
        }
    } else {
        if (gid >= dims[0]) return;
        const long g = gid % groups_per_row;
        const long out_row = gid / groups_per_row;
        const KQ_DEVICE T* src = x + out_row * L + g * GROUP;
        lo = static_cast<float>(src[0]);
        hi = lo;
        KQ_UNROLL for (int i = 0; i < GROUP; i += VEC) {
            KQ_VEC_LOAD(src + i)
            KQ_UNROLL for (int k = 0; k < VEC; ++k) {
                const float v = static_cast<float>(buf[k]);
                lo = FMIN(lo, v);
                hi = FMAX(hi, v);
            }
        }
        const T scale_t = static_cast<T>(FDIV(hi - lo, levels));
        const float s = static_cast<float>(scale_t);
        const float inv = (s > 0.0f) ? FDIV(1.0f, s) : 0.0f;
        KQ_UNROLL for (int i = 0; i < GROUP; i += VEC) {
            KQ_VEC_LOAD(src + i)
            KQ_UNROLL for (int k = 0; k < VEC; ++k) {
                float q = 0.0f;
                if (s > 0.0f) q = KQ_CODE(static_cast<float>(buf[k]) - lo, s, inv, levels);
                const unsigned int c = (unsigned int)q;
                const int bit = (i + k) * BITS;
                words[bit / 32] |= c << (bit % 32);
                if ((bit % 32) + BITS > 32) words[bit / 32 + 1] |= c >> (32 - (bit % 32));
            }
        }
        KQ_UNROLL for (int w = 0; w < WORDS; ++w) packed[out_row * words_per_row + g * WORDS + w] = words[w];
        scales[out_row * groups_per_row + g] = scale_t;
        zeros[out_row * groups_per_row + g] = static_cast<T>(lo);
    }
"""

# The code of one value, in both backends: round_half_even(d / s) clipped to [0, levels], bit for bit
# as the reference's float32 division. The quotient comes from a multiply by the group's reciprocal
# (within ~3 ulp: < 5e-5 absolute below 256); only where it lies within 1e-3 of a half-integer, where
# that error could round the other way, does the correctly rounded division decide. A division costs
# ~10 instructions per element, the multiply one.
_CODE_MACRO = """
#define KQ_CODE(d, s, inv, levels) \\
    FMIN(FMAX(RINT((FABS((d) * (inv) - FLOOR((d) * (inv)) - 0.5f) < 1e-3f) ? FDIV((d), (s)) : (d) * (inv)), 0.0f), (levels))
"""

# The body spells float ops as macros; each backend's header defines them. CUDA: __fdiv_rn is the
# IEEE round-to-nearest division even under fast-math flags, rintf rounds half to even.
CUDA_HEADER = """
#define FDIV(a, b) __fdiv_rn((a), (b))
#define FMIN fminf
#define FMAX fmaxf
#define RINT rintf
#define FLOOR floorf
#define FABS fabsf

#define KQ_SHARED __shared__
#define KQ_BARRIER() __syncthreads()
#define KQ_DEVICE
#define KQ_UNROLL _Pragma("unroll")
#define KQ_VEC_LOAD(p) const uint4 raw_ = *reinterpret_cast<const uint4*>(p); const T* buf = reinterpret_cast<const T*>(&raw_);
""" + _CODE_MACRO
CUDA_SOURCE = (
    "const long gid = (long)blockIdx.x * blockDim.x + threadIdx.x; const int tid = threadIdx.x;"
    " const long tile = blockIdx.x;\n" + _BODY
)

# Metal: compiled with math_mode "safe" so `/` is correctly rounded; metal::rint rounds half to
# even. UNTESTED here (no Apple GPU on these machines); only these macros differ from CUDA, and the
# dispatch self-tests the kernel bit for bit on first use.
METAL_HEADER = """
#define FDIV(a, b) ((a) / (b))
#define FMIN metal::fmin
#define FMAX metal::fmax
#define RINT metal::rint
#define FLOOR metal::floor
#define FABS metal::fabs

#define KQ_SHARED threadgroup
#define KQ_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define KQ_DEVICE device
#define KQ_UNROLL _Pragma("clang loop unroll(full)")
#define KQ_VEC_LOAD(p) T buf[VEC]; for (int k_ = 0; k_ < VEC; ++k_) buf[k_] = (p)[k_];
""" + _CODE_MACRO
METAL_SOURCE = (
    "const long gid = (long)thread_position_in_grid.x; const int tid = (int)thread_position_in_threadgroup.x;"
    " const long tile = (long)threadgroup_position_in_grid.x;\n" + _BODY
)

_kernels: dict[str, object] = {}


def _kernel(backend: str):
    if backend not in _kernels:
        source, header = (CUDA_SOURCE, CUDA_HEADER) if backend == "cuda" else (METAL_SOURCE, METAL_HEADER)
        # MLX caches compiled kernels by name: a name per source text, so an edited source recompiles
        names = dict(name=f"kivi_quantize_pack_{zlib.crc32((header + source).encode()):08x}",
                     input_names=["x", "dims"], output_names=["packed", "scales", "zeros"])
        if backend == "cuda":
            _kernels[backend] = mx.fast.cuda_kernel(**names, source=source, header=header)
        else:
            _kernels[backend] = mx.fast.metal_kernel(**names, source=source, header=header,
                                                     compile_options={"math_mode": "safe"})
    return _kernels[backend]


def quantize_pack_kernel(
    x: mx.array, bits: int, group_size: int, per_channel: bool = False, backend: str = "cuda", init_value=None
):
    """The fused GPU kernel (backend "cuda" or "metal"); same contract as `quantize_pack_reference`.

    init_value pre-fills the outputs (tests poison them to prove every element is written)."""
    return _launch(x, bits, group_size, per_channel, backend, init_value, _check(x, bits, group_size, per_channel))


def _launch(x: mx.array, bits: int, group_size: int, per_channel: bool, backend: str, init_value, axis_len: int):
    # quantize_pack_kernel after its checks
    plan = _plan(x.shape, x.dtype, bits, group_size, per_channel, axis_len)
    packed, scales, zeros = _kernel(backend)(inputs=[x, plan["dims"]], **plan["launch"], init_value=init_value)
    return packed, scales, zeros


@functools.lru_cache(maxsize=256)
def _plan(shape: tuple, dtype, bits: int, group_size: int, per_channel: bool, axis_len: int) -> dict:
    """Grid, template, output shapes and the `dims` array of one input shape, made once: a decode
    step quantizes the same shapes every step, per layer."""
    channels = shape[-1]
    lead = shape[:-2] if per_channel else shape[:-1]
    rows = lead + (channels,) if per_channel else lead
    n_rows = 1
    for r in rows:
        n_rows *= r
    groups_per_row = axis_len // group_size
    n_groups = n_rows * groups_per_row
    if per_channel:  # blocks of 32 channels x GT groups (GT as in the kernel body)
        group_tile = 8 if group_size * bits // 32 <= 8 else 4
        threads = 32 * group_tile
        c_tiles, g_tiles = -(-channels // 32), -(-groups_per_row // group_tile)
        grid = (n_rows // channels * c_tiles * g_tiles * threads, 1, 1)
    else:
        threads, c_tiles, g_tiles = 256, 0, 0
        grid = ((n_groups + threads - 1) // threads * threads, 1, 1)
    dims = mx.array((n_groups, channels, axis_len, c_tiles, g_tiles), dtype=mx.int64)
    launch = dict(
        template=[("T", dtype), ("BITS", bits), ("GROUP", group_size), ("PER_CHANNEL", per_channel)],
        grid=grid,
        threadgroup=(threads, 1, 1),
        output_shapes=[rows + (axis_len * bits // 32,), rows + (axis_len // group_size,), rows + (axis_len // group_size,)],
        output_dtypes=[mx.uint32, dtype, dtype],
    )
    return {"dims": dims, "launch": launch}


def _selftest(backend: str, dtype, bits: int, group_size: int, per_channel: bool) -> None:
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
    """KIVI quantize-and-pack on the fused kernel where it passed its self-test, else the reference."""
    axis_len = _check(x, bits, group_size, per_channel)  # once: a decode step calls this per layer
    backend = dispatch.select("kivi_quantize_pack", x.dtype, (bits, group_size, per_channel),
                              lambda b: _selftest(b, x.dtype, bits, group_size, per_channel))
    if backend is None:
        return _reference(x, bits, group_size, per_channel)
    return _launch(x, bits, group_size, per_channel, backend, None, axis_len)
