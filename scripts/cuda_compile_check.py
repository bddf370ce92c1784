"""Compile every CUDA kernel of kvcompress/kernels/ for a GPU architecture without a GPU: NVRTC and
ptxas from NVIDIA's PyPI wheels (fetched once into ~/.cache/kvcompress/cuda, ~130 MB), as MLX
compiles them at run time. Prints each instantiation's registers, spills and shared memory, and
exits 1 if any does not compile. For kernels written away from the device (a session's GPU time
is short): compile errors and register pressure show here first; tests/cuda_on_cpu.py checks
their numbers on the CPU, and only a GPU checks their speed.

Every kernel runs through its own dispatch self-test (kvcompress/kernels/*.py `selftest`), inside
`dispatch.compile_only`: a stand-in for `mx.fast.cuda_kernel` compiles the kernel as MLX would
declare it (an argument per input and output, the template) and returns zeros, and the self-tests'
comparisons are off: so the instantiations compiled are the ones a GPU's first calls would build.

    python scripts/cuda_compile_check.py [--arch sm_90]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the CPU emulator's helpers

import kvcompress  # noqa: E402,F401  (BLAS preload before mlx)
import mlx.core as mx  # noqa: E402

from kvcompress.kernels import dispatch, evict, kivi_attention, kivi_quant  # noqa: E402
from kvcompress.kernels import prompt_scores, scored_attention, turboquant_attention  # noqa: E402
from kvcompress.methods.quantization.turboquant import selftest_case  # noqa: E402
from cuda_on_cpu import template_parameters  # noqa: E402

WHEELS = ("nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12")
CACHE = Path.home() / ".cache" / "kvcompress" / "cuda"
# what MLX's generated source brings before a kernel's header (NVRTC has no <cstdint>)
PRELUDE = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
typedef unsigned char uint8_t;
"""
C_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "int32": "int32_t",
           "uint32": "uint32_t", "uint8": "uint8_t", "int64": "int64_t", "uint64": "uint64_t"}


def toolkit() -> Path:
    """The unpacked wheels (nvidia/cuda_nvrtc, cuda_nvcc, cuda_runtime), fetched on first use."""
    root = CACHE / "unpacked" / "nvidia"
    if not (root / "cuda_nvrtc").is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE / "wheels"),
                        *WHEELS], check=True)
        import zipfile

        for wheel in (CACHE / "wheels").glob("*.whl"):
            zipfile.ZipFile(wheel).extractall(CACHE / "unpacked")
        ptxas = root / "cuda_nvcc" / "bin" / "ptxas"
        ptxas.chmod(0o755)
    return root


class Compiler:
    def __init__(self, arch: str):
        self.root = toolkit()
        self.arch = arch
        self.nvrtc = ctypes.CDLL(str(next((self.root / "cuda_nvrtc" / "lib").glob("libnvrtc.so.*"))))
        self.rows: list[tuple[str, str, str]] = []  # (kernel, instance, ptxas summary or error)
        self.seen: set[str] = set()
        self.failed = 0

    def compile(self, name: str, instance: str, source: str) -> None:
        """Compile `source` with the kernel instance `instance` (a template's name expression, as MLX
        asks NVRTC for it) and record what ptxas reports."""
        if (instance, source) in self.seen:
            return
        self.seen.add((instance, source))
        program = ctypes.c_void_p()
        self.nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0, None, None)
        self.nvrtc.nvrtcAddNameExpression(program, instance.encode())
        options = [f"--gpu-architecture=compute_{self.arch.split('_')[1]}", "--std=c++17", "-default-device",
                   f"-I{self.root / 'cuda_runtime' / 'include'}", f"-I{self.root / 'cuda_nvcc' / 'include'}"]
        argv = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = self.nvrtc.nvrtcCompileProgram(program, len(options), argv)
        size = ctypes.c_size_t()
        self.nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        self.nvrtc.nvrtcGetProgramLog(program, log)
        if status != 0:
            self.failed += 1
            self.rows.append((name, instance, "FAILED: " + " / ".join(
                line for line in log.value.decode().splitlines() if "error" in line)[:600]))
            return
        self.nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        self.nvrtc.nvrtcGetPTX(program, ptx)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.ptx")
            Path(path).write_bytes(ptx.value)
            out = subprocess.run([str(self.root / "cuda_nvcc" / "bin" / "ptxas"), "-v", f"-arch={self.arch}", path,
                                  "-o", os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
        if out.returncode:
            self.failed += 1
            self.rows.append((name, instance, "FAILED (ptxas): " + (out.stderr or out.stdout).strip()[:600]))
            return
        info = [line.split(":", 1)[-1].strip() for line in (out.stdout + out.stderr).splitlines()
                if "registers" in line or "spill" in line]
        self.rows.append((name, instance, "; ".join(info)))


class CompileOnlyKernel:
    """Stands in for mx.fast.cuda_kernel(...): compiles on each new instantiation, returns zeros."""

    def __init__(self, compiler: Compiler, name, input_names, output_names, source, header="", **_):
        self.compiler, self.name, self.source, self.header = compiler, name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)

    def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template=(), **_):
        params = [f"const {C_TYPES[_name(a.dtype)]}* {n}" for n, a in zip(self.input_names, inputs)]
        params += [f"const int32_t* {n}_shape" for n in self.input_names if f"{n}_shape" in self.source]
        params += [f"{C_TYPES[_name(d)]}* {n}" for n, d in zip(self.output_names, output_dtypes)]
        kinds, values = template_parameters(template, C_TYPES)
        signature = f"__global__ void {self.name}({', '.join(params)})"
        prefix = f"template <{', '.join(kinds)}>\n" if kinds else ""
        source = (PRELUDE + self.header + "\n"
                  + prefix + signature + " {\n" + self.source + "\n}\n")
        instance = f"{self.name}<{', '.join(values)}>" if kinds else self.name
        self.compiler.compile(self.name, instance, source)
        return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]


def _name(dtype) -> str:
    return str(dtype).split(".")[-1]


def build_every_kernel() -> None:
    """Every kernel instantiation a GPU's first calls build, through the kernels' own self-tests."""
    for dtype in (mx.float16, mx.bfloat16):
        evict.selftest("cuda", dtype, True, False)
        evict.selftest("cuda", dtype, False, True)
        for bits, per_channel in ((2, True), (4, False)):
            kivi_quant.selftest("cuda", dtype, bits, 32, per_channel)
        kivi_attention.selftest("cuda", dtype, (2, 2, 32, 128, 4, 1, False))
        kivi_attention.selftest("cuda", dtype, (4, 4, 32, 128, 4, 1, False))
        for variant in ((4, 128, True, False, False), (4, 128, False, False, False), (4, 128, True, True, True),
                        (8, 128, True, True, True), (4, 64, True, False, True), (2, 96, True, False, False)):
            scored_attention.selftest("cuda", dtype, variant)
        for variant in ((128, False), (128, True), (64, False)):
            prompt_scores.selftest("cuda", dtype, variant)
    evict.slot_selftest("cuda")
    # TurboQuant bits 2 / 3 / 4 with QJL (1 / 2 / 3-bit key codes) and 4 without, at the documented shape
    # (D 128, 4 rows), and the largest (8 rows); its kernels take float32 queries whatever the model's dtype
    for variant in ((1, 2, 128, 4, True), (2, 3, 128, 4, True), (3, 4, 128, 4, True), (4, 4, 128, 4, False),
                    (3, 4, 128, 8, True), (2, 2, 64, 4, True)):
        turboquant_attention.selftest("cuda", *selftest_case(variant))
    for bits in (2, 4):  # KIVI's tensor-core kernel (fp16; the self-test builds the 2-bit one, 4-bit is opt-in)
        q, keys, values = kivi_attention.random_case(bits, bits, 32, 128, 4, 1, mx.float16)
        kivi_attention.decode_attention_fused(q, keys, values, 128**-0.5, False, bits, bits, 32, "cuda",
                                              tensor_cores=True)
    kivi_attention.decode_attention_fused(q, keys, values, 128**-0.5, False, 4, 4, 32, "cuda", tensor_cores=True,
                                          l2_prefetch=256)  # the prefetch hints' PTX


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90", help="sm_80 (A100), sm_90 (H100/H200), ...")
    args = parser.parse_args()
    compiler = Compiler(args.arch)
    with dispatch.compile_only(lambda **kwargs: CompileOnlyKernel(compiler, **kwargs)):
        build_every_kernel()
    width = max(len(r[1]) for r in compiler.rows)
    for _, instance, info in compiler.rows:
        print(f"{instance:<{width}}  {info}")
    print(f"{len(compiler.rows)} instantiations for {args.arch}, {compiler.failed} failed")
    sys.exit(1 if compiler.failed else 0)


if __name__ == "__main__":
    main()
