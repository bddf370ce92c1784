"""Decode speed of the embedded model (SmolLM2-135M, fp32, CPU) with each cache, against the full cache.

Each context is prefilled once by the runner's own `prefill` (full caches recording the post-RoPE
queries); every compressed cache is derived from it by the runner's `derive_cache` (`from_prefill`),
the sweep's path. Then the caches decode greedily taking turns step by step (so a change in the
machine's load hits all of them alike), one warm-up step each (the first pays the prompt-end work),
then `STEPS` timed steps; ms/step is the median, `vs_full` the full cache's median over the cache's
(>= 1.0: at least as fast as full). setup_s is the prefill (full) or the prompt scoring and
selection / quantization (the others). Prompt: embedded essay text. The load average is printed
first: the CPU is shared.

    .venv/bin/python benchmarks/decode_cpu.py [contexts...]   (default 2048 4096)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import kvcompress
import mlx.core as mx

from kvcompress.attention import install
from kvcompress.memory import tokens_kept
from kvcompress.methods import method_config
from kvcompress.runner import derive_cache, prefill

STEPS = 9
CACHES = {
    "keyformer 25%": dict(name="keyformer", budget=0.25),
    "keyformer 50%": dict(name="keyformer", budget=0.5),
    "h2o 50%": dict(name="h2o", budget=0.5),
    "streaming 50%": dict(name="streaming", budget=0.5),
    "KIVI-4": dict(name="kivi", bits=4),
    "KIVI-2": dict(name="kivi", bits=2),
}


def prompt_tokens(tok, n):
    from kvcompress import embedded

    text = ""
    for path in sorted(embedded.essays_dir().glob("*.txt")):
        text += path.read_text()
        if len(text) > 8 * n:
            break
    ids = tok.encode(text)[:n] if text else []
    if len(ids) < n:  # fall back to a fixed pseudo-random prompt
        ids = mx.random.randint(100, 40000, (n,), key=mx.random.key(0)).tolist()
    return mx.array(ids)


def step_ms(model, cache, token):
    """One greedy decode step: (ms, next token)."""
    start = time.perf_counter()
    logits = model(token[None, None], cache=cache)
    token = mx.argmax(logits[0, -1])
    mx.eval(token)
    return (time.perf_counter() - start) * 1e3, token


def main(contexts):
    model, tok = kvcompress.load_model()
    install()
    print(f"load average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}, cores: {os.cpu_count()}")
    print("| context | cache | tokens_kept | ms/step | tok/s | vs_full | setup_s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for T in contexts:
        prompt = prompt_tokens(tok, T)
        prefilled, last_logits, prefill_s = prefill(model, prompt.tolist(), record_queries=True)
        first = mx.argmax(last_logits)
        runs = {}
        for label, params in CACHES.items():
            start = time.perf_counter()
            cache = derive_cache(model, method_config(**params), prefilled)
            runs[label] = [cache, time.perf_counter() - start, first, []]
        runs["full"] = [prefilled, prefill_s, first, []]  # decoding extends the prefilled caches
        for step in range(STEPS + 1):
            for run in runs.values():
                ms, run[2] = step_ms(model, run[0], run[2])
                if step:  # step 0 is the warm-up
                    run[3].append(ms)
        full_ms = statistics.median(runs["full"][3])
        for label in ["full", *CACHES]:
            cache, setup_s, _, times = runs[label]
            ms = statistics.median(times)
            kept = tokens_kept(cache)
            print(f"| {T} | {label} | {kept} | {ms:.1f} | {1e3 / ms:.2f} | {full_ms / ms:.2f} | {setup_s:.1f} |")
        del runs, prefilled
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [2048, 4096])
