"""Run a Metal kernel body on the CPU: the kernel text MLX generates, g++, one OS thread per GPU thread.

`mx.fast.metal_kernel` wraps a body in a kernel whose signature MLX writes from the call (inputs,
dtypes, sizes, template, the attributes the body names). `kernel_text` reproduces that in Python,
following MLX's `mlx/backend/common/metal_kernel.cpp` (`write_signature`, `write_template`,
`make_template_hash`, `metal_kernel`; ml-explore/mlx at 846d176, the 0.32 line; this venv has
mlx 0.32.4) and `get_type_string` (`mlx/backend/common/compiled.cpp`): an input of fewer than 8
elements is `const constant T*` (a 0-d one `const constant T&`), the others `const device T*`;
`name_shape` / `name_strides` / `name_ndim` follow an input whose name the body contains with that
suffix; outputs are `device T*`; each Metal attribute whose name the body contains
(`thread_position_in_grid`, `simdgroup_index_in_threadgroup`, ...) becomes a parameter; a
template becomes `template <...>` plus an explicit instantiation under the name MLX gives it.
Where the installed MLX can write the text itself (it does so without a Metal back-end while an
export traces the call, and prints it with `verbose=True`: `mlx_kernel_text`), every call checks
that the two texts are the same, byte for byte.
MLX puts its `utils.h` (Metal's standard library, `using namespace metal`, `float16_t` = half,
`bfloat16_t` = bfloat) before the header; METAL_SHIM stands in for it.

That text is compiled by g++ behind METAL_SHIM and RUNTIME: address-space qualifiers (`device`,
`constant`, `thread`) vanish and a `threadgroup` array is a static one, shared by the threads of
a threadgroup (threadgroups run one after another); `threadgroup_barrier` and `simdgroup_barrier`
are barriers over the threadgroup and over the SIMD group; SIMD groups are 32 consecutive threads
of the threadgroup (`thread_index_in_threadgroup`), and `simd_shuffle*`, `simd_broadcast`,
`simd_sum` / `simd_max` / `simd_min` / `simd_prefix_*_sum`, `simd_all` / `simd_any` exchange
values through memory between two barriers; `metal::` (and `precise::`, `fast::`) math is glibc's;
`as_type` is a bit copy; `half` is g++'s `_Float16`, `bfloat` a 16-bit float rounded to nearest
even. Grids are in threads as MLX dispatches them (`dispatchThreads`: the threadgroup clipped to
the grid, partial threadgroups at the grid's edges). `EmulatedMetalKernel` stands in for
`mx.fast.metal_kernel`, so a kernel's own Python wrapper (its launch plan) runs unchanged.

Checks a Mac would make, made here too: `address_space_errors` compiles the same text with clang
(where installed) with `device`, `constant` and `threadgroup` as distinct address spaces, so a
pointer of one where the other is expected fails as Metal's compiler fails it (clang's errors on
copying a struct between address spaces, which Metal allows, are not counted); a kernel whose
threadgroup arrays exceed Apple GPUs' 32 KiB, or a threadgroup of more than 1024 threads, is
refused (`MetalLimitError`), as pipeline creation refuses it.

What the shim cannot check: the Metal compiler's own diagnostics and language rules beyond the
address spaces (clang's C++20 is more permissive than the Metal Shading Language; g++ ignores the
`clang loop unroll` pragmas); a pipeline's real thread limit (it depends on the registers the
compiler allocates, at most 1024); real SIMD-group scheduling (here every lane of a group reaches
each collective; divergent collectives that a GPU would run with some lanes inactive deadlock or
read stale values here, and the order of `simd_sum`'s additions is lane order); memory-model races
the barriers hide; threadgroup memory is zero at first and keeps its values between threadgroups
(on a GPU it is undefined); the GPU's math library (exp2, log: glibc here) and fast-math
contractions; speed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from cuda_on_cpu import FILE_IO, GXX, build
from kvcompress.kernels.dispatch import METAL_CONSTANT_BELOW as MAX_CONSTANT_ARRAY_SIZE  # metal_kernel.cpp's name
from kvcompress.kernels.dispatch import METAL_THREADGROUP_MEMORY as THREADGROUP_MEMORY_LIMIT

CLANG = shutil.which("clang++")
MAX_THREADS_PER_THREADGROUP = 1024  # Metal's upper bound; a pipeline's own may be lower

# metal_kernel.cpp's `metal_attributes`, in its order (the parameters follow this order)
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]

# compiled.cpp's get_type_string, by MLX dtype name
TYPE_STRINGS = {"float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t", "float64": "double",
                "bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
                "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t"}
NUMPY_DTYPES = {"bfloat16": np.uint16}  # numpy has no bfloat16: its bits travel as uint16


def dtype_name(dtype) -> str:
    return str(dtype).split(".")[-1]


def kernel_text(name: str, input_names: list[str], output_names: list[str], source: str, header: str,
                inputs: list[tuple[str, tuple]], output_dtypes: list[str], template=(),
                atomic_outputs: bool = False) -> tuple[str, str, list[tuple[str, str]]]:
    """What MLX compiles for one call of `mx.fast.metal_kernel(name, ...)`.

    inputs: (dtype name, shape) per input; output_dtypes: dtype names; template: [(name, bool | int |
    dtype)]. Returns (kernel name, kernel text, parameters in order as (kind, name): kind "input",
    "scalar" (a 0-d input), "shape", "strides", "ndim", "output" or "attribute")."""
    shape_infos = [tuple(f"{n}{suffix}" in source for suffix in ("_shape", "_strides", "_ndim")) for n in input_names]
    attributes = [(attr, kind) for attr, kind in METAL_ATTRIBUTES if attr in source]

    kernel_name = "custom_kernel_" + name
    template_def = ""
    if template:
        template_def = "<" + ", ".join(_template_value(v) for _, v in template) + ">"
        kernel_name += "_" + _template_hash(template_def)
    for dtype, shape in inputs:
        kernel_name += "_" + TYPE_STRINGS[dtype]
        size = int(np.prod(shape, dtype=np.int64))
        kernel_name += "s" if len(shape) == 0 else "c" if size < MAX_CONSTANT_ARRAY_SIZE else ""
    for dtype in output_dtypes:
        kernel_name += "_" + TYPE_STRINGS[dtype]

    # write_signature
    text = header
    if template:
        kinds = ["bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename" for _, v in template]
        text += "template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, template)) + ">\n"
    text += f"[[kernel]] void {kernel_name}(\n"
    params: list[tuple[str, str]] = []
    index = 0
    for (dtype, shape), n, info in zip(inputs, input_names, shape_infos):
        location = "constant" if int(np.prod(shape, dtype=np.int64)) < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if len(shape) == 0 else "*"
        text += f"  const {location} {TYPE_STRINGS[dtype]}{ref} {n} [[buffer({index})]],\n"
        params.append(("scalar" if len(shape) == 0 else "input", n))
        index += 1
        if len(shape) > 0:
            for wanted, suffix, kind in zip(info, ("_shape", "_strides", "_ndim"),
                                            ("const constant int*", "const constant int64_t*", "const constant int&")):
                if wanted:
                    text += f"  {kind} {n}{suffix} [[buffer({index})]],\n"
                    params.append((suffix[1:], n))
                    index += 1
    for n, dtype in zip(output_names, output_dtypes):
        t = f"atomic<{TYPE_STRINGS[dtype]}>" if atomic_outputs else TYPE_STRINGS[dtype]
        text += f"  device {t}* {n} [[buffer({index})]]"
        # MLX's own condition, buffer index against the number of inputs and outputs
        text += ",\n" if index < len(inputs) + len(output_names) - 1 or attributes else ") {\n"
        params.append(("output", n))
        index += 1
    for i, (attr, kind) in enumerate(attributes):
        text += f"  {kind} {attr} [[{attr}]]" + (",\n" if i < len(attributes) - 1 else ") {\n")
        params.append(("attribute", attr))
    text += source + "\n}\n"
    if template:
        instance = kernel_name + template_def
        text += f'\ntemplate [[host_name("{kernel_name}")]] [[kernel]] decltype({instance}) {instance};\n'
    return kernel_name, text, params


def mlx_kernel_text(make, kernel_args: dict, inputs: list, call_args: dict, workdir: Path) -> str | None:
    """The kernel text the installed MLX writes for one call, or None where it cannot here.

    make: the real `mx.fast.metal_kernel`. Without a Metal back-end MLX still builds the kernel's
    text while `mx.export_function` traces a call (metal_kernel.cpp: `in_export_tracing`), and
    `verbose=True` prints it to the process's standard output (C++'s, so fd 1 is redirected)."""
    import mlx.core as mx

    kernel = make(**kernel_args)

    def call(*arrays):
        return kernel(inputs=list(arrays), **call_args, verbose=True)

    printed = workdir / "mlx_kernel_text.txt"
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(printed, "w") as sink:
            os.dup2(sink.fileno(), 1)
            try:
                mx.export_function(str(workdir / "kernel.mlxfn"), call, *inputs)
            except (RuntimeError, ValueError):  # an MLX that needs a Metal back-end for this
                return None
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    text = printed.read_text()
    if "```\n" not in text:
        return None
    return text.split("```\n", 1)[1].rsplit("\n```", 1)[0]  # between the fences, less std::endl's newline


def _template_value(value) -> str:
    # write_template streams the value: a bool as 1 / 0 (no boolalpha), a dtype as its type string
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    return TYPE_STRINGS[dtype_name(value)]


def _template_hash(template_def: str) -> str:
    # make_template_hash: '<' and '>' to '_', ", " to '_', the last character dropped
    return template_def.replace("<", "_").replace(">", "_").replace(", ", "_")[:-1]


# -- the shim: MLX's utils.h and Metal's standard library, as far as the kernels here use them --------

METAL_SHIM = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;
struct uint2 { uint x, y; };
struct uint3 { uint x, y, z; };
struct alignas(16) uint4 { uint x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
HALF_TYPES
typedef half float16_t;
typedef bfloat bfloat16_t;
template <typename To, typename From> To as_type(From x) {
    static_assert(sizeof(To) == sizeof(From), "as_type: same size");
    To y; std::memcpy(&y, &x, sizeof(To)); return y;
}
enum class mem_flags : unsigned int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return (mem_flags)((unsigned int)a | (unsigned int)b); }
namespace metal {
using std::min; using std::max; using std::fmin; using std::fmax; using std::fabs; using std::abs;
using std::exp; using std::exp2; using std::log; using std::log2; using std::sqrt; using std::fma;
using std::floor; using std::ceil; using std::round; using std::rint; using std::trunc; using std::isnan; using std::isinf;
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
namespace precise {
using std::fmin; using std::fmax; using std::fabs; using std::exp; using std::exp2; using std::log; using std::log2;
using std::sqrt; using std::fma; using metal::rsqrt;
}
namespace fast {
using std::fmin; using std::fmax; using std::fabs; using std::exp; using std::exp2; using std::log; using std::log2;
using std::sqrt; using std::fma; using metal::rsqrt;
}
}
using namespace metal;
"""

# half: g++'s _Float16 for running; the check needs only 16-bit arithmetic types (clang 14 on x86 has neither
# _Float16 nor __bf16, and a class type would not convert from device memory as Metal's half does)
RUN_HALF = "using half = _Float16;\n" + r"""
// bfloat: the high 16 bits of a float, rounded to nearest even (as Metal's bfloat and MLX's bf16.h)
struct bfloat {
    uint16_t bits;
    bfloat() = default;
    bfloat(float f) {
        uint32_t u; std::memcpy(&u, &f, 4);
        bits = std::isnan(f) ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
    }
    operator float() const { const uint32_t u = (uint32_t)bits << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
"""
CHECK_HALF = "using half = __fp16;\nusing bfloat = __fp16;"

# barriers and SIMD-group collectives over OS threads
RUNTIME = r"""
#include <barrier>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>
struct SimdGroup { std::unique_ptr<std::barrier<>> bar; int size; alignas(8) unsigned char exchange[32][8]; };
struct ThreadPlace {
    uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid,
          threads_per_threadgroup, dispatch_threads_per_threadgroup, threadgroups_per_grid, threads_per_grid,
          grid_size, grid_origin;
    uint thread_index_in_threadgroup, simdgroup_index_in_threadgroup, thread_index_in_simdgroup,
         simdgroups_per_threadgroup, dispatch_simdgroups_per_threadgroup, threads_per_simdgroup,
         thread_execution_width, quadgroup_index_in_threadgroup, thread_index_in_quadgroup,
         quadgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};
thread_local ThreadPlace t_place;
static std::vector<SimdGroup> g_simd;
static std::unique_ptr<std::barrier<>> g_group;
inline void threadgroup_barrier(mem_flags) { g_group->arrive_and_wait(); }
inline void simdgroup_barrier(mem_flags) { g_simd[t_place.simdgroup_index_in_threadgroup].bar->arrive_and_wait(); }
// every lane writes its value, then reads lane pick(lane) (its own value where that lane does not exist)
template <typename X, typename F> X simd_read(X v, F pick) {
    static_assert(sizeof(X) <= 8, "SIMD values of up to 8 bytes");
    SimdGroup& s = g_simd[t_place.simdgroup_index_in_threadgroup];
    const int lane = (int)t_place.thread_index_in_simdgroup;
    std::memcpy(s.exchange[lane], &v, sizeof(X));
    s.bar->arrive_and_wait();
    const int from = pick(lane);
    X r = v;
    if (from >= 0 && from < s.size) std::memcpy(&r, s.exchange[from], sizeof(X));
    s.bar->arrive_and_wait();  // everyone has read before the next exchange is written
    return r;
}
// every lane writes its value, then folds lanes [0, last(lane)) in lane order
template <typename X, typename Op> X simd_fold(X v, X start, Op op, bool inclusive, bool prefix) {
    SimdGroup& s = g_simd[t_place.simdgroup_index_in_threadgroup];
    const int lane = (int)t_place.thread_index_in_simdgroup;
    std::memcpy(s.exchange[lane], &v, sizeof(X));
    s.bar->arrive_and_wait();
    X r = start;
    const int last = prefix ? lane + (inclusive ? 1 : 0) : s.size;
    for (int i = 0; i < last; ++i) { X x; std::memcpy(&x, s.exchange[i], sizeof(X)); r = op(r, x); }
    s.bar->arrive_and_wait();
    return r;
}
template <typename X> X simd_shuffle_xor(X v, ushort mask) { return simd_read(v, [=](int l) { return l ^ (int)mask; }); }
template <typename X> X simd_shuffle(X v, ushort lane) { return simd_read(v, [=](int) { return (int)lane; }); }
template <typename X> X simd_broadcast(X v, ushort lane) { return simd_read(v, [=](int) { return (int)lane; }); }
template <typename X> X simd_broadcast_first(X v) { return simd_read(v, [](int) { return 0; }); }
template <typename X> X simd_shuffle_down(X v, ushort delta) { return simd_read(v, [=](int l) { return l + (int)delta; }); }
template <typename X> X simd_shuffle_up(X v, ushort delta) { return simd_read(v, [=](int l) { return l - (int)delta; }); }
template <typename X> X simd_sum(X v) { return simd_fold(v, X(0), [](X a, X b) { return a + b; }, false, false); }
template <typename X> X simd_max(X v) { return simd_fold(v, v, [](X a, X b) { return metal::max(a, b); }, false, false); }
template <typename X> X simd_min(X v) { return simd_fold(v, v, [](X a, X b) { return metal::min(a, b); }, false, false); }
template <typename X> X simd_prefix_inclusive_sum(X v) { return simd_fold(v, X(0), [](X a, X b) { return a + b; }, true, true); }
template <typename X> X simd_prefix_exclusive_sum(X v) { return simd_fold(v, X(0), [](X a, X b) { return a + b; }, false, true); }
inline bool simd_all(bool v) { return simd_fold(v, true, [](bool a, bool b) { return a && b; }, false, false); }
inline bool simd_any(bool v) { return simd_fold(v, false, [](bool a, bool b) { return a || b; }, false, false); }
// MLX's dispatch: dispatchThreads(grid, threadgroup clipped to the grid); threadgroups one after another
template <class F> void launch(uint3 grid, uint3 group, F body) {
    group = {std::min(group.x, grid.x), std::min(group.y, grid.y), std::min(group.z, grid.z)};
    const uint3 groups = {(grid.x + group.x - 1) / group.x, (grid.y + group.y - 1) / group.y, (grid.z + group.z - 1) / group.z};
    for (uint gz = 0; gz < groups.z; ++gz) for (uint gy = 0; gy < groups.y; ++gy) for (uint gx = 0; gx < groups.x; ++gx) {
        const uint3 size = {std::min(group.x, grid.x - gx * group.x), std::min(group.y, grid.y - gy * group.y),
                            std::min(group.z, grid.z - gz * group.z)};  // a partial threadgroup at the edges
        const int n = (int)(size.x * size.y * size.z);
        const int nominal = (int)(group.x * group.y * group.z);
        g_group = std::make_unique<std::barrier<>>(n);
        g_simd = std::vector<SimdGroup>((n + 31) / 32);
        for (int i = 0; i < (int)g_simd.size(); ++i) {
            g_simd[i].size = std::min(32, n - 32 * i);
            g_simd[i].bar = std::make_unique<std::barrier<>>(g_simd[i].size);
        }
        std::vector<std::thread> pool;
        for (int t = 0; t < n; ++t) {
            pool.emplace_back([=] {
                ThreadPlace& p = t_place;
                const uint3 local = {t % size.x, (t / size.x) % size.y, t / (size.x * size.y)};
                p.thread_position_in_threadgroup = local;
                p.threadgroup_position_in_grid = {gx, gy, gz};
                p.thread_position_in_grid = {gx * group.x + local.x, gy * group.y + local.y, gz * group.z + local.z};
                p.threads_per_threadgroup = size;
                p.dispatch_threads_per_threadgroup = group;
                p.threadgroups_per_grid = groups;
                p.threads_per_grid = grid;
                p.grid_size = grid;
                p.grid_origin = {0, 0, 0};
                p.thread_index_in_threadgroup = t;
                p.simdgroup_index_in_threadgroup = t / 32;
                p.thread_index_in_simdgroup = t % 32;
                p.simdgroups_per_threadgroup = (n + 31) / 32;
                p.dispatch_simdgroups_per_threadgroup = (nominal + 31) / 32;
                p.threads_per_simdgroup = 32;
                p.thread_execution_width = 32;
                p.quadgroup_index_in_threadgroup = t / 4;
                p.thread_index_in_quadgroup = t % 4;
                p.quadgroups_per_threadgroup = (n + 3) / 4;
                p.dispatch_quadgroups_per_threadgroup = (nominal + 3) / 4;
                body();
            });
        }
        for (auto& th : pool) th.join();
    }
}
"""

# Metal's address-space qualifiers, after everything that uses the same words (std::thread): for
# running, all one memory; a threadgroup array is one per kernel instance, used by one threadgroup at a time
RUN_QUALIFIERS = """
#define device
#define constant
#define thread
#define threadgroup static
"""

# for the address-space check: the three spaces distinct (clang), the collectives only declared
CHECK_QUALIFIERS = """
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup static __attribute__((address_space(3)))
#define thread
inline void threadgroup_barrier(mem_flags) {}
inline void simdgroup_barrier(mem_flags) {}
template <typename X> X simd_shuffle_xor(X v, ushort) { return v; }
template <typename X> X simd_shuffle(X v, ushort) { return v; }
template <typename X> X simd_broadcast(X v, ushort) { return v; }
template <typename X> X simd_broadcast_first(X v) { return v; }
template <typename X> X simd_shuffle_down(X v, ushort) { return v; }
template <typename X> X simd_shuffle_up(X v, ushort) { return v; }
template <typename X> X simd_sum(X v) { return v; }
template <typename X> X simd_max(X v) { return v; }
template <typename X> X simd_min(X v) { return v; }
template <typename X> X simd_prefix_inclusive_sum(X v) { return v; }
template <typename X> X simd_prefix_exclusive_sum(X v) { return v; }
inline bool simd_all(bool v) { return v; }
inline bool simd_any(bool v) { return v; }
"""


class MetalLimitError(RuntimeError):
    """A launch that pipeline creation on an Apple GPU refuses (threadgroup memory, threads)."""


# clang errors on copying a class object between address spaces (its implicit copy and move members
# take generic references); Metal copies such structs (a 16-byte chunk read from device memory into a
# thread's variable) as it copies scalars. The same text compiles with g++ without address spaces, so
# these two messages can only come from such copies: they are not counted.
_COPIES_METAL_ALLOWS = ("no viable overloaded '='", "no matching constructor for initialization of")


def address_space_errors(text: str, workdir: Path) -> list[str]:
    """clang -fsyntax-only of a kernel text (`kernel_text`'s) with Metal's address spaces distinct:
    the errors Metal's compiler would also give (each with its notes), none where it compiles.

    clang's C++ has no `[[host_name]]` / `[[kernel]]` on an explicit instantiation: those attributes
    are dropped from it (the instantiation stays, so the template is checked as instantiated)."""
    text = re.sub(r"template \[\[host_name\(\"[^\"]*\"\)\]\] \[\[kernel\]\] ", "template ", text)
    path = workdir / "address_spaces.cpp"
    path.write_text(METAL_SHIM.replace("HALF_TYPES", CHECK_HALF) + CHECK_QUALIFIERS + text)
    result = subprocess.run([CLANG, "-std=c++20", "-fsyntax-only", "-ferror-limit=0", "-Wno-unknown-attributes",
                             "-Wno-ignored-attributes", "-Wno-unknown-pragmas", str(path)], capture_output=True, text=True)
    errors = re.split(r"\n(?=\S+:\d+:\d+: error: )", "\n" + result.stderr)
    return [e.strip() for e in errors if ": error: " in e and not any(m in e for m in _COPIES_METAL_ALLOWS)]


def threadgroup_bytes(binary: Path, kernel_name: str) -> int:
    """Bytes of the kernel's `threadgroup` arrays: its static locals in the binary's symbol table."""
    symbols = subprocess.run(["nm", "-C", "-S", "--defined-only", str(binary)], capture_output=True, text=True,
                             check=True).stdout
    total = 0
    for line in symbols.splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[3].startswith(kernel_name) and ")::" in parts[3]:
            total += int(parts[1], 16)
    return total


class EmulatedMetalKernel:
    """Stands in for `mx.fast.metal_kernel(...)`: called as MLX calls a kernel, it writes the kernel
    text MLX would compile (`kernel_text`), checks its address spaces with clang (where installed),
    compiles it with g++ behind the shim and runs it with one OS thread per GPU thread. Inputs are
    passed row-contiguous (MLX's `ensure_row_contiguous=True`, the default every kernel here keeps).
    Used with `monkeypatch.setattr(mx.fast, "metal_kernel", emulated(tmp_path))`."""

    def __init__(self, workdir: Path, name: str, input_names: list, output_names: list, source: str,
                 header: str = "", ensure_row_contiguous: bool = True, atomic_outputs: bool = False,
                 compile_options=None):
        if atomic_outputs:
            raise NotImplementedError("metal_on_cpu: atomic outputs are not emulated")
        self.workdir, self.name, self.source, self.header = workdir, name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.kernel_args = dict(name=name, input_names=input_names, output_names=output_names, source=source,
                                header=header, ensure_row_contiguous=ensure_row_contiguous)
        self.calls = 0
        self.texts: list[str] = []  # every kernel text compiled, for tests to read
        self.same_as_mlx = 0  # calls whose text the installed MLX wrote too, the same

    def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, init_value=None,
                 verbose=False, stream=None):
        import mlx.core as mx

        if int(np.prod(threadgroup)) > MAX_THREADS_PER_THREADGROUP:
            raise MetalLimitError(f"{self.name}: threadgroup of {int(np.prod(threadgroup))} threads "
                                  f"> {MAX_THREADS_PER_THREADGROUP}")
        dtypes = [dtype_name(a.dtype) for a in inputs]
        arrays = [np.array(a.view(mx.uint16) if d == "bfloat16" else a) for a, d in zip(inputs, dtypes)]
        out_dtypes = [dtype_name(d) for d in output_dtypes]
        kernel_name, text, params = kernel_text(self.name, self.input_names, self.output_names, self.source,
                                                self.header, [(d, a.shape) for d, a in zip(dtypes, arrays)],
                                                out_dtypes, template or ())
        self.texts.append(text)
        workdir = self.workdir / f"{self.name}_{self.calls}"
        workdir.mkdir(parents=True)
        self.calls += 1
        call_args = dict(output_shapes=output_shapes, output_dtypes=output_dtypes, grid=grid, threadgroup=threadgroup,
                         template=template)
        mlx_text = mlx_kernel_text(MLX_METAL_KERNEL, self.kernel_args, inputs, call_args, workdir)
        if mlx_text is not None and mlx_text != text:
            raise AssertionError(f"kernel_text differs from the installed MLX's text for {kernel_name}:\n{mlx_text}")
        self.same_as_mlx += mlx_text is not None
        if CLANG is not None:
            errors = _address_space_checks.get(text)
            if errors is None:  # the same text again (a self-test after a test's case): checked once
                errors = _address_space_checks[text] = address_space_errors(text, workdir)
            if errors:
                raise RuntimeError(f"{kernel_name} does not compile with Metal's address spaces:\n"
                                   + "\n".join(errors)[-3000:])

        lines = []
        by_name = dict(zip(self.input_names, zip(arrays, dtypes)))
        for n, (a, d) in by_name.items():
            (workdir / f"{n}.bin").write_bytes(np.ascontiguousarray(a).tobytes())
            lines.append(f'    auto {n} = load<{TYPE_STRINGS[d]}>("{n}.bin");')
            strides = np.cumprod((1,) + a.shape[:0:-1])[::-1] if a.ndim else ()
            lines.append(f"    std::vector<int> {n}_shape = {{{', '.join(map(str, a.shape))}}};")
            lines.append(f"    std::vector<int64_t> {n}_strides = {{{', '.join(str(int(s)) for s in strides)}}};")
            lines.append(f"    int {n}_ndim = {a.ndim};")
        sizes = [int(np.prod(s, dtype=np.int64)) for s in output_shapes]
        for n, d, size in zip(self.output_names, out_dtypes, sizes):
            fill = "" if init_value is None else f", {TYPE_STRINGS[d]}({float(init_value)!r}f)"
            lines.append(f"    std::vector<{TYPE_STRINGS[d]}> {n}({size}{fill});")
        arguments = []
        for kind, n in params:
            arguments.append({"input": f"{n}.data()", "scalar": f"{n}[0]", "shape": f"{n}_shape.data()",
                              "strides": f"{n}_strides.data()", "ndim": f"{n}_ndim", "output": f"{n}.data()",
                              "attribute": f"t_place.{n}"}[kind])
        call = kernel_name + ("<" + ", ".join(_template_value(v) for _, v in template) + ">" if template else "")
        uint3 = "uint3{%d, %d, %d}"
        lines.append(f"    launch({uint3 % tuple(grid)}, {uint3 % tuple(threadgroup)}, [&] {{ {call}({', '.join(arguments)}); }});")
        lines += [f'    save("{n}.out", {n});' for n in self.output_names]
        main = "int main() {\n" + "\n".join(lines) + "\n    return 0;\n}\n"
        binary = build(METAL_SHIM.replace("HALF_TYPES", RUN_HALF) + RUNTIME + FILE_IO + RUN_QUALIFIERS, text + main, workdir)
        used = threadgroup_bytes(binary, kernel_name)
        if used > THREADGROUP_MEMORY_LIMIT:
            raise MetalLimitError(f"{kernel_name}: {used} bytes of threadgroup memory > {THREADGROUP_MEMORY_LIMIT}")
        subprocess.run([str(binary)], check=True, timeout=300, cwd=workdir)
        outs = []
        for n, d, shape in zip(self.output_names, out_dtypes, output_shapes):
            got = np.fromfile(workdir / f"{n}.out", dtype=NUMPY_DTYPES.get(d, d)).reshape(shape)
            outs.append(mx.array(got).view(mx.bfloat16) if d == "bfloat16" else mx.array(got))
        return outs


_address_space_checks: dict[str, list[str]] = {}  # kernel text -> address_space_errors


def _real_metal_kernel():
    import mlx.core as mx

    return mx.fast.metal_kernel


MLX_METAL_KERNEL = _real_metal_kernel()  # before any test replaces it


def emulated(workdir: Path):
    """A replacement for `mx.fast.metal_kernel` that builds EmulatedMetalKernels writing under workdir."""
    return lambda **kwargs: EmulatedMetalKernel(workdir, **kwargs)


__all__ = ["GXX", "CLANG", "EmulatedMetalKernel", "MetalLimitError", "emulated", "kernel_text", "address_space_errors"]
