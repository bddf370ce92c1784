"""KIVI quantize-and-pack on a GPU: this tree's kernel against older copies of kivi_quant.py, in one
process, taking turns in rounds, each against the copy (`x * 1`, a read and a write of the same bytes)
timed in the same rounds. Prints ms a call and % of the copy's bytes/s (bytes: the input read, the
codes, scales and zeros written), and whether every copy's outputs are bit-identical to this tree's.

    git show REV:kvcompress/kernels/kivi_quant.py > /tmp/kivi_quant_old.py
    python benchmarks/quant_ab.py --against /tmp/kivi_quant_old.py [--layouts channel token] [--mib 256 32]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcompress.kernels import kivi_quant  # noqa: E402  (kvcompress first: it picks the CPU BLAS)
import mlx.core as mx  # noqa: E402
from timing import median_eval_ms  # noqa: E402

CASES = ((2, 32), (4, 32), (8, 32), (2, 64), (2, 128), (4, 128))  # (bits, G)


def load(path: str, i: int):
    # the package context makes the old file's relative imports (dispatch) resolve to this tree's
    spec = importlib.util.spec_from_file_location(f"kvcompress.kernels.kivi_quant_old{i}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", nargs="*", default=[], help="older kivi_quant.py files")
    parser.add_argument("--layouts", nargs="+", default=["channel", "token"], choices=["channel", "token"])
    parser.add_argument("--mib", type=int, nargs="+", default=[256, 32], help="input sizes in MiB: [MiB, 4096, 128] fp16")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("needs MLX's CUDA back-end and an NVIDIA GPU (these are mx.fast.cuda_kernel timings)")
    kernels = {Path(p).stem: load(p, i) for i, p in enumerate(args.against)}
    kernels["this tree"] = kivi_quant
    for mib in args.mib:
        count = max(2, 256 // mib)  # inputs rotate over >= 256 MiB: past the L2
        xs = [mx.random.normal((mib, 4096, 128), key=mx.random.key(i)).astype(mx.float16) for i in range(count)]
        mx.eval(xs)
        size = xs[0].nbytes
        for layout in args.layouts:
            per_channel = layout == "channel"
            print(f"\n[{mib}, 4096, 128] fp16 ({mib} MiB), per {layout}: ms a call (median of {args.rounds} rounds), % of the copy")
            print("| bits | G | copy ms | " + " | ".join(f"{k} ms" for k in kernels) + " | "
                  + " | ".join(f"{k} %" for k in kernels) + " | identical |")
            print("|---" * (3 + 2 * len(kernels) + 1) + "|")
            for bits, G in CASES:
                moved = size + size * bits // 16 + 2 * 2 * (size // 2 // G)
                times = {name: [] for name in ["copy", *kernels]}
                for _ in range(args.rounds):
                    times["copy"].append(median_eval_ms(lambda: [x * 1 for x in xs], repeat=20) / count)
                    for name, module in kernels.items():
                        times[name].append(median_eval_ms(
                            lambda: [module.quantize_pack_kernel(x, bits, G, per_channel, "cuda") for x in xs], repeat=20) / count)
                ms = {name: statistics.median(t) for name, t in times.items()}
                outs = [m.quantize_pack_kernel(xs[0], bits, G, per_channel, "cuda") for m in kernels.values()]
                same = all(mx.array_equal(a, b).item() for out in outs[:-1] for a, b in zip(out, outs[-1]))
                share = {name: 100 * (moved / ms[name]) / (2 * size / ms["copy"]) for name in kernels}
                print(f"| {bits} | {G} | {ms['copy']:.3f} | " + " | ".join(f"{ms[k]:.3f}" for k in kernels) + " | "
                      + " | ".join(f"{share[k]:.0f}" for k in kernels) + f" | {same} |")


if __name__ == "__main__":
    main()
