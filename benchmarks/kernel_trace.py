"""Where a decode step's time goes on a CUDA GPU: the host's two phases and the GPU's kernels, per cache.

MLX's CUDA back-end records a step's kernels into CUDA graphs (100 nodes each on an H200) and launches a
graph only once it is recorded, so a synchronous step is three phases one after the other: the host
builds the step's lazy graph (Python: the model and the cache's methods), then `mx.eval` encodes it
(MLX's C++ per operation, and CUDA graph calls) until the first graph starts, then the GPU runs while
the host encodes the rest. This benchmark measures the three from one time line: CUPTI's activity
records of every kernel (GPU start and end, no replay: kernels run as they do untraced) and marks taken
on CUPTI's clock around the model call and `mx.eval`
(`benchmarks/cupti/ktrace.c`, loaded with ctypes; build it here with `bash benchmarks/cupti/build.sh`
and carry `benchmarks/cupti/build` to the device).

For each context and cache (kivi_e2e.py's model and cache labels), the cache is filled directly with
random keys and values (`--fill direct`: one `update_and_fetch` of the whole context a layer, no model
prefill) or by a prefill of a random prompt (`--fill prefill`), decodes `--warmup` steps, then
`--steps` traced steps each with and without attention (attention_in_model.py's `AttentionLeftOut`);
medians in us: wall, build, eval until the first kernel, the GPU's span (first kernel start to last
kernel end) and active time (the union of kernel intervals), the attention kernels' time a layer, and
the largest kernel groups. `--api` traces one more step with the host's CUDA API calls and sums them
over the two host phases (cudaFree and cudaMallocManaged there mean allocator churn).

Run on the device: `source /tmp/mlx-cuda-env.sh && python3 benchmarks/kernel_trace.py --contexts 32768`.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvcompress  # noqa: E402
import mlx.core as mx  # noqa: E402

from attention_in_model import AttentionLeftOut  # noqa: E402
from host_graph import cache_arrays  # noqa: E402
from kivi_e2e import CACHES, greedy, llama8b_shaped, prefill, prompts  # noqa: E402

LIBRARY = Path(__file__).resolve().parent / "cupti" / "build" / "libktrace.so"
# kernels that compute decode attention: cuDNN's SDPA and its reduction, this project's kernels
ATTENTION = re.compile(r"sdpa|lean_reduction|kivi_decode|scored_")


class Tracer:
    """ktrace.c through ctypes: `record(path, api)` around the work to trace; `now()` on CUPTI's clock."""

    def __init__(self, library: Path = LIBRARY):
        if not library.exists():
            raise SystemExit(f"{library} is missing: run `bash benchmarks/cupti/build.sh` and carry "
                             "benchmarks/cupti/build to the device")
        self.lib = ctypes.CDLL(str(library))
        self.lib.ktrace_start.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self.lib.ktrace_now.restype = ctypes.c_ulonglong

    def now(self) -> int:
        return self.lib.ktrace_now()

    def record(self, path: str, api: bool = False):
        tracer = self

        class Recording:
            def __enter__(self):
                mx.synchronize()
                if tracer.lib.ktrace_start(path.encode(), int(api)):
                    raise RuntimeError("CUPTI did not start recording")

            def __exit__(self, *exc):
                mx.synchronize()
                tracer.lib.ktrace_stop()

        return Recording()


def kernel_group(name: str) -> str:
    """A short name: MLX's `mlx::core::cu::<name>` or a custom kernel's name without its source hash."""
    match = re.match(r"_ZN3mlx4core2cu(\d+)", name)
    if match:
        start = match.end()
        name = name[start : start + int(match.group(1))]
    name = re.sub(r"^custom_kernel_", "", name)
    return re.sub(r"_[0-9a-f]{8}$", "", name)[:48]


def read_records(path: str):
    """(GPU intervals [(start, end, group)], API calls [(start, end, name)]) from ktrace.c's file."""
    gpu, api = [], []
    with open(path) as f:
        for line in f:
            kind, start, end, *_, name = line.rstrip("\n").split("\t")
            if kind in ("kernel", "memcpy", "memset"):
                gpu.append((int(start), int(end), kernel_group(name) if kind == "kernel" else kind))
            else:
                api.append((int(start), int(end), name.split("_v")[0]))
    return sorted(gpu), api


def active_ns(intervals) -> int:
    """The union of the intervals' lengths (kernels of one graph may overlap)."""
    total, cur_start, cur_end = 0, None, None
    for start, end, _ in intervals:
        if cur_end is None or start > cur_end:
            total += 0 if cur_end is None else cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (0 if cur_end is None else cur_end - cur_start)


def traced_step(tracer: Tracer, model, caches, token, path: str, api: bool = False):
    """One synchronous step under the tracer: (next token, phases in us, kernel groups {group: us})."""
    with tracer.record(path, api):
        t0 = tracer.now()
        token = greedy(model(token.reshape(-1, 1), cache=caches))
        arrays = [cache_arrays(c) for c in caches]
        t1 = tracer.now()
        mx.eval(token, arrays)
        t2 = tracer.now()
    gpu, calls = read_records(path)
    first, last = gpu[0][0], max(end for _, end, _ in gpu)
    phases = dict(wall=t2 - t0, build=t1 - t0, to_first_kernel=first - t1, gpu_span=last - first,
                  gpu_active=active_ns(gpu))
    groups = collections.Counter()
    for start, end, group in gpu:
        groups[group] += end - start
    phases["attention"] = sum(ns for group, ns in groups.items() if ATTENTION.search(group))
    api_sums = None
    if api:
        api_sums = {}
        for label, lo, hi in (("encode before the GPU starts", t1, first), ("rest of eval", first, t2)):
            sums = collections.Counter()
            for start, end, name in calls:
                if lo <= start < hi:
                    sums[name] += end - start
            api_sums[label] = sums
    return token, {k: v / 1e3 for k, v in phases.items()}, {k: v / 1e3 for k, v in groups.items()}, api_sums


def filled(model, label: str, T: int, fill: str):
    method, params = CACHES[label]
    caches = kvcompress.make_cache(model, method, **params)
    if fill == "prefill":
        logits, _ = prefill(model, caches, prompts(model, 1, T))
        return caches, greedy(logits)
    shape = (1, model.args.num_key_value_heads, T, model.args.head_dim)
    for cache in caches:
        keys = (0.5 * mx.random.normal(shape)).astype(mx.float16)
        values = mx.random.normal(shape).astype(mx.float16)
        cache.update_and_fetch(keys, values)
        mx.eval(cache_arrays(cache))
    return caches, mx.zeros((1,), dtype=mx.int32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768])
    parser.add_argument("--caches", nargs="+", default=["full", "kivi bits=2"], help=f"labels from {list(CACHES)}")
    parser.add_argument("--fill", choices=["direct", "prefill"], default="direct")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="traced steps each way (medians)")
    parser.add_argument("--api", action="store_true", help="one more step with the host's CUDA API calls")
    args = parser.parse_args()
    tracer = Tracer()
    model = llama8b_shaped(args.layers)
    path = os.path.join(tempfile.mkdtemp(), "trace.tsv")
    print(f"mlx {mx.__version__} {mx.default_device()}, {args.layers} layers, batch 1, fill {args.fill}; us, medians "
          f"of {args.steps} traced steps")
    print("| context | cache | attention | wall | build | eval to first kernel | GPU span | GPU active | "
          "attention kernels a layer | largest kernel groups |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for T in args.contexts:
        for label in args.caches:
            caches, token = filled(model, label, T, args.fill)
            for _ in range(args.warmup):
                token = greedy(model(token.reshape(-1, 1), cache=caches))
                mx.eval(token)
            for variant in ("with", "without"):
                runs, groups = [], collections.Counter()
                for _ in range(args.steps):
                    if variant == "with":
                        token, phases, kernels, _ = traced_step(tracer, model, caches, token, path)
                    else:
                        with AttentionLeftOut(caches):
                            token, phases, kernels, _ = traced_step(tracer, model, caches, token, path)
                    runs.append(phases)
                    groups.update({k: v / args.steps for k, v in kernels.items()})
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                top = ", ".join(f"{g} {us:.0f}" for g, us in groups.most_common(5))
                print(f"| {T} | {label} | {variant} | {med['wall']:.0f} | {med['build']:.0f} | "
                      f"{med['to_first_kernel']:.0f} | {med['gpu_span']:.0f} | {med['gpu_active']:.0f} | "
                      f"{med['attention'] / args.layers:.1f} | {top} |", flush=True)
            if args.api:
                token, phases, _, sums = traced_step(tracer, model, caches, token, path, api=True)
                for phase, calls in sums.items():
                    top = ", ".join(f"{name} {ns / 1e3:.0f}" for name, ns in calls.most_common(6))
                    print(f"|   | {label}: API us in {phase} |   | {phases['wall']:.0f} |   |   |   |   |   | {top} |")
            del caches
            mx.clear_cache()


if __name__ == "__main__":
    main()
