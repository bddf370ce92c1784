"""The prompt-scoring kernels' two passes timed apart (kvcompress/kernels/prompt_scores.py): each
row's log-sum-exp, then each key's column sums, plain (H2O) and with Keyformer's noise, for one layer
of 8 KV heads x 4 query heads, D 128, fp16, a whole prompt of each length. CUDA only.

    python benchmarks/prompt_passes_speed.py [--tokens 8192 32768] [--reps 5] [--against OLD.py ...]

--against times other versions of kvcompress/kernels/prompt_scores.py (files, e.g. from `git show
REV:kvcompress/kernels/prompt_scores.py > old.py`) in the same process, all taking turns each
repetition; prints each one's time over this tree's and how far each pass's output (the rows' lse, the
keys' sums) is from this tree's (max |difference| over max |value|).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvcompress  # noqa: E402,F401  (BLAS preload before mlx)
import mlx.core as mx  # noqa: E402
from kvcompress.kernels import dispatch  # noqa: E402
from kvcompress.kernels import prompt_scores as kernels  # noqa: E402

R, G, D = 8, 4, 128


def load_kernels(path: str):
    """Another version of kernels/prompt_scores.py as a module of the package (its relative imports
    resolve)."""
    spec = importlib.util.spec_from_file_location("kvcompress.kernels.prompt_scores_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def passes(kernels, n: int, noisy: bool):
    """The two launches of `accumulated_attention_fused` for a whole prompt of n tokens, apart."""
    queries, keys = kernels.random_case(R, G, n, n, D, mx.float16, seed=1)
    noise = kernels.random_noise(R, G, n, n, True, seed=2) if noisy else None
    M = G * n  # a multiple of the 64-row tile for these shapes: no padding rows
    q = (queries * D**-0.5).astype(keys.dtype).transpose(0, 2, 1, 3).reshape(R, M, D)
    dims = dispatch.constant((M, n, 0, G, M, 1), mx.int32)
    streams = noise.streams if noisy else dispatch.constant((0,), mx.uint32)
    taus = noise.tau if noisy else dispatch.constant((1.0,), mx.float32)
    template = [("T", keys.dtype), ("D", D), ("NOISY", noisy)]

    def row_lse():
        return kernels._kernel("row_lse")(inputs=[q, keys, dims, streams, taus], template=template,
                                          grid=(M // kernels.ROWS * kernels.THREADS, R, 1),
                                          threadgroup=(kernels.THREADS, 1, 1), output_shapes=[(R, M)],
                                          output_dtypes=[mx.float32])[0]

    lse = row_lse()
    mx.eval(lse)

    def column_sums():
        return kernels._kernel("column_sums")(inputs=[q, keys, dims, streams, taus, lse], template=template,
                                              grid=(n // kernels.KEYS * kernels.THREADS, R, 1),
                                              threadgroup=(kernels.THREADS, 1, 1), output_shapes=[(R, n)],
                                              output_dtypes=[mx.float32])[0]

    return row_lse, column_sums


def median_ms(functions: list, reps: int) -> list[float]:
    """Each function's median time (ms) over `reps` rounds, the functions taking turns in a round."""
    for f in functions:
        mx.eval(f())
    times = [[] for _ in functions]
    for _ in range(reps):
        for f, spent in zip(functions, times):
            start = time.perf_counter()
            mx.eval(f())
            spent.append(time.perf_counter() - start)
    return [1e3 * statistics.median(spent) for spent in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--against", metavar="FILE", nargs="+", default=[],
                        help="other kernels/prompt_scores.py files, timed in turn")
    args = parser.parse_args()
    if args.reps < 1 or any(n < 64 for n in args.tokens):
        parser.error("--reps must be >= 1 and every --tokens >= 64")
    for path in args.against:
        if not Path(path).is_file():
            parser.error(f"--against: no file {path}")
    if dispatch.gpu_backend() != "cuda":
        sys.exit("prompt_passes_speed: the kernels run on CUDA only")
    versions = [kernels] + [load_kernels(path) for path in args.against]
    print(f"mlx {mx.__version__} {mx.default_device()}; {R} KV heads x {G}, D {D}, float16; median of {args.reps}")
    for i, path in enumerate(args.against, 1):
        print(f"version {i}: {path}")
    print("| tokens | noise | pass | ms | G logits/s |" + "".join(f" v{i} ms | v{i} / this | v{i} diff |"
                                                           for i in range(1, len(versions))))
    print("|---|---|---|---|---|" + "---|---|---|" * (len(versions) - 1))
    for n in args.tokens:
        for noisy in (False, True):
            # each version's inputs (the same seeded draws) and row pass's lse, which its column pass reads
            pass_pairs = [passes(module, n, noisy) for module in versions]
            for p, name in enumerate(("row_lse", "column_sums")):
                launches = [pair[p] for pair in pass_pairs]
                ms = median_ms(launches, args.reps)
                logits = R * G * n * n / 2  # the causal half
                row = f"| {n} | {'keyformer' if noisy else 'none'} | {name} | {ms[0]:.1f} | {logits / ms[0] / 1e6:.0f} |"
                mine = launches[0]()
                for other, other_ms in zip(launches[1:], ms[1:]):
                    diff = (mx.abs(other() - mine).max() / mx.abs(mine).max()).item()
                    row += f" {other_ms:.1f} | {other_ms / ms[0]:.2f} | {diff:.1e} |"
                print(row, flush=True)
            del pass_pairs


if __name__ == "__main__":
    main()
