"""The CUDA kernel sources compile as C++ on any machine with g++ (behind a shim that stands in for
CUDA's built-ins: threads, shuffles and barriers do nothing here), so a syntax or type error in a
kernel body shows on the CPU, before a GPU session. Only compiling: the numbers are checked on a GPU
(tests/test_scored_attention.py). Skipped without g++."""

import shutil
import subprocess

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import pytest

from kvcompress.kernels import scored_attention as kernel
from kvcompress.kernels.kivi_attention import CUDA_HEADER

GXX = shutil.which("g++")

SHIM = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
using std::min;
struct dim3_ { unsigned int x, y, z; };
extern dim3_ threadIdx, blockIdx, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
inline void __syncthreads() {}
inline void __syncwarp() {}
template <typename X> X __shfl_xor_sync(unsigned int, X v, int) { return v; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned int i) { float f; std::memcpy(&f, &i, 4); return f; }
struct __half { unsigned short bits; __half() {} __half(float) {} operator float() const { return 0.0f; } };
"""

# the signatures MLX generates for these kernels: inputs const, outputs after them, template parameters
ATTEND = """
template <typename T, int D, int G, int NT, bool NOISY>
__global__ void attend(const T* q, const T* keys, const T* values, const int32_t* dims, const float* params,
                       const uint32_t* streams, const int32_t* positions, const int32_t* noise_dims,
                       float* logits, float* part, float* stats) {
%s
}
"""
FINISH = """
template <typename T, int D, int G, int NT, bool ACCUMULATE, bool NOISY>
__global__ void finish(const float* part, const float* stats, const float* logits, const float* scores,
                       const int32_t* dims, const float* params, const uint32_t* streams, const int32_t* positions,
                       const int32_t* noise_dims, T* out, float* sums) {
%s
}
"""
ATTEND_ARGS = "(const {T}*, const {T}*, const {T}*, const int32_t*, const float*, const uint32_t*, const int32_t*, const int32_t*, float*, float*, float*)"
FINISH_ARGS = "(const float*, const float*, const float*, const float*, const int32_t*, const float*, const uint32_t*, const int32_t*, const int32_t*, {T}*, float*)"


@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_scored_attention_cuda_source_compiles_as_cpp(tmp_path):
    header = CUDA_HEADER + kernel._EXTRA_HEADER["cuda"] + f"#define SLOTS_PER_BLOCK {kernel.SLOTS_PER_FINISH_BLOCK}\n"
    source = SHIM + header + ATTEND % (kernel._INDEX["cuda"] + kernel._ATTEND_BODY)
    source += FINISH % (kernel._INDEX["cuda"] + kernel._FINISH_BODY)
    for T, D, G, noisy in (("__half", 128, 4, "true"), ("float", 64, 3, "false"), ("float", 256, 8, "true"),
                           ("__half", 32, 1, "false")):
        source += f"template void attend<{T}, {D}, {G}, {kernel.THREADS}, {noisy}>{ATTEND_ARGS.format(T=T)};\n"
        for accumulate in ("true", "false"):
            source += (f"template void finish<{T}, {D}, {G}, {kernel.FINISH_THREADS}, {accumulate}, {noisy}>"
                       f"{FINISH_ARGS.format(T=T)};\n")
    path = tmp_path / "scored_attention.cpp"
    path.write_text(source)
    result = subprocess.run([GXX, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", "-Wno-unknown-pragmas",
                             "-Wno-unused-variable", "-Wno-unused-but-set-variable", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_the_check_catches_a_broken_source(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel, "_FINISH_BODY", kernel._FINISH_BODY.replace("noisy_inv_sum[g] = 1.0f / total;",
                                                                            "noisy_inv_sum[g] = 1.0f / totl;"))
    with pytest.raises(AssertionError, match="totl"):
        test_scored_attention_cuda_source_compiles_as_cpp(tmp_path)
