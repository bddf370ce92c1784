"""Where a decode step's host time goes, full cache against the compressed ones (H200 question:
pipelined decode hides less for the scoring methods than for the full cache).

For each cache: a random-weight Llama of the Llama-3.1-8B shape (`--layers`, fp16), a prompt of
`--tokens`, then `--steps` pipelined steps (as mlx_lm.generate); each step's three host phases, in
ms (median): build (the model call: the graph), submit (mx.async_eval: MLX encodes and launches the
kernels), wait (y.item(): the previous step's GPU work), and the step's wall time. Then the same
steps synchronous, and the operations in one step's graph (those that are not views: about one
kernel launch each on a GPU).

    python benchmarks/host_time.py [--layers 32] [--tokens 32768] [--tiny]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvcompress  # noqa: E402
import mlx.core as mx  # noqa: E402
from kivi_e2e import llama8b_shaped, prefill, step  # noqa: E402

CACHES = (("full", {}), ("streaming", {"budget": 0.5}), ("snapkv", {"budget": 0.5}), ("h2o", {"budget": 0.5}),
          ("tova", {"budget": 0.5}), ("keyformer", {"budget": 0.5}))


# operations that make a view (no kernel on a GPU); the rest launch about one kernel each
VIEWS = {"Broadcast", "Reshape", "Flatten", "Unflatten", "Transpose", "ExpandDims", "Squeeze", "Slice", "AsStrided"}


def graph_size(out: mx.array) -> tuple[int, int]:
    """(operations, of them not views) in the graph behind `out`, from MLX's dot export."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.dot"
        mx.export_to_dot(str(path), out)
        names = re.findall(r'label ="([A-Za-z_0-9]+)", shape=rectangle', path.read_text())
    return len(names), sum(name not in VIEWS for name in names)


def phases(model, caches, token, steps):
    build, submit, wait, wall = [], [], [], []
    y = step(model, caches, token)
    mx.async_eval(y)
    for _ in range(steps):
        t0 = time.perf_counter()
        next_y = step(model, caches, y)
        t1 = time.perf_counter()
        mx.async_eval(next_y)
        t2 = time.perf_counter()
        y.item()
        t3 = time.perf_counter()
        build.append(t1 - t0), submit.append(t2 - t1), wait.append(t3 - t2), wall.append(t3 - t0)
        y = next_y
    y.item()
    return [1e3 * statistics.median(v) for v in (build, submit, wait, wall)], y


def sync_phases(model, caches, token, steps):
    build, run = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        token = step(model, caches, token)
        t1 = time.perf_counter()
        mx.eval(token)
        t2 = time.perf_counter()
        build.append(t1 - t0), run.append(t2 - t1)
    return [1e3 * statistics.median(v) for v in (build, run)], token


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    model = llama8b_shaped(2 if args.tiny else args.layers, args.tiny)
    prompt = list(range(600 if args.tiny else args.tokens))
    print(f"mlx {mx.__version__} {mx.default_device()}; {len(model.layers)} layers, {len(prompt)} tokens; ms per step, median of {args.steps}")
    print("| cache | build | submit | wait | pipelined wall | sync build | sync eval | operations (not views) |")
    print("|---|---|---|---|---|---|---|---|")
    for method, params in CACHES:
        caches = kvcompress.make_cache(model, method, **params)
        logits, _ = prefill(model, caches, prompt)
        y = mx.argmax(logits[0, -1])
        _, y = phases(model, caches, y, 4)  # warm-up (kernels compiled, dispatch decided)
        (build, submit, wait, wall), y = phases(model, caches, y, args.steps)
        (s_build, s_eval), y = sync_phases(model, caches, y, args.steps)
        operations, kernels = graph_size(step(model, caches, y))
        label = method + "".join(f" {k}={v}" for k, v in params.items())
        print(f"| {label} | {build:.2f} | {submit:.2f} | {wait:.2f} | {wall:.2f} | {s_build:.2f} | {s_eval:.2f} | {operations} ({kernels}) |",
              flush=True)
        del caches
        mx.clear_cache()


if __name__ == "__main__":
    main()
