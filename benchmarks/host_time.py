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
from kivi_e2e import greedy, llama8b_shaped, prefill, step  # noqa: E402

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


def timed_steps(model, caches, token, steps: int, pipelined: bool):
    """Medians (ms) of each step's phases: pipelined (as mlx_lm.generate: the next step built and
    submitted before this one is waited for) build, submit, wait and the step's wall time; else
    build and eval."""
    rows = []
    y = token
    if pipelined:
        y = step(model, caches, token)
        mx.async_eval(y)
    for _ in range(steps):
        marks = [time.perf_counter()]
        following = step(model, caches, y)
        marks.append(time.perf_counter())
        if pipelined:
            mx.async_eval(following)
            marks.append(time.perf_counter())
            y.item()
        else:
            mx.eval(following)
        marks.append(time.perf_counter())
        rows.append([b - a for a, b in zip(marks, marks[1:])] + ([marks[-1] - marks[0]] if pipelined else []))
        y = following
    y.item()
    return [1e3 * statistics.median(column) for column in zip(*rows)], y


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
        y = greedy(logits)
        _, y = timed_steps(model, caches, y, 4, True)  # warm-up (kernels compiled, dispatch decided)
        (build, submit, wait, wall), y = timed_steps(model, caches, y, args.steps, True)
        (s_build, s_eval), y = timed_steps(model, caches, y, args.steps, False)
        operations, kernels = graph_size(step(model, caches, y))
        label = method + "".join(f" {k}={v}" for k, v in params.items())
        print(f"| {label} | {build:.2f} | {submit:.2f} | {wait:.2f} | {wall:.2f} | {s_build:.2f} | {s_eval:.2f} | {operations} ({kernels}) |",
              flush=True)
        del caches
        mx.clear_cache()


if __name__ == "__main__":
    main()
