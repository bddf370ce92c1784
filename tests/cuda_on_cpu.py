"""Run a CUDA kernel body on the CPU: g++ and one OS thread per GPU thread.

The body is compiled as C++ behind a shim that gives each thread its own `threadIdx` / `blockIdx`,
makes `__shared__` arrays shared by the threads of a block (blocks run one after another), and
implements warp shuffles, `__syncwarp` and `__syncthreads` with barriers. So the kernel's own index
arithmetic, reductions and shared-memory traffic run as written, with the numbers checked against
the MLX reference on machines without a GPU. What it cannot show: GPU speed, memory-model races
that the barriers here hide, the GPU's math library (expf/logf here are glibc's).

Only what the kernels in kvcompress/kernels use is shimmed (32-bit shuffles, barriers, a few
float built-ins, the tensor-core product `Mma<T>::run`, `load_matrices_x4` and the asynchronous
copies; `__half` is not: run the float32 instantiations). The product (mma.sync m16n8k16 on a GPU)
and the matrix load (ldmatrix.x4) exchange the warp's fragments or row addresses through memory and
give each lane the elements PTX's fragment layouts give it, so a kernel that reads its logits from
the wrong lane or register fails here as on the GPU; the copies (cp.async) are plain copies, done
when issued.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

GXX = shutil.which("g++")

# the declarations only: enough to compile a body without running it
DECLARATIONS = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#include <type_traits>
using std::max;
using std::min;
struct dim3_ { unsigned int x, y, z; };
thread_local dim3_ threadIdx, blockIdx;
dim3_ blockDim, gridDim;  // set per launch
#define __global__
#define __device__
#define __forceinline__ inline
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int i; std::memcpy(&i, &f, 4); return i; }
// correctly rounded single operations: plain float arithmetic here (g++ on x86-64 does not contract
// them into FMAs without -mfma or -ffp-contract=fast)
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float exp2_fast(float x) { return std::exp2(x); }  // kernels/prompt_scores.py's ex2.approx
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
// fp16 as the GPU stores it, converted with correct rounding through g++'s _Float16
struct __half {
    unsigned short bits;
    __half() {}
    __half(float f) { const _Float16 h = (_Float16)f; std::memcpy(&bits, &h, 2); }
    operator float() const { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
};
// half2 arithmetic on 32-bit registers (low half = first element), as kivi_attention_mma.py's PTX:
// one correct rounding each (the operations are exact in double before it)
inline double half_at(unsigned int x, int i) { _Float16 h; const unsigned short b = x >> (16 * i); std::memcpy(&h, &b, 2); return (double)h; }
inline unsigned int half_bits(double v) { const _Float16 h = (_Float16)v; unsigned short b; std::memcpy(&b, &h, 2); return b; }
inline unsigned int h2_of(double lo, double hi) { return half_bits(lo) | (half_bits(hi) << 16); }
inline unsigned int h2_sub(unsigned int a, unsigned int b) { return h2_of(half_at(a, 0) - half_at(b, 0), half_at(a, 1) - half_at(b, 1)); }
inline unsigned int h2_mul(unsigned int a, unsigned int b) { return h2_of(half_at(a, 0) * half_at(b, 0), half_at(a, 1) * half_at(b, 1)); }
inline unsigned int h2_fma(unsigned int a, unsigned int b, unsigned int c) {
    return h2_of(half_at(a, 0) * half_at(b, 0) + half_at(c, 0), half_at(a, 1) * half_at(b, 1) + half_at(c, 1));
}
inline unsigned int h2_pack(float lo, float hi) { return h2_of((double)(_Float16)lo, (double)(_Float16)hi); }
// PTX prmt / __byte_perm: byte i of the result is byte (s >> 4i) & 7 of {y, x}
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const uint64_t v = ((uint64_t)y << 32) | x;
    unsigned int r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned int)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return r;
}
"""

RUNTIME = r"""
struct Warp { std::unique_ptr<std::barrier<>> bar; uint32_t exchange[32]; float mma_a[32][8], mma_b[32][4];
             uint32_t h_a[32][4], h_b[32][2]; const void* matrix_rows[32]; };
static std::vector<Warp> g_warps;
static std::unique_ptr<std::barrier<>> g_block;
thread_local int t_warp, t_lane;
inline void __syncthreads() { g_block->arrive_and_wait(); }
inline void __syncwarp() { g_warps[t_warp].bar->arrive_and_wait(); }
template <typename X> X __shfl_xor_sync(unsigned int, X v, int m) {
    static_assert(sizeof(X) == 4, "32-bit shuffles only");
    Warp& w = g_warps[t_warp];
    std::memcpy(&w.exchange[t_lane], &v, 4);
    w.bar->arrive_and_wait();
    X r;
    std::memcpy(&r, &w.exchange[t_lane ^ m], 4);
    w.bar->arrive_and_wait();  // everyone has read before the next exchange is written
    return r;
}
// mma.sync.m16n8k16 (fp32 accumulation) on float pairs: lane l gives a[0..3] (A 16 x 16, row-major:
// rows l/4 and l/4 + 8, columns 2(l%4) + {0, 1} and + 8), b[0..1] (B 16 x 8, column-major: rows
// 2(l%4) + {0, 1} and + 8, column l/4) and takes c[0..3] (rows l/4 and l/4 + 8, columns 2(l%4) + {0, 1})
// The product of the fragments the warp's lanes have put in their Warp: x(w, row, k) and y(w, k, col)
// read one element of A and of B; each lane takes its c[0..3] (rows l/4 and l/4 + 8, columns 2(l%4) + {0, 1})
template <class X, class Y> void mma_of_fragments(float* c, X x, Y y) {
    Warp& w = g_warps[t_warp];
    w.bar->arrive_and_wait();
    float out[4];
    for (int e = 0; e < 4; ++e) {
        const int row = t_lane / 4 + 8 * (e / 2), col = 2 * (t_lane % 4) + e % 2;
        float acc = c[e];
        for (int k = 0; k < 16; ++k) acc += x(w, row, k) * y(w, k, col);
        out[e] = acc;
    }
    w.bar->arrive_and_wait();  // everyone has read before the next product is written
    std::memcpy(c, out, 16);
}
// mma.sync.m16n8k16 (fp32 accumulation) on float pairs: lane l gives a[0..3] (A 16 x 16, row-major:
// rows l/4 and l/4 + 8, columns 2(l%4) + {0, 1} and + 8), b[0..1] (B 16 x 8, column-major: rows
// 2(l%4) + {0, 1} and + 8, column l/4)
template <typename T> struct Mma {
    template <typename P> static void run(float* c, const P* a, const P* b) {
        static_assert(sizeof(P) == 8, "float32 pairs only (the float32 instantiations)");
        Warp& w = g_warps[t_warp];
        std::memcpy(w.mma_a[t_lane], a, 32);
        std::memcpy(w.mma_b[t_lane], b, 16);
        mma_of_fragments(c,
            [](Warp& w, int row, int k) { return w.mma_a[(row % 8) * 4 + (k % 8) / 2][(k / 8) * 4 + (row / 8) * 2 + k % 2]; },
            [](Warp& w, int k, int col) { return w.mma_b[col * 4 + (k % 8) / 2][(k / 8) * 2 + k % 2]; });
    }
};
// the same with fp16 fragments (32-bit registers of two halves; element e of a register in its
// 16-bit half e): the products of two halves are exact in float
inline void mma_f16(float* c, const unsigned int* a, const unsigned int* b) {
    Warp& w = g_warps[t_warp];
    std::memcpy(w.h_a[t_lane], a, 16);
    std::memcpy(w.h_b[t_lane], b, 8);
    mma_of_fragments(c,
        [](Warp& w, int row, int k) { return (float)half_at(w.h_a[(row % 8) * 4 + (k % 8) / 2][(k / 8) * 2 + row / 8], k % 2); },
        [](Warp& w, int k, int col) { return (float)half_at(w.h_b[col * 4 + (k % 8) / 2][k / 8], k % 2); });
}
// movmatrix.m8n8.trans.b16: lane 4 r + k holds row r, columns 2k, 2k + 1 of an 8 x 8 matrix of
// 16-bit elements, and gets the same of its transpose
inline unsigned int movmatrix_trans(unsigned int x) {
    Warp& w = g_warps[t_warp];
    w.exchange[t_lane] = x;
    w.bar->arrive_and_wait();
    unsigned int y = 0;
    for (int h = 0; h < 2; ++h) {  // element (row r, column 2k + h) of the transpose = (2k + h, r)
        const int i = 2 * (t_lane % 4) + h, j = t_lane / 4;
        y |= ((w.exchange[4 * i + j / 2] >> (16 * (j % 2))) & 0xFFFFu) << (16 * h);
    }
    w.bar->arrive_and_wait();
    return y;
}
// ldmatrix.x4 on float pairs: lanes 8i .. 8i + 7 give the row addresses of matrix i (8 x 8 elements);
// lane l takes row l / 4's elements 2 (l % 4) + {0, 1} of matrix i in r[i]
template <typename P, typename T> void load_matrices_x4(P* r, const T* row) {
    static_assert(sizeof(P) == 2 * sizeof(T), "a register holds two elements");
    Warp& w = g_warps[t_warp];
    w.matrix_rows[t_lane] = row;
    w.bar->arrive_and_wait();
    for (int i = 0; i < 4; ++i)
        std::memcpy(&r[i], static_cast<const T*>(w.matrix_rows[8 * i + t_lane / 4]) + 2 * (t_lane % 4), sizeof(P));
    w.bar->arrive_and_wait();  // everyone has read before the next addresses are written
}
// cp.async: the copy done at once (so the waits have nothing to wait for)
inline void copy16_async(void* shared, const void* global, bool valid) {
    if (valid) std::memcpy(shared, global, 16); else std::memset(shared, 0, 16);
}
template <int N, int PF = 0> void copy_async(void* shared, const void* global) { std::memcpy(shared, global, N); }
inline void copies_commit() {}
template <int PENDING> void copies_wait() {}
template <class F> void launch(int blocks_x, int blocks_y, int threads, F body) {
    blockDim = {(unsigned)threads, 1, 1};
    gridDim = {(unsigned)blocks_x, (unsigned)blocks_y, 1};
    for (int y = 0; y < blocks_y; ++y) {
        for (int x = 0; x < blocks_x; ++x) {
            g_block = std::make_unique<std::barrier<>>(threads);
            g_warps = std::vector<Warp>(threads / 32);
            for (auto& w : g_warps) w.bar = std::make_unique<std::barrier<>>(32);
            std::vector<std::thread> pool;
            for (int t = 0; t < threads; ++t) {
                pool.emplace_back([=] {
                    threadIdx = {(unsigned)t, 0, 0};
                    blockIdx = {(unsigned)x, (unsigned)y, 0};
                    t_warp = t / 32;
                    t_lane = t % 32;
                    body();
                });
            }
            for (auto& th : pool) th.join();
        }
    }
}
"""

# the arrays a driver reads and writes, raw (numpy's tofile / fromfile); shared with metal_on_cpu.py
FILE_IO = r"""
template <typename X> std::vector<X> load(const char* path) {
    FILE* f = std::fopen(path, "rb");
    std::fseek(f, 0, SEEK_END);
    const long bytes = std::ftell(f);
    std::fseek(f, 0, SEEK_SET);
    std::vector<X> v(bytes / sizeof(X));
    if (std::fread(v.data(), 1, bytes, f) != (size_t)bytes) std::abort();
    std::fclose(f);
    return v;
}
template <typename X> void save(const char* path, const std::vector<X>& v) {
    FILE* f = std::fopen(path, "wb");
    std::fwrite(v.data(), sizeof(X), v.size(), f);
    std::fclose(f);
}
"""

C_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "__half", np.dtype(np.int32): "int32_t", np.dtype(np.uint32): "uint32_t",
           np.dtype(np.int64): "int64_t"}


def compile_only(source: str, workdir: Path) -> subprocess.CompletedProcess:
    """g++ -fsyntax-only of kernels written after DECLARATIONS (their barriers and shuffles declared)."""
    path = workdir / "kernels.cpp"
    path.write_text(DECLARATIONS + "inline void __syncthreads() {}\ninline void __syncwarp() {}\n"
                    "template <typename X> X __shfl_xor_sync(unsigned int, X v, int) { return v; }\n" + source)
    return subprocess.run([GXX, "-std=c++20", "-fsyntax-only", "-Wall", "-Werror", "-Wno-unknown-pragmas",
                           "-Wno-unused-variable", "-Wno-unused-but-set-variable", str(path)],
                          capture_output=True, text=True)


def run(kernels: str, launches: list[tuple[str, int, int, int, list[str]]], inputs: dict[str, np.ndarray],
        outputs: dict[str, tuple[int, np.dtype]], workdir: Path, init_value=None) -> dict[str, np.ndarray]:
    """Compile `kernels` (C++ kernel functions) and run `launches` in order on the CPU.

    launches: (kernel call prefix, e.g. "attend<float, 64, 4, 128, true>", blocks x, blocks y, threads
    per block, argument names); inputs: name -> array (written to disk, read back by the program);
    outputs: name -> (element count, dtype), zero-initialized (or `init_value`, as MLX's); an output
    may be the input of a later launch. Returns the outputs."""
    arrays = []
    for name, a in inputs.items():
        a = np.ascontiguousarray(a)
        (workdir / f"{name}.bin").write_bytes(a.tobytes())
        arrays.append(f'    auto {name} = load<{C_TYPES[a.dtype]}>("{name}.bin");')
    for name, (count, dtype) in outputs.items():
        fill = "" if init_value is None else f", {init_value!r}"
        arrays.append(f"    std::vector<{C_TYPES[np.dtype(dtype)]}> {name}({count}{fill});")
    calls = []
    for call, blocks_x, blocks_y, threads, args in launches:
        pointers = ", ".join(f"{a}.data()" for a in args)
        calls.append(f"    launch({blocks_x}, {blocks_y}, {threads}, [&] {{ {call}({pointers}); }});")
    saves = [f'    save("{name}.out", {name});' for name in outputs]
    main = "int main() {\n" + "\n".join(arrays + calls + saves) + "\n    return 0;\n}\n"
    binary = build(DECLARATIONS + RUNTIME + FILE_IO, kernels + main, workdir)
    subprocess.run([str(binary)], check=True, timeout=300, cwd=workdir)
    return {name: np.fromfile(workdir / f"{name}.out", dtype=dtype) for name, (count, dtype) in outputs.items()}


_binaries: dict[str, Path] = {}  # program text -> its build (files are read from the working directory)

BUILD_FLAGS = ["-std=c++20", "-O1", "-pthread", "-w"]
PRELUDE = "prelude.h"  # the shim (CUDA's: DECLARATIONS + RUNTIME + FILE_IO), included first by every program


def build(prelude: str, program: str, workdir: Path) -> Path:
    """The binary of `program` (C++ after `#include` of the shim text `prelude`), built in workdir,
    or the build of the same text made earlier in this process (the same kernel, template and sizes)."""
    text = f'#include "{PRELUDE}"\n' + program
    directory = _prelude_dir(prelude)
    binary = _binaries.get(str(directory) + text)
    if binary is None:
        source = workdir / "run.cpp"
        source.write_text(text)
        binary = workdir / "run"
        result = subprocess.run([GXX, *BUILD_FLAGS, "-I", str(directory), str(source), "-o", str(binary)],
                                capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(result.stderr[-3000:])
        _binaries[str(directory) + text] = binary
    return binary


@functools.lru_cache(maxsize=None)
def _prelude_dir(text: str) -> Path:
    """A directory holding PRELUDE (`text`) and its precompiled form (built once per machine and text).

    Parsing the prelude's standard headers (<thread>, <barrier>, ...) took ~1.8 s of each ~2.6 s build;
    with the precompiled header a build takes the kernel's own time. Built into a temporary directory
    and renamed into place, so concurrent test processes never see half a file; where the precompiled
    header cannot be used, g++ reads the plain header next to it (same result, slower)."""
    version = subprocess.run([GXX, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([text, version, *BUILD_FLAGS]).encode()).hexdigest()[:16]
    final = Path(tempfile.gettempdir()) / f"kvcompress-on-cpu-{key}"
    if not (final / f"{PRELUDE}.gch").exists():
        staging = Path(tempfile.mkdtemp(prefix=f"{final.name}-", dir=final.parent))
        (staging / PRELUDE).write_text(text)
        result = subprocess.run([GXX, *BUILD_FLAGS, "-x", "c++-header", str(staging / PRELUDE), "-o",
                                 str(staging / f"{PRELUDE}.gch")], capture_output=True, text=True)
        if result.returncode:
            shutil.rmtree(staging, ignore_errors=True)
            raise RuntimeError(result.stderr[-3000:])
        try:
            os.rename(staging, final)
        except OSError:  # another process has put its (identical) build in place first
            shutil.rmtree(staging, ignore_errors=True)
    return final


# -- mx.fast.cuda_kernel on the CPU -------------------------------------------------------------

_MX_C_TYPES = {"float32": "float", "float16": "__half", "int32": "int32_t", "uint32": "uint32_t"}


class EmulatedKernel:
    """Stands in for `mx.fast.cuda_kernel(...)`: called as MLX calls a kernel (inputs, template,
    grid and threadgroup in threads, output shapes and dtypes), it compiles the body into a C++
    kernel with the signature MLX would give it (`const T* name` per input, `T* name` per output,
    `name_shape` where the body uses it, the template parameters) and runs it with `run`.
    float32 / int32 / uint32 arrays only. Used with `monkeypatch.setattr(mx.fast, "cuda_kernel",
    emulated(tmp_path))`, so a kernel's own Python wrapper (its launch plan) runs unchanged."""

    def __init__(self, workdir: Path, name: str, input_names: list, output_names: list, source: str,
                 header: str = "", **_):
        self.workdir, self.name, self.source, self.header = workdir, name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.calls = 0

    def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template=(), init_value=None, **_):
        import mlx.core as mx

        arrays = {name: np.array(a) for name, a in zip(self.input_names, inputs)}
        params = [f"const {C_TYPES[a.dtype]}* {name}" for name, a in arrays.items()]
        shapes = {}
        for name, a in arrays.items():
            if f"{name}_shape" in self.source:
                shapes[f"{name}_shape"] = np.array(a.shape, np.int32)
                params.append(f"const int32_t* {name}_shape")
        outputs = {name: (int(np.prod(shape)), _np_dtype(dtype))
                   for name, shape, dtype in zip(self.output_names, output_shapes, output_dtypes)}
        params += [f"{C_TYPES[np.dtype(dtype)]}* {name}" for name, (_, dtype) in outputs.items()]
        template_params, template_args = template_parameters(template, _MX_C_TYPES)
        prefix = f"template <{', '.join(template_params)}>\n" if template_params else ""
        kernel = f"{self.header}\n{prefix}__global__ void {self.name}({', '.join(params)}) {{\n{self.source}\n}}\n"
        call = self.name + (f"<{', '.join(template_args)}>" if template_args else "")
        blocks_x, blocks_y = grid[0] // threadgroup[0], grid[1] // threadgroup[1]
        workdir = self.workdir / f"{self.name}_{self.calls}"
        workdir.mkdir(parents=True)
        self.calls += 1
        names = list(arrays) + list(shapes) + list(outputs)
        got = run(kernel, [(call, blocks_x, blocks_y, threadgroup[0], names)], {**arrays, **shapes}, outputs, workdir,
                  init_value)
        return [mx.array(got[name].reshape(shape)) for name, shape in zip(self.output_names, output_shapes)]


def template_parameters(template, c_types: dict[str, str]) -> tuple[list[str], list[str]]:
    """An MLX kernel call's `template` [(name, bool | int | dtype)] as the kernel's template
    parameters ("int D") and the instance's arguments ("128"); c_types: dtype name -> C type."""
    params, args = [], []
    for key, value in template:
        if isinstance(value, bool):
            params.append(f"bool {key}")
            args.append(str(value).lower())
        elif isinstance(value, int):
            params.append(f"int {key}")
            args.append(str(value))
        else:  # a dtype
            params.append(f"typename {key}")
            args.append(c_types[str(value).split(".")[-1]])
    return params, args


def _np_dtype(dtype) -> np.dtype:
    return np.dtype(str(dtype).split(".")[-1])


def emulated(workdir: Path):
    """A replacement for `mx.fast.cuda_kernel` that builds EmulatedKernels writing under workdir."""
    return lambda **kwargs: EmulatedKernel(workdir, **kwargs)
