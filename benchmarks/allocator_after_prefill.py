"""Decode steps after a long prefill, before and after `mx.clear_cache()`: MLX's allocator state on CUDA.

A prefill in 2048-token chunks without clearing MLX's buffer cache between chunks (what kivi_e2e.py and
the runner did before stop 25; mlx_lm.generate clears after each chunk), then 10 + 10 synchronous
decode steps (median ms each), one step traced for the allocator's CUDA calls (cudaMallocAsync,
cudaMallocManaged, cudaFree, cudaFreeAsync: count and host us; a cudaFree synchronizes the device),
then the same after one `mx.clear_cache()`. Measured on the H200 at 128k, KIVI-2: 21 ms a step with
24 cudaFree (6 ms) a step, 16 ms and none after the clear (KIVI_GPU_NOTES.md, stop 25).

Needs `benchmarks/cupti/build` (see kernel_trace.py). Run on the device:
`source /tmp/mlx-cuda-env.sh && python3 benchmarks/allocator_after_prefill.py --contexts 32768 131072`.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvcompress  # noqa: E402
import mlx.core as mx  # noqa: E402

from kernel_trace import Tracer, read_records  # noqa: E402
from kivi_e2e import CACHES, decode_sync, greedy, llama8b_shaped, prefill, prompts  # noqa: E402

ALLOCATOR_CALLS = ("cudaMallocAsync", "cudaMallocManaged", "cudaFree", "cudaFreeAsync", "cudaMalloc")


def allocator_calls(tracer, model, caches, token, path):
    with tracer.record(path, api=True):
        token = greedy(model(token.reshape(-1, 1), cache=caches))
        mx.eval(token)
    counts, host_ns = collections.Counter(), collections.Counter()
    for start, end, name in read_records(path)[1]:
        if name in ALLOCATOR_CALLS:
            counts[name] += 1
            host_ns[name] += end - start
    return token, ", ".join(f"{name} {counts[name]}x {host_ns[name] / 1e3:.0f} us" for name in sorted(counts)) or "none"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--caches", nargs="+", default=["full", "kivi bits=2"], help=f"labels from {list(CACHES)}")
    args = parser.parse_args()
    tracer = Tracer()
    model = llama8b_shaped(32)
    path = os.path.join(tempfile.mkdtemp(), "trace.tsv")
    gib = 2**30
    print(f"mlx {mx.__version__} {mx.default_device()}, 32 layers, batch 1")
    print("| context | cache | when | steps 1-10 ms | steps 12-21 ms | MLX cache GiB | allocator calls in one step |")
    print("|---|---|---|---|---|---|---|")
    for T in args.contexts:
        for label in args.caches:
            method, params = CACHES[label]
            caches = kvcompress.make_cache(model, method, **params)
            logits, _ = prefill(model, caches, prompts(model, 1, T), clear_buffers=False)
            token = greedy(logits)
            for when in ("after the prefill", "after mx.clear_cache()"):
                if when != "after the prefill":
                    mx.clear_cache()
                first, _, token = decode_sync(model, caches, token, 10, 0)
                token, calls = allocator_calls(tracer, model, caches, token, path)
                second, _, token = decode_sync(model, caches, token, 10, 0)
                print(f"| {T} | {label} | {when} | {first:.2f} | {second:.2f} | {mx.get_cache_memory() / gib:.1f} | "
                      f"{calls} |", flush=True)
            del caches, logits, token
            mx.clear_cache()


if __name__ == "__main__":
    main()
