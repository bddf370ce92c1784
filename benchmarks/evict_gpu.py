"""Decode-step eviction (every eviction method) on a GPU: fused kernels vs MLX references, bit-exactness and time.

Run on the lent H200 (needs only mlx and mlx-lm):
    source /tmp/mlx-cuda-env.sh && python3 benchmarks/evict_gpu.py
Prints:
1. `evict_one` (compact positions: drop, shift, re-rotate): per configuration, whether every output
   is bit-identical to the MLX reference, and the median time of each path at B*H_kv = 32,
   n = 8192, D = 128 (the issue's shape); then blocks per row.
2. `evict_slot` (exact positions, one pass: pick the slot only): bit-exactness and time of both paths.
3. the whole Keyformer decode step through EvictionCache (append, attention, score update,
   eviction) for exact (one pass) and compact positions, with the full cache's attention (SDPA over
   the same number of tokens, no eviction) as the yardstick, and a one-token in-place write into
   the cache buffer against a full copy (does MLX's scatter update in place on this GPU?).
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("KVCOMPRESS_BLAS", "reference")  # no OpenBLAS needed on the GPU machine
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from kvcompress.kernels import dispatch  # noqa: E402
from kvcompress.kernels import evict as kernel  # noqa: E402
from timing import median_ms  # noqa: E402


def one_step_rotation(dims: int, base: float):
    # cos/sin of one RoPE position for the check; the library reads these off the model's module
    theta = base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    return mx.cos(theta), mx.sin(theta)


def inputs(R, n, D, dtype, seed, ties=False):
    mx.random.seed(seed)
    keys = mx.random.normal((R, n, D)).astype(dtype)
    values = mx.random.normal((R, n, D)).astype(dtype)
    scores = mx.random.uniform(shape=(R, n))
    if ties:  # coarse scores: many exact ties, so the lowest-index rule is exercised
        scores = mx.floor(scores * 4)
    positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32) * 3, (R, n))
    return keys, values, scores, positions, scores


def bit_exact(a, b) -> bool:
    return all(x.shape == y.shape and bool(mx.all(x == y).item()) for x, y in zip(a, b))


def main():
    print(f"device={mx.default_device()} backend={dispatch.gpu_backend()}")
    print(f"{'R':>4} {'n':>6} {'D':>4} {'dtype':>8} {'mode':>8} {'ties':>5} {'bit_exact':>9} {'mlx_ms':>8} {'fused_ms':>8} {'speedup':>7} {'fused_GB/s':>10}")
    configs = [
        (3, 40, 64, mx.float32, False, True, 0, 2),
        (4, 77, 36, mx.float16, True, True, 2, 5),  # 72-byte rows: the scalar (non-vector) path
        (5, 300, 64, mx.float16, True, True, 4, 8),
        (8, 1000, 128, mx.float16, True, False, 1, 30),
        (32, 8192, 128, mx.float16, False, False, 4, 128),
        (32, 8192, 128, mx.float16, True, False, 4, 128),
        (32, 8192, 128, mx.bfloat16, True, False, 4, 128),
        (32, 8192, 128, mx.float32, True, False, 4, 128),
    ]
    for R, n, D, dtype, compact, ties, n_sink, recent in configs:
        keys, values, scores, positions, evict_by = inputs(R, n, D, dtype, seed=R + n, ties=ties)
        rotation = one_step_rotation(D, 500000.0) if compact else None
        traditional = compact and D == 36
        args = (keys, values, scores, positions, evict_by, n_sink, recent, rotation, traditional)
        mx.eval(*[a for a in args[:5]])
        ref = kernel.evict_one_reference(*args)
        fused = kernel.evict_one_fused(*args, backend=dispatch.gpu_backend())
        exact = bit_exact(ref, fused)
        mlx_ms = median_ms(lambda: kernel.evict_one_reference(*args))
        fused_ms = median_ms(lambda: kernel.evict_one_fused(*args, backend=dispatch.gpu_backend()))
        moved = 2 * (2 * keys.nbytes + scores.nbytes + positions.nbytes) + evict_by.nbytes  # read + write
        mode = "compact" if compact else "exact"
        print(
            f"{R:>4} {n:>6} {D:>4} {str(dtype).split('.')[-1]:>8} {mode:>8} {str(ties):>5} {str(exact):>9} "
            f"{mlx_ms:>8.3f} {fused_ms:>8.3f} {mlx_ms / fused_ms:>7.2f} {moved / fused_ms / 1e6:>10.0f}"
        )
    print("\nblocks per row at R=32, n=8192, D=128, float16, compact (all bit-exact checked)")
    keys, values, scores, positions, evict_by = inputs(32, 8192, 128, mx.float16, seed=1)
    args = (keys, values, scores, positions, evict_by, 4, 128, one_step_rotation(128, 500000.0), False)
    ref = kernel.evict_one_reference(*args)
    for blocks in (4, 8, 16, 32, 64):
        run = lambda: kernel.evict_one_fused(*args, backend=dispatch.gpu_backend(), blocks_per_row=blocks)  # noqa: E731
        print(f"  blocks_per_row={blocks:>3} bit_exact={bit_exact(ref, run())} fused_ms={median_ms(run):.3f}")

    print("\nevict_slot (one pass): fused vs reference, slots shuffled, ties")
    print(f"{'R':>4} {'n':>6} {'bit_exact':>9} {'mlx_ms':>8} {'fused_ms':>8} {'speedup':>7}")
    for R, n in ((3, 77), (8, 1000), (32, 2049), (32, 8193), (64, 32769)):
        mx.random.seed(R + n)
        evict_by = mx.floor(mx.random.uniform(shape=(R, n)) * 64)
        positions = mx.argsort(mx.random.uniform(shape=(R, n)), axis=1).astype(mx.int32)
        args = (evict_by, positions, 4, n - n // 4)
        exact = bit_exact([kernel.evict_slot_reference(*args)], [kernel.evict_slot_fused(*args, backend=dispatch.gpu_backend())])
        mlx_ms = median_ms(lambda: kernel.evict_slot_reference(*args))
        fused_ms = median_ms(lambda: kernel.evict_slot_fused(*args, backend=dispatch.gpu_backend()))
        print(f"{R:>4} {n:>6} {str(exact):>9} {mlx_ms:>8.3f} {fused_ms:>8.3f} {mlx_ms / fused_ms:>7.2f}")

    print("\nin-place write of one token per row into a [32, 8193, 128] float16 buffer vs a full copy")
    in_place_write()

    print("\nwhole Keyformer decode step (append, attention, score update, eviction), B=1, H_kv=32, rep=4, D=128, float16")
    try:
        full_cache_step()
    except Exception as error:  # the kernel table above is the deliverable; this part needs mlx-lm
        print(f"  skipped: {type(error).__name__}: {error}")


def in_place_write():
    R, n, D = 32, 8193, 128
    state = {"buffer": mx.random.normal((R, n, D)).astype(mx.float16)}
    token = mx.random.normal((R, 1, D)).astype(mx.float16)
    slot = mx.random.randint(0, n, (R, 1, 1)).astype(mx.int32)
    mx.eval(state["buffer"], token, slot)

    def scatter():  # the cache's own write: the buffer's only reference is handed over
        state["buffer"] = mx.put_along_axis(state.pop("buffer"), slot, token, axis=1)
        return state["buffer"]

    def copy():
        state["buffer"] = state.pop("buffer") + 0
        return state["buffer"]

    print(f"  scatter_ms={median_ms(scatter):.4f} copy_ms={median_ms(copy):.4f}")


def full_cache_step():
    import mlx.nn as nn

    from kvcompress.methods.eviction.base import EvictionCache
    from kvcompress.methods.eviction.keyformer import Keyformer

    H, rep, D = 32, 4, 128
    for n_kept in (2048, 8192, 32768):
        k = mx.random.normal((1, H, 1, D)).astype(mx.float16)
        q = mx.random.normal((1, H * rep, 1, D)).astype(mx.float16)
        full_keys = mx.random.normal((1, H, 2 * n_kept, D)).astype(mx.float16)  # a 50% budget's full context
        mx.eval(full_keys)
        full_ms = median_ms(lambda: mx.fast.scaled_dot_product_attention(q, full_keys, full_keys, scale=D**-0.5))
        print(f"  n_kept={n_kept:>5} full cache attention over {2 * n_kept} tokens: {full_ms:.3f} ms")
        for positions in ("exact", "compact"):
            cfg = Keyformer(budget=n_kept, positions=positions)
            cache = EvictionCache(cfg, 0, 1, H, D, nn.RoPE(D, base=500000.0), D**-0.5)
            cache.batch, cache.position, cache.offset, cache.prompt_len = 1, n_kept, n_kept, n_kept
            cache.capacity, cache.recent = cfg.resolve(n_kept)
            cache.held_limit, cache.answer_start = cache.capacity, cache.prompt_len
            keys = mx.random.normal((H, n_kept, D)).astype(mx.float16)
            scores = mx.random.uniform(shape=(H, n_kept))
            held = mx.broadcast_to(mx.arange(n_kept, dtype=mx.int32), (H, n_kept)) + 0
            cache.state = (keys, keys + 0, scores, held, None, None, cache.meta_state)  # as a loaded cache
            mx.eval(cache.state[:4])

            def step():
                keys, values = cache.update_and_fetch(k, k)
                return cache.attention(q, keys, values, scale=D**-0.5, mask=None), *cache.state[:4]

            ms = median_ms(step)
            print(f"  n_kept={n_kept:>5} positions={positions:>7} step_ms={ms:.3f} vs_full_attention={ms / full_ms:.2f} kept={cache.tokens_kept}")


if __name__ == "__main__":
    main()
