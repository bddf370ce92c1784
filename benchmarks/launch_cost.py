"""What one `mx.fast.cuda_kernel` launch costs on an MLX CUDA GPU, and what a per-call host-written
argument array adds to it (issue #13: the fused KIVI kernels spend ~45 us per launch, far above
their bytes).

MLX allocates arrays made on the host (`mx.array([...])`) in CUDA managed memory; a kernel that
reads one the host has just written may fault its page over to the GPU. Each case below launches
a chain of N dependent tiny kernels in one graph and reports the time per launch:
  empty              inputs already on the GPU
  host dims [9]      + a fresh 36-byte host array per launch (what the KIVI kernels passed)
  host scalar        + a fresh 4-byte host scalar per launch (MLX's small-block pool)
  shape-encoded      the same integers carried as the shape of a strided view (kernel arguments)
  mlx add            a plain MLX elementwise op, for scale

Usage (a GPU with MLX CUDA): python benchmarks/launch_cost.py [--launches 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

SOURCE_READ = """
    const unsigned int i = threadIdx.x;
    if (i == 0) out[0] = x[0] + (float)EXTRA;
"""


def kernel(name: str, inputs: list[str], extra: str):
    return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=["out"],
                               source=SOURCE_READ.replace("EXTRA", extra), ensure_row_contiguous=False)


def chain(launch, n: int):
    x = mx.zeros((1,), dtype=mx.float32)
    mx.eval(x)

    def build():
        y = x
        for i in range(n):
            y = launch(y, i)
        return y

    return build


def per_launch_us(build, n: int, repeat: int = 15) -> tuple[float, float]:
    """(build+eval, eval only) microseconds per launch, medians."""
    for _ in range(3):
        mx.eval(build())
    both, only = [], []
    for _ in range(repeat):
        mx.synchronize()
        start = time.perf_counter()
        y = build()
        built = time.perf_counter()
        mx.eval(y)
        mx.synchronize()
        end = time.perf_counter()
        both.append((end - start) * 1e6 / n)
        only.append((end - built) * 1e6 / n)
    return statistics.median(both), statistics.median(only)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=256)
    args = parser.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("needs MLX's CUDA back-end and an NVIDIA GPU (these are mx.fast.cuda_kernel timings)")
    n = args.launches
    one = dict(output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(32, 1, 1), threadgroup=(32, 1, 1))

    empty = kernel("lc_empty", ["x"], "0")
    with_dims = kernel("lc_dims", ["x", "dims"], "dims[3]")
    with_scalar = kernel("lc_scalar", ["x", "s"], "s[0]")
    with_shape = kernel("lc_shape", ["x", "d"], "d_shape[1]")
    base = mx.zeros((1,), dtype=mx.float32)
    dims_once = mx.array(list(range(9)), dtype=mx.int32) + 0  # written by the GPU, not the host
    mx.eval(base, dims_once)

    cases = {
        "empty": lambda y, i: empty(inputs=[y], **one)[0],
        "host dims [9]": lambda y, i: with_dims(
            inputs=[y, mx.array([i, 1, 2, 3, 4, 5, 6, 7, 8], dtype=mx.int32)], **one)[0],
        "device dims [9], made once": lambda y, i: with_dims(inputs=[y, dims_once], **one)[0],
        "host scalar": lambda y, i: with_scalar(inputs=[y, mx.array(i, dtype=mx.int32)], **one)[0],
        "shape-encoded": lambda y, i: with_shape(
            inputs=[y, mx.broadcast_to(base, (1, i + 1, 3))], **one)[0],
        "mlx add": lambda y, i: y + 1,
    }
    print(f"device {mx.default_device()}, MLX {mx.__version__}, {n} dependent launches per graph")
    print("| case | build+eval us/launch | eval us/launch |")
    print("|---|---|---|")
    for name, launch in cases.items():
        both, only = per_launch_us(chain(launch, n), n)
        print(f"| {name} | {both:.1f} | {only:.1f} |")


if __name__ == "__main__":
    main()
