"""KIVI decode attention's tensor-core kernel on a GPU: this tree's kivi_attention_mma.py against older
(or probe) copies of it, in one process, taking turns in rounds, beside SDPA on the full cache and
kivi_attention.py's scalar kernel timed in the same rounds. Layers wait for the layer before
(`timing.chained`, as in a model). Prints us a layer per path (median and every round), each copy's
time over this tree's per round, and each path's relative L2 against `decode_attention_reference`.

    git show REV:kvcompress/kernels/kivi_attention_mma.py > /tmp/mma_old.py
    python benchmarks/attention_ab.py --against /tmp/mma_old.py [--contexts 32768 131072] [--bits 2 4]

A copy is any file with the module's interface (`partials`, `supported`, `aligned`, `tokens_covered`,
`step_tokens`, `STEPS_PER_WARP`, `WARPS`, `THREADS`): stop 23 timed copies whose key loads were
redirected to one row (wrong numbers, the same instructions) to ask whether those loads bound it.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvcompress.kernels import kivi_attention, kivi_attention_mma  # noqa: E402  (kvcompress first: CPU BLAS)
import mlx.core as mx  # noqa: E402

from kvcompress.methods.kivi import KiviCache  # noqa: E402
from timing import chained, median_eval_ms  # noqa: E402

SCALE = 128**-0.5


def load(path: str, i: int):
    # the package context makes the copy's relative imports resolve to this tree's
    spec = importlib.util.spec_from_file_location(f"kvcompress.kernels.kivi_attention_mma_copy{i}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kivi_layers(kv: list, layers: int, T: int, bits: int) -> list:
    """(keys, values) sides of `layers` KIVI caches (G 32, residual 128) holding T tokens, one decode step in."""
    sides = []
    for i in range(layers):
        k, v = kv[i % len(kv)]
        cache = KiviCache(bits, bits, 32, 128)
        cache.from_prefill(k[:, :, : T - 1], v[:, :, : T - 1], None)
        sides.append(cache.update_and_fetch(k[:, :, T - 1 :], v[:, :, T - 1 :]))
        mx.eval(sides[-1])
    return sides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", nargs="*", default=[], help="other kivi_attention_mma.py files")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--bits", type=int, nargs="+", default=[2], choices=[2, 4])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("needs MLX's CUDA back-end and an NVIDIA GPU (the tensor-core kernel is CUDA only)")
    copies = {"this tree": kivi_attention_mma}
    copies.update({Path(p).name: load(p, i) for i, p in enumerate(args.against)})
    print(f"device {mx.default_device()}, MLX {mx.__version__}; 8 KV heads x 4 rows, D 128, fp16, G 32")
    for T in args.contexts:
        full_bytes = 2 * 8 * T * 128 * 2
        layers = max(4, (512 << 20) // (full_bytes // 5))  # KIVI-2 is ~5x smaller than full: ~0.5 GiB of codes
        full_layers = max(4, (1024 << 20) // full_bytes)
        qs = [mx.random.normal((1, 32, 1, 128), key=mx.random.key(100 + i)).astype(mx.float16) for i in range(layers)]
        kv = [(mx.random.normal((1, 8, T, 128), key=mx.random.key(2 * i)).astype(mx.float16),
               mx.random.normal((1, 8, T, 128), key=mx.random.key(2 * i + 1)).astype(mx.float16))
              for i in range(full_layers)]
        mx.eval(qs, kv)
        sides = {bits: kivi_layers(kv, layers, T, bits) for bits in args.bits}

        def sdpa():
            return chained(lambda i, q: mx.fast.scaled_dot_product_attention(q, *kv[i], scale=SCALE), qs[:full_layers])

        def kivi(bits: int, module, tensor_cores: bool):
            def call(i, q):
                kivi_attention.kivi_attention_mma = module
                return kivi_attention.decode_attention_fused(q, *sides[bits][i], SCALE, False, bits, bits, 32, "cuda",
                                                             tensor_cores=tensor_cores)
            return lambda: chained(call, qs)

        paths = {"SDPA (full cache)": (sdpa, full_layers)}
        for bits in args.bits:
            paths[f"KIVI-{bits} scalar kernel"] = (kivi(bits, kivi_attention_mma, False), layers)
            for name, module in copies.items():
                paths[f"KIVI-{bits} tensor cores, {name}"] = (kivi(bits, module, True), layers)
        times = {label: [] for label in paths}
        try:
            for _ in range(args.rounds):
                for label, (fn, n) in paths.items():
                    times[label].append(1e3 * median_eval_ms(fn, repeat=10, warmup=2) / n)
            errors = {}
            for bits in args.bits:
                want = kivi_attention.decode_attention_reference(qs[0], *sides[bits][0], SCALE, None, bits, bits, 32)
                for name, module in copies.items():
                    kivi_attention.kivi_attention_mma = module
                    got = kivi_attention.decode_attention_fused(qs[0], *sides[bits][0], SCALE, False, bits, bits, 32,
                                                                "cuda", tensor_cores=True)
                    errors[bits, name] = (mx.linalg.norm((got - want).astype(mx.float32))
                                          / mx.linalg.norm(want.astype(mx.float32))).item()
        finally:
            kivi_attention.kivi_attention_mma = kivi_attention_mma
        sdpa_us = statistics.median(times["SDPA (full cache)"])
        print(f"\n## {T} tokens, {layers} KIVI layers chained: us a layer, median of {args.rounds} rounds")
        print("| path | us/layer | x SDPA | rounds | copy / this tree, per round | rel. L2 vs reference |")
        print("|---|---|---|---|---|---|")
        for label, t in times.items():
            ratio, error = "-", "-"
            for bits in args.bits:
                prefix = f"KIVI-{bits} tensor cores, "
                if label.startswith(prefix):
                    name = label[len(prefix):]
                    base = times[prefix + "this tree"]
                    ratio = " ".join(f"{a / b:.2f}" for a, b in zip(t, base))
                    error = f"{errors[bits, name]:.1e}"
            median = statistics.median(t)
            print(f"| {label} | {median:.1f} | {sdpa_us / median:.2f} | {' '.join(f'{x:.0f}' for x in t)} | "
                  f"{ratio} | {error} |")


if __name__ == "__main__":
    main()
