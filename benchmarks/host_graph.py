"""Host cost of one decode step per layer: microseconds of Python + MLX graph building, per cache.

On a fast GPU a decode step of a small batch is bound by the host: Python builds each layer's
graph (cache update + attention) before the device runs it, and a cache whose step builds a large
graph is slower end to end however fast its kernels are (issue #13: on the H200, KIVI-2 8.3 ms
per 32-layer step to build the graph against the full cache's 1.8 ms). This benchmark times that
building alone, for one layer of each cache the sweep uses:

    out = scaled_dot_product_attention(q, *cache.update_and_fetch(k, v), cache=cache, scale, mask)

through kvcompress's attention hook (kvcompress/attention.py: mlx-lm's own path for mlx-lm's
KVCache, `cache.attention` for kvcompress caches), i.e. what an mlx-lm attention layer runs after
RoPE. Nothing is evaluated inside the timed region; the step's outputs and the cache's arrays are
evaluated after it (so the next step starts from the same state as a real decode). Also counted:
the MLX operations one step adds to the graph (nodes of `mx.export_to_dot`).

State: one layer, 8 KV heads, 32 query heads, head_dim 128 (the Llama-3.1-8B shape), a prompt of
`--context` random tokens given to each cache through `from_prefill` (the sweep's path; H2O and
Keyformer score the whole prompt there), then `--warmup` decode steps. fp16 on a GPU, fp32 on
CPU (fp16 is emulated there). The caches take turns step by step, in a new seeded order each
round, so a change in the machine's load falls on all of them alike. KIVI's paper policy
quantizes keys every R = 128 steps (and values ahead, up to R at a time): the median is the
ordinary step, the mean includes those steps.

    python benchmarks/host_graph.py [--context 4096] [--steps 300] [--save after.json]
                                    [--compare before.json] [--against REV]

`--save` writes the medians as JSON; `--compare` adds a column from such a file (e.g. the same
benchmark on the code before a change) and the ratio. `--against REV` also runs each kvcompress
cache built from its class as git revision REV had it (kvcompress/methods/kivi.py, eviction.py;
kernels, dispatch and method configs stay current), taking turns with the current ones: a
before/after of the cache classes under one machine load, which two runs on a shared machine
are not. A second table times single calls of the pieces a step is made of (a plain op, slicing,
the kernel entry points): on a GPU it shows what one custom-kernel launch costs the host.

On a CPU the evaluation between steps runs on the same cores and leaves their caches cold: the
first op built after a 4k-token attention was measured at ~40 us against ~1.3 us after a tiny
evaluation. So CPU microseconds carry that penalty (and the load of a shared machine); the op count
is the figure that carries over to a GPU host.

GPU: `python benchmarks/host_graph.py --save host_graph_gpu.json` (fp16, the fused kernels).

`--layers N` builds N caches (one per layer, each prefilled alike) before each evaluation, as a
model's step does, and reports microseconds and ops per layer. With one layer every layer's step is
evaluated before the next is built, which changes what MLX's allocator hands out: on the H200 an
array the host writes may take a small GPU buffer the last evaluation freed and move it to managed
memory first (~30 us). Changes to how kernel arguments are allocated halved one-layer host times and
did nothing end to end (benchmarks/KIVI_GPU_NOTES.md, stop 26): judge those end to end
(`kivi_e2e.py`); one layer ranks changes to Python. On the H200 `--layers 32` gave KIVI-2 a gap to the
full cache of 18-46 us a layer over three calls, against 42 us in the same day's end-to-end host graph
(benchmarks/KIVI_GPU_NOTES.md, stop 27): the host's spread between calls is that wide.

`--cuda-path` (on a CPU): the code path a CUDA GPU takes, with stand-in kernels, so the GPU path's
host work can be timed without a GPU (the device's time is scarce). Python's device checks see a GPU
(`mx.default_device()` reports one; arrays and ops stay on the CPU), the kernel dispatch answers
"cuda" without self-tests, and `mx.fast.cuda_kernel` returns kernels whose outputs are zeros of the
asked shapes (a call costs about what a real launch costs the host: ~12 us with 4 outputs on this
CPU, 8.6 us for KIVI's launch on the H200's host), fp16.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import kvcompress
import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from kvcompress.attention import scaled_dot_product_attention
from kvcompress.kernels import dispatch

N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
CACHES = {
    "full (mlx-lm KVCache)": ("full", {}),
    "kivi bits=2": ("kivi", {"bits": 2}),
    "kivi bits=4": ("kivi", {"bits": 4}),
    "kivi bits=2 grouped": ("kivi", {"bits": 2, "residual_policy": "grouped"}),
    "kivi bits=4 grouped": ("kivi", {"bits": 4, "residual_policy": "grouped"}),
    "streaming budget=0.5": ("streaming", {"budget": 0.5}),
    "h2o budget=0.5": ("h2o", {"budget": 0.5}),
    "keyformer budget=0.5": ("keyformer", {"budget": 0.5}),
    "snapkv budget=0.5": ("snapkv", {"budget": 0.5}),
    "tova budget=0.5": ("tova", {"budget": 0.5}),
}


def one_layer_model():
    """A one-layer mlx-lm Llama with the 8B model's attention geometry (the caches read it)."""
    args = llama.ModelArgs(
        model_type="llama", hidden_size=256, num_hidden_layers=1, intermediate_size=256,
        num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
        vocab_size=256, rope_theta=500000.0, tie_word_embeddings=False,
    )
    return llama.Model(args)


def cache_arrays(cache) -> list[mx.array]:
    """Every array the cache holds (buffers, codes, scores, ...): evaluated after each step."""
    found = []
    for value in vars(cache).values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        found.extend(a for a in items if isinstance(a, mx.array))
    return found


def op_count(arrays: list[mx.array]) -> int:
    """MLX operations in the not yet evaluated graph behind `arrays`."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return f.read().count("shape=rectangle")


CACHE_MODULES = {"KiviCache": "kvcompress/methods/kivi.py", "EvictionCache": "kvcompress/methods/eviction.py"}


def classes_at(revision: str) -> dict[str, type]:
    """The cache classes (KiviCache, EvictionCache) as git revision `revision` (or the tree in directory
    `revision`) had them, loaded beside the current ones (their imports resolve to the current
    package: kernels, dispatch and method configs stay current)."""
    root = Path(__file__).resolve().parents[1]
    classes = {}
    for name, path in CACHE_MODULES.items():
        if Path(revision).is_dir():  # a copy of an older tree (where no git history travels)
            source = (Path(revision) / path).read_text()
        else:
            source = subprocess.check_output(["git", "show", f"{revision}:{path}"], cwd=root, text=True)
        module = types.ModuleType(f"kvcompress.methods._{Path(path).stem}_at_{Path(revision).name}")
        module.__package__ = "kvcompress.methods"
        sys.modules[module.__name__] = module  # dataclasses look their module up
        current = getattr(mlx_cache, name)
        exec(compile(source, f"{revision}:{path}", "exec"), module.__dict__)
        setattr(mlx_cache, name, current)  # the module registered its class for load_prompt_cache: undo
        # the method configs are the current package's: the old module's own copies of their classes
        # (Eviction, ...) would fail its identity checks (`EvictionCache._plain_scores`), taking
        # another path than that revision took
        package = importlib.import_module(f"kvcompress.methods.{Path(path).stem}")
        for attr, value in list(module.__dict__.items()):
            if isinstance(value, type) and attr != name and isinstance(getattr(package, attr, None), type) \
                    and value.__module__ == module.__name__:
                setattr(module, attr, getattr(package, attr))
        classes[name] = getattr(module, name)
    return classes


def rebuilt(cache, classes: dict[str, type]):
    """The same cache (same constructor arguments) from another version of its class."""
    cls = classes[type(cache).__name__]
    if type(cache).__name__ == "KiviCache":
        return cls(cache.key_bits, cache.value_bits, cache.group_size, cache.residual, cache.residual_policy)
    return cls(cache.config, cache.layer, cache.n_layers, cache.n_kv_heads, cache.head_dim, cache.rope, cache.scale)


class StandInKernel:
    """`mx.fast.cuda_kernel`'s stand-in for --cuda-path: zeros of the output shapes asked."""

    def __call__(self, *, inputs, output_shapes, output_dtypes, **launch):
        return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]


def take_cuda_path() -> None:
    """--cuda-path: every decision a CUDA GPU makes, with StandInKernel for its kernels (see module docstring)."""
    dispatch.gpu_backend = lambda: "cuda"
    os.environ[dispatch.ENV] = "fused"  # stand-ins would fail the self-tests
    mx.fast.cuda_kernel = lambda **kernel: StandInKernel()
    mx.default_device = lambda: mx.Device(mx.gpu)


class Run:
    """One cache decoding random tokens; `step()` returns the host microseconds of one step.

    layers: caches built per evaluation (one per layer, each prefilled alike), as a model's step
    builds every layer before it is evaluated; `step()` then returns microseconds per layer."""

    def __init__(self, model, method: str, params: dict, context: int, dtype, seed: int, classes: dict | None = None,
                 layers: int = 1):
        self.scale = HEAD_DIM**-0.5
        k1, k2, k3, k4 = mx.random.split(mx.random.key(seed), 4)
        k = mx.random.normal((1, N_KV_HEADS, context, HEAD_DIM), key=k1).astype(dtype)
        v = mx.random.normal((1, N_KV_HEADS, context, HEAD_DIM), key=k2).astype(dtype)
        q = mx.random.normal((1, N_HEADS, context, HEAD_DIM), key=k3).astype(dtype)
        self.caches = []
        for _ in range(layers):
            cache = KVCache() if method == "full" else kvcompress.make_cache(model, method, **params)[0]
            if classes is not None:
                cache = rebuilt(cache, classes)
            if method == "full":
                cache.update_and_fetch(k, v)
            else:
                cache.from_prefill(k, v, q)
            mx.eval(cache_arrays(cache))
            self.caches.append(cache)
        # a few distinct decode tokens, made once: the timed region builds only the step's graph
        tokens = []
        for key in mx.random.split(k4, 16):
            kq, kk, kv = mx.random.split(key, 3)
            tokens.append(tuple(mx.random.normal((1, heads, 1, HEAD_DIM), key=kx).astype(dtype)
                                for heads, kx in ((N_HEADS, kq), (N_KV_HEADS, kk), (N_KV_HEADS, kv))))
        mx.eval(tokens)
        self.tokens = tokens
        self.n = 0
        self.times: list[float] = []

    def build(self) -> list[mx.array]:
        q, k, v = self.tokens[self.n % len(self.tokens)]
        self.n += 1
        outs = []
        for cache in self.caches:
            keys, values = cache.update_and_fetch(k, v)
            outs.append(scaled_dot_product_attention(q, keys, values, cache=cache, scale=self.scale, mask=None))
        return outs

    def arrays(self) -> list[mx.array]:
        return [a for cache in self.caches for a in cache_arrays(cache)]

    def step(self) -> float:
        start = time.perf_counter()
        outs = self.build()
        spent = (time.perf_counter() - start) * 1e6 / len(self.caches)
        mx.eval(outs, *self.arrays())
        return spent

    def ops(self) -> float:
        # eviction caches start part of a step's graph early (mx.async_eval): counted here too
        async_eval, mx.async_eval = mx.async_eval, lambda *arrays: None
        try:
            outs = self.build()
        finally:
            mx.async_eval = async_eval
        count = op_count([*outs, *self.arrays()])
        mx.eval(outs, *self.arrays())
        return count / len(self.caches)


def building_blocks(dtype, repeat: int) -> dict[str, float]:
    """Median host microseconds of one call of the pieces a decode step is built from (each call
    evaluated before the next, as in a decode step): a plain MLX op, the array ops a cache uses, and
    the kernel entry points (on a GPU these are the fused kernels: their per-call host cost)."""
    from kvcompress.kernels.evict import evict_slot
    from kvcompress.kernels.kivi_attention import random_case, decode_attention
    from kvcompress.kernels.kivi_quant import quantize_pack

    def normal(*shape, seed=0):
        return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)

    token, other = normal(1, N_KV_HEADS, 1, HEAD_DIM), normal(1, N_KV_HEADS, 1, HEAD_DIM, seed=1)
    residual = normal(1, N_KV_HEADS, 128, HEAD_DIM, seed=2)
    buffer = mx.zeros((1, N_KV_HEADS, 4096, HEAD_DIM // 16), mx.uint32)
    rows = mx.zeros((1, N_KV_HEADS, 1, HEAD_DIM // 16), mx.uint32)
    q, keys, values = random_case(2, 2, 32, HEAD_DIM, N_HEADS // N_KV_HEADS, 1, dtype, T=4096, n_k=3968, n_v=3968,
                                  heads=N_KV_HEADS)
    scores = mx.random.uniform(shape=(N_KV_HEADS, 2049), key=mx.random.key(3))
    positions = mx.broadcast_to(mx.arange(2049, dtype=mx.int32), (N_KV_HEADS, 2049)) + 0
    mx.eval(token, other, residual, buffer, rows, q, keys, values, scores, positions)

    def write_row():
        buffer[:, :, 100:101, :] = rows
        return buffer

    blocks = {
        "add (one MLX op)": lambda: token + other,
        "slice": lambda: residual[:, :, 1:],
        "concatenate (128 + 1 rows)": lambda: mx.concatenate([residual, token], axis=2),
        "slice assignment of one row": write_row,
        "quantize_pack, one token (kernel on a GPU)": lambda: quantize_pack(token, 2, 32),
        "KIVI-2 decode_attention, 4k tokens": lambda: decode_attention(q, keys, values, HEAD_DIM**-0.5, None, 2, 2, 32),
        "evict_slot, 8 rows x 2049 slots": lambda: evict_slot(scores, positions, 4, 1500),
    }
    medians = {}
    for label, fn in blocks.items():
        for _ in range(3):
            mx.eval(fn())
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - start) * 1e6)
            mx.eval(out)
        medians[label] = statistics.median(times)
    return medians


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--caches", nargs="+", default=list(CACHES), help=f"labels from {list(CACHES)}")
    parser.add_argument("--save", help="write the results as JSON here")
    parser.add_argument("--compare", help="a JSON file from --save (e.g. before a change): adds its column")
    parser.add_argument("--against", metavar="REV", help="also run every kvcompress cache with its class as git "
                        "revision REV had it, in the same turns (a before/after under one machine load)")
    parser.add_argument("--layers", type=int, default=1, help="caches (layers) built per evaluation, as a model's "
                        "step; times and ops are per layer")
    parser.add_argument("--cuda-path", action="store_true", help="on a CPU: the CUDA code path with stand-in "
                        "kernels (the GPU path's host work; see module docstring)")
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers: expected an int >= 1, got {args.layers}")
    if args.cuda_path:
        take_cuda_path()
    gpu = mx.default_device() == mx.gpu
    dtype = mx.float16 if gpu else mx.float32
    print(f"mlx {mx.__version__}, {mx.default_device()}, {dtype}, context {args.context}, {args.steps} steps, "
          f"{args.layers} layer(s) a step, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    model = one_layer_model()
    classes = classes_at(args.against) if args.against else None
    runs = {}
    for i, label in enumerate(args.caches):
        start = time.perf_counter()
        method, params = CACHES[label]
        runs[label] = Run(model, method, params, args.context, dtype, seed=i, layers=args.layers)
        if classes is not None and method != "full":
            runs[f"{label} @ {args.against}"] = Run(model, method, params, args.context, dtype, seed=i, classes=classes,
                                                    layers=args.layers)
        print(f"  {label}: prefilled in {time.perf_counter() - start:.1f} s", flush=True)
    for _ in range(args.warmup):
        for run in runs.values():
            run.step()
    ops = {label: run.ops() for label, run in runs.items()}
    # taking turns, in a new seeded order each round: the build after a step's evaluation is slower
    # the more that evaluation touched (cold caches on a CPU), so no cache may always follow the same one
    order, rng = list(runs.values()), random.Random(0)
    for _ in range(args.steps):
        rng.shuffle(order)
        for run in order:
            run.times.append(run.step())
    results = {label: {"median_us": statistics.median(run.times), "mean_us": statistics.fmean(run.times),
                       "ops": ops[label]} for label, run in runs.items()}
    before = json.load(open(args.compare))["results"] if args.compare else {}
    head = "| cache | host us/step (median) | mean | MLX ops/step |"
    rule = "|---|---|---|---|"
    if before:
        head += " before: median us | before: ops | before / now |"
        rule += "---|---|---|"
    print(head)
    print(rule)
    for label, r in results.items():
        line = f"| {label} | {r['median_us']:.0f} | {r['mean_us']:.0f} | {r['ops']:g} |"
        if before:
            b = before.get(label)
            line += (f" {b['median_us']:.0f} | {b['ops']:g} | {b['median_us'] / r['median_us']:.2f} |" if b else " - | - | - |")
        print(line)
    if classes is not None:
        print(f"\n| cache | ops @ {args.against} | ops now | median us @ {args.against} | now | {args.against} / now |")
        print("|---|---|---|---|---|---|")
        for label, r in results.items():
            b = results.get(f"{label} @ {args.against}")
            if b:
                print(f"| {label} | {b['ops']:g} | {r['ops']:g} | {b['median_us']:.0f} | {r['median_us']:.0f} "
                      f"| {b['median_us'] / r['median_us']:.2f} |")
    blocks = building_blocks(dtype, args.steps)
    print("\n| building block | host us/call (median) |")
    print("|---|---|")
    for label, us in blocks.items():
        print(f"| {label} | {us:.1f} |")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.save:
        meta = {"mlx": mx.__version__, "device": str(mx.default_device()), "context": args.context, "steps": args.steps,
                "layers": args.layers}
        with open(args.save, "w") as f:
            json.dump({"meta": meta, "results": results, "building_blocks": blocks}, f, indent=1)


if __name__ == "__main__":
    main()
