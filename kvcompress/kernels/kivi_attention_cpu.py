"""KIVI decode attention on packed codes for the CPU: a C++ kernel compiled on first use, called
through ctypes on the arrays' own memory. The MLX reference is `kivi_attention.decode_attention_reference`.

Why: MLX's CPU `quantized_matmul` for KIVI's layouts (codes as the right operand, not transposed:
keys grouped along tokens, values along channels) walks every code once per query row with scalar
code, ~1.2 G codes/s on one core: at 4k tokens it takes 0.65 ms per product per layer of the
embedded model, against 0.17 + 0.09 ms for the full cache's two float32 BLAS products
(docs/learned.md). Dequantizing first is slower still. This kernel unpacks each code
once (zero + scale * code, as `mx.dequantize`) for all the query rows, in loops the compiler
vectorizes, and the residual's full-precision keys and values join the same softmax:
    score[m, t] = sum_d q[m, d] (z[d, g(t)] + s[d, g(t)] c[d, t])     (keys: groups along tokens)
    out[m, d]   = sum_t p[m, t] (z[t, g(d)] + s[t, g(d)] c[t, d])     (values: groups along channels)

float32 only (the CPU model's dtype); key/value bits 2, 4, 8; rows (GQA group x query positions)
1..8; mask None or "causal" (bottom-right aligned). The build needs a C++ compiler (`c++`, g++ or
clang++); without one, or if the kernel fails its self-test, the dispatch runs the reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import mlx.core as mx

SOURCE = r"""
#include <cfloat>
#include <cmath>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <vector>

// Codes [first, first + n) of a bit stream of B-bit codes (LSB first in uint32 words), dequantized:
// zero + scale * code, as mx.dequantize (and the reference's quantized_matmul) computes each element
// before its product (splitting off the zeros' term instead cancels badly in float32: 1.6e-5
// relative error against 6e-7). first and n are multiples of 32 / B: whole words are read.
template <int B>
static inline void dequantize(const uint32_t* __restrict__ words, long first, int n, float scale, float zero,
                              float* __restrict__ out) {
    constexpr int PER_WORD = 32 / B;
    constexpr uint32_t MASK = (1u << B) - 1u;
    const uint32_t* w = words + first / PER_WORD;
    for (int i = 0; i < n / PER_WORD; ++i) {
        const uint32_t word = w[i];
        for (int j = 0; j < PER_WORD; ++j) out[i * PER_WORD + j] = scale * (float)((word >> (j * B)) & MASK) + zero;
    }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(KVC_SCALAR)
#include <immintrin.h>
#define KVC_SIMD 1
// codes [c, c + 8) (c a multiple of 8) of a B-bit stream as 8 floats: zero + scale * code
template <int B>
static inline __m256 dequantize8(const uint32_t* words, long c, __m256 scale, __m256 zero) {
    __m256i v, shifts;
    if (B == 2) {  // 16 codes a word: the low or high half
        v = _mm256_set1_epi32((int)words[c / 16]);
        shifts = (c % 16) ? _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30) : _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    } else if (B == 4) {  // 8 codes a word
        v = _mm256_set1_epi32((int)words[c / 8]);
        shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    } else {  // 8 bits: 4 codes a word, two words
        v = _mm256_set_m128i(_mm_set1_epi32((int)words[c / 4 + 1]), _mm_set1_epi32((int)words[c / 4]));
        shifts = _mm256_setr_epi32(0, 8, 16, 24, 0, 8, 16, 24);
    }
    v = _mm256_and_si256(_mm256_srlv_epi32(v, shifts), _mm256_set1_epi32((1 << B) - 1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), scale, zero);
}

// The rows are a template parameter, so that each row's accumulator lives in a register.
// Keys, 8 tokens at a time: their MR rows of scores stay in registers while every channel's 8 codes
// are dequantized once and added to all rows.
template <int KB, int MR>
static void key_scores(const float* __restrict__ q, int D, int G, const uint32_t* kc, const float* ks,
                       const float* kz, long nk, long kwrow, long kgrow, float* __restrict__ s, long T) {
    for (long c = 0; c < nk; c += 8) {
        const long g = c / G;
        __m256 acc[MR];
        for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
        for (int d = 0; d < D; ++d) {
            const __m256 k8 = dequantize8<KB>(kc + d * kwrow, c, _mm256_set1_ps(ks[d * kgrow + g]),
                                              _mm256_set1_ps(kz[d * kgrow + g]));
            for (int m = 0; m < MR; ++m) acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(q[m * D + d]), k8, acc[m]);
        }
        for (int m = 0; m < MR; ++m) _mm256_storeu_ps(s + m * T + c, acc[m]);
    }
}

// Values, 8 channels at a time: their MR rows of output stay in registers over the tokens.
template <int VB, int MR>
static void value_sums(const float* __restrict__ p, long T, int D, int G, const uint32_t* vc, const float* vs,
                       const float* vz, long nv, float* __restrict__ out) {
    const int vgroups = D / G;
    const long vwrow = D * VB / 32;
    for (int c = 0; c < D; c += 8) {
        const int g = c / G;
        __m256 acc[MR];
        for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
        for (long t = 0; t < nv; ++t) {
            const __m256 v8 = dequantize8<VB>(vc + t * vwrow, c, _mm256_set1_ps(vs[t * vgroups + g]),
                                              _mm256_set1_ps(vz[t * vgroups + g]));
            for (int m = 0; m < MR; ++m) acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(p[m * T + t]), v8, acc[m]);
        }
        for (int m = 0; m < MR; ++m) _mm256_storeu_ps(out + m * D + c, acc[m]);
    }
}

#define KVC_BY_ROWS(CALL) \
    switch (M) { \
        case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
        case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; \
    }
#endif

// One (batch, KV head) row: M query rows attend over T tokens; see kivi_attention_cpu.py.
template <int KB, int VB>
static void attend(const float* __restrict__ q, int M, int D, int L, int causal, long T, int G,
                   const uint32_t* kc, const float* ks, const float* kz, long nk, long kwrow, long kgrow,
                   const float* kr, const uint32_t* vc, const float* vs, const float* vz, long nv, const float* vr,
                   float* __restrict__ out) {
    std::vector<float> s((size_t)M * T, 0.0f);  // scores, then probabilities
#ifdef KVC_SIMD
#define KVC_KEYS(MR) key_scores<KB, MR>(q, D, G, kc, ks, kz, nk, kwrow, kgrow, s.data(), T)
    KVC_BY_ROWS(KVC_KEYS)
#else
    std::vector<float> deq(G);
    for (long g = 0; g < nk / G; ++g) {  // a group of tokens at a time, its scores in cache
        for (int d = 0; d < D; ++d) {
            dequantize<KB>(kc + d * kwrow, g * G, G, ks[d * kgrow + g], kz[d * kgrow + g], deq.data());
            for (int m = 0; m < M; ++m) {
                const float qd = q[m * D + d];
                float* __restrict__ sm = s.data() + m * T + g * G;
                for (int i = 0; i < G; ++i) sm[i] += qd * deq[i];
            }
        }
    }
#endif
    for (int m = 0; m < M; ++m) {
        for (long t = nk; t < T; ++t) {  // the residual's keys
            const float* k = kr + (t - nk) * D;
            float dot = 0.0f;
            for (int d = 0; d < D; ++d) dot += q[m * D + d] * k[d];
            s[m * T + t] = dot;
        }
    }
    // softmax per row (the query is pre-scaled); causal: row m is query position m % L
    std::vector<float> total(M);
    for (int m = 0; m < M; ++m) {
        float* sm = s.data() + m * T;
        const long last = causal ? T - L + (m % L) : T - 1;
        float top = -FLT_MAX;
        for (long t = 0; t <= last; ++t) top = sm[t] > top ? sm[t] : top;
        float sum = 0.0f;
        for (long t = 0; t <= last; ++t) {
            sm[t] = std::exp(sm[t] - top);
            sum += sm[t];
        }
        for (long t = last + 1; t < T; ++t) sm[t] = 0.0f;
        total[m] = sum;
    }
    std::memset(out, 0, sizeof(float) * M * D);
#ifdef KVC_SIMD
#define KVC_VALUES(MR) value_sums<VB, MR>(s.data(), T, D, G, vc, vs, vz, nv, out)
    KVC_BY_ROWS(KVC_VALUES)
#else
    const int vgroups = D / G;
    const long vwrow = D * VB / 32;
    std::vector<float> deq_row(D);
    for (long t = 0; t < nv; ++t) {  // token by token, each value dequantized once for all rows
        for (int g = 0; g < vgroups; ++g) {
            dequantize<VB>(vc + t * vwrow, (long)g * G, G, vs[t * vgroups + g], vz[t * vgroups + g],
                           deq_row.data() + g * G);
        }
        for (int m = 0; m < M; ++m) {
            const float p = s[m * T + t];
            float* __restrict__ om = out + m * D;
            for (int d = 0; d < D; ++d) om[d] += p * deq_row[d];
        }
    }
#endif
    for (long t = nv; t < T; ++t) {  // the residual's values
        const float* v = vr + (t - nv) * D;
        for (int m = 0; m < M; ++m) {
            const float p = s[m * T + t];
            float* __restrict__ om = out + m * D;
            for (int d = 0; d < D; ++d) om[d] += p * v[d];
        }
    }
    for (int m = 0; m < M; ++m) {
        for (int d = 0; d < D; ++d) out[m * D + d] /= total[m];
    }
}

template <int KB, int VB>
static void attend_rows(const float* q, float scale, long R, int M, int D, int L, int causal, long T, int G,
                        const uint32_t* kc, const float* ks, const float* kz, long nk, long kwrow, long kgrow,
                        const float* kr, const uint32_t* vc, const float* vs, const float* vz, long nv, long vcap,
                        const float* vr, float* out) {
    const int vgroups = D / G;
    std::vector<float> scaled((size_t)M * D);
    for (long r = 0; r < R; ++r) {
        for (int i = 0; i < M * D; ++i) scaled[i] = q[r * M * D + i] * scale;
        attend<KB, VB>(scaled.data(), M, D, L, causal, T, G,
                       kc + r * D * kwrow, ks + r * D * kgrow, kz + r * D * kgrow, nk, kwrow, kgrow,
                       kr + r * (T - nk) * D, vc + r * vcap * (D * VB / 32), vs + r * vcap * vgroups,
                       vz + r * vcap * vgroups, nv, vr + r * (T - nv) * D, out + r * M * D);
    }
}

#define KIVI_CASE(KB_, VB_) \
    if (kb == KB_ && vb == VB_) { \
        attend_rows<KB_, VB_>(q, scale, R, M, D, L, causal, T, G, kc, ks, kz, nk, kwrow, kgrow, kr, vc, vs, vz, nv, \
                              vcap, vr, out); \
        status = 0; \
    }

extern "C" int kivi_decode_attention(const float* q, float scale, long R, int M, int D, int L, int causal, long T, int G, int kb,
                                     int vb, const uint32_t* kc, const float* ks, const float* kz, long nk, long kwrow,
                                     long kgrow, const float* kr, const uint32_t* vc, const float* vs, const float* vz,
                                     long nv, long vcap, const float* vr, float* out) {
#if defined(__SSE__)
    // probabilities far below the row's maximum are denormal, and arithmetic on denormals takes
    // microcode assists (2x the call's time, measured): flush them to zero for this call only
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);  // FTZ | DAZ
#endif
    int status = 1;  // bits the kernel does not cover
    KIVI_CASE(2, 2) KIVI_CASE(2, 4) KIVI_CASE(2, 8) KIVI_CASE(4, 2) KIVI_CASE(4, 4) KIVI_CASE(4, 8)
    KIVI_CASE(8, 2) KIVI_CASE(8, 4) KIVI_CASE(8, 8)
#if defined(__SSE__)
    _mm_setcsr(csr);
#endif
    return status;
}
"""

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvcompress" / "cpu"
FUSED_BITS = (2, 4, 8)

_libraries: dict[bool, ctypes.CDLL] = {}


def _compile(simd: bool) -> ctypes.CDLL:
    """The kernel's shared library, built once per source text and kept in ~/.cache/kvcompress/cpu.
    simd=False builds the portable loops only (what a CPU without AVX2 and FMA runs)."""
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) to build the CPU kernel")
    # -march=native: the library is built on the machine that runs it; arm64 compilers spell it -mcpu
    native = "-mcpu=native" if platform.machine() in ("arm64", "aarch64") else "-march=native"
    # not -ffast-math: a shared library built with it sets flush-to-zero for the whole process when
    # loaded (gcc links crtfastmath.o), changing every other float computation in it
    flags = ["-O3", native, "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
             "-fno-signed-zeros", "-std=c++17", "-shared", "-fPIC"] + ([] if simd else ["-DKVC_SCALAR"])
    # -march=native: a library per CPU model too, for a cache directory shared by several machines
    digest = hashlib.sha256((SOURCE + compiler + " ".join(flags) + _cpu_model()).encode()).hexdigest()[:16]
    path = CACHE / f"kivi_attention_{digest}.so"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "kivi_attention.cpp"
            src.write_text(SOURCE)
            out = Path(tmp) / "k.so"
            build = subprocess.run([compiler, *flags, str(src), "-o", str(out)], capture_output=True, text=True)
            if build.returncode:
                raise RuntimeError(f"building the CPU kernel failed: {build.stderr[-2000:]}")
            os.replace(out, path)  # atomic: a concurrent worker sees the whole library or none
    library = ctypes.CDLL(str(path))
    i64, i32, ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    library.kivi_decode_attention.restype = i32
    library.kivi_decode_attention.argtypes = [
        ptr, ctypes.c_float, i64, i32, i32, i32, i32, i64, i32, i32, i32,  # q, scale, R, M, D, L, causal, T, G, bits
        ptr, ptr, ptr, i64, i64, i64, ptr,  # key codes, scales, zeros, n, words and groups a row, residual
        ptr, ptr, ptr, i64, i64, ptr, ptr]  # value codes, scales, zeros, n, capacity rows, residual, out
    return library


def _cpu_model() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def library(simd: bool = True) -> ctypes.CDLL:
    if simd not in _libraries:
        _libraries[simd] = _compile(simd)
    return _libraries[simd]


def _memory(a: mx.array) -> np.ndarray:
    """a's memory as a flat byte array (row-contiguous: a strided view is copied first). It holds
    the memory: keep it until the kernel has returned."""
    view = memoryview(a)
    if not view.c_contiguous:
        view = memoryview(mx.contiguous(a))
    return np.frombuffer(view, dtype=np.uint8)


_none: dict[str, mx.array] = {}  # stand-ins for a side without codes or without residual


def _stand_in(dtype) -> mx.array:
    key = str(dtype)
    if key not in _none:
        _none[key] = mx.zeros((1,), dtype)
        mx.eval(_none[key])
    return _none[key]


def decode_attention_cpu(queries, keys, values, scale: float, causal: bool, key_bits: int, value_bits: int,
                         group_size: int, simd: bool = True) -> mx.array:
    """The CPU kernel; same contract as `decode_attention_reference` for the inputs it covers
    (`kivi_attention.fused_supported` and `supported`). simd=False: the portable loops (tests run
    both; a CPU without AVX2 and FMA runs these)."""
    B, n_q, L, D = queries.shape
    n_kv = keys.residual.shape[1]
    M = n_q // n_kv * L
    T = keys.n_packed + keys.residual.shape[2]
    codes, floats = _stand_in(mx.uint32), _stand_in(mx.float32)
    kc, ks, kz = keys.packed if keys.n_packed else (codes, floats, floats)
    vc, vs, vz = values.packed if values.n_packed else (codes, floats, floats)
    kr = keys.residual if keys.residual.shape[2] else floats
    vr = values.residual if values.residual.shape[2] else floats
    arrays = [queries, kc, ks, kz, kr, vc, vs, vz, vr]
    mx.eval(arrays)  # the kernel reads their memory: rows rep-major, row m is query position m % L
    memory = [_memory(a) for a in arrays]
    q, kc_, ks_, kz_, kr_, vc_, vs_, vz_, vr_ = (m.ctypes.data for m in memory)
    out = np.empty((B * n_kv, M, D), dtype=np.float32)
    status = library(simd).kivi_decode_attention(
        q, scale, B * n_kv, M, D, L, int(causal), T, group_size, key_bits, value_bits,
        kc_, ks_, kz_, keys.n_packed, kc.shape[-1] if keys.n_packed else 0, ks.shape[-1] if keys.n_packed else 0, kr_,
        vc_, vs_, vz_, values.n_packed, vc.shape[-2] if values.n_packed else 0, vr_, out.ctypes.data)
    del memory  # held until here
    if status:
        raise ValueError(f"the CPU kernel takes key/value bits {FUSED_BITS}; got {key_bits}/{value_bits}")
    return mx.array(out).reshape(B, n_q, L, D)


def supported(queries, keys, group_size: int) -> bool:
    """Beyond `kivi_attention.fused_supported`: float32, and the key codes whole groups of tokens."""
    return queries.dtype == mx.float32 and keys.n_packed % group_size == 0
