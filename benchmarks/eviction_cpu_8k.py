"""The embedded model (SmolLM2-135M, fp32, CPU) prefilling an 8k-token prompt with eviction caches.

Drop-in path: `kvcompress.make_cache`, mlx-lm's `generate_step` (prefill chunks of 2048, the last
token alone, then decode). Per method: prefill seconds, MLX peak memory above the weights during
prefill, KV bytes held after it, and the first decoded tokens. Prompt: the embedded essays.
Accumulating methods (h2o, keyformer) score the prompt in tiles (methods/eviction/scoring/prompt_scores.py): their
peak stays near the full cache's instead of growing with the square of the prompt.

    .venv/bin/python benchmarks/eviction_cpu_8k.py [tokens] [method ...]   (default 8000 full h2o snapkv)
"""

from __future__ import annotations

import sys
import time

import kvcompress
import mlx.core as mx
from mlx_lm.generate import generate_step

from kvcompress.memory import live_kv_bytes


def essay_prompt(tok, n):
    from kvcompress import embedded

    text = ""
    for path in sorted(embedded.essays_dir().glob("*.txt")):
        text += path.read_text()
        if len(text) > 8 * n:
            break
    return mx.array(tok.encode(text)[:n])


def main(n, methods):
    model, tok = kvcompress.load_model()
    prompt = essay_prompt(tok, n)
    print(f"prompt {prompt.size} tokens, SmolLM2-135M fp32 on CPU, prefill chunks of 2048")
    print("| method | prefill s | prefill peak above weights (MiB) | KV after prefill (MiB) | first tokens |")
    print("| --- | ---: | ---: | ---: | --- |", flush=True)
    for method in methods:
        cache = kvcompress.make_cache(model, method, **({} if method == "full" else {"budget": 0.5}))
        mx.clear_cache()
        weights = mx.get_active_memory()
        mx.reset_peak_memory()
        start = time.perf_counter()
        steps = generate_step(prompt, model, max_tokens=4, prompt_cache=cache, prefill_step_size=2048)
        first, _ = next(steps)  # the whole prefill plus the first token
        prefill_s = time.perf_counter() - start
        peak = mx.get_peak_memory() - weights
        kv = live_kv_bytes(cache)
        tokens = [int(first)] + [int(t) for t, _ in steps]
        print(f"| {method} | {prefill_s:.1f} | {peak / 2**20:.0f} | {kv / 2**20:.1f} | {tok.decode(tokens)!r} |", flush=True)
        del cache, steps


if __name__ == "__main__":
    args = sys.argv[1:]
    n = int(args.pop(0)) if args and args[0].isdigit() else 8000
    main(n, args or ["full", "h2o", "snapkv"])
