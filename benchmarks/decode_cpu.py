"""Decode speed of the embedded model (SmolLM2-135M, fp32, CPU) with each cache, against the full cache.

Each context is prefilled once by the runner's own `prefill`; KIVI and StreamingLLM caches are
derived from it by the runner's `derive_cache` (`from_prefill`, the sweep's path). Keyformer and H2O
caches are built as a loaded cache is (`state`): the prompt's keys and values at the kept positions
-- the method's protected sinks and recent window plus a seeded random choice of the rest -- and
random accumulated scores. A decode step does the same work whichever tokens are kept, and scoring
a 4k prompt on this CPU takes minutes per cache (single-threaded elementwise ops); prompt scoring
is not what this table measures. Then the caches decode greedily taking turns step by step (so a
change in the machine's load hits all of them alike), one warm-up step each, then `STEPS` timed
steps; ms/step is the median, `vs_full` the full cache's median over the cache's (>= 1.0: at least
as fast as full). setup_s: the prefill (full), or building the cache. Prompt: embedded essay text.
The load average is printed first and last: the CPU is shared.

    .venv/bin/python benchmarks/decode_cpu.py [contexts...]   (default 2048 4096)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import kvcompress
import mlx.core as mx
import numpy as np

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


def loaded_cache(model, cfg, prefilled, seed=0):
    """`cfg`'s eviction caches holding `capacity` prompt tokens per layer, set through `state`."""
    caches = cfg.make_cache(model)
    for layer, (cache, full) in enumerate(zip(caches, prefilled)):
        keys, values = full.keys_and_values()  # [1, H, T, D]
        _, H, T, _ = keys.shape
        capacity, recent = cfg.resolve(T, layer, len(caches))
        rng = np.random.default_rng(seed + layer)
        chosen = rng.choice(np.arange(cfg.n_sink, T - recent), capacity - cfg.n_sink - recent, replace=False)
        kept = mx.array(np.sort(np.concatenate([np.arange(cfg.n_sink), chosen, np.arange(T - recent, T)])).astype(np.int32))
        cache.batch, cache.position, cache.offset, cache.prompt_len = 1, T, T, T
        cache.capacity, cache.recent = capacity, recent
        cache.held_limit, cache.answer_start = cache.capacity, cache.prompt_len
        scores = mx.random.uniform(shape=(H, capacity), key=mx.random.key(seed + layer))
        positions = mx.broadcast_to(kept, (H, capacity)) + 0
        cache.state = (keys[0][:, kept], values[0][:, kept], scores, positions, None, None, cache.meta_state)
    mx.eval([c.state[:4] for c in caches])
    return caches


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
        prefilled, last_logits, prefill_s = prefill(model, prompt.tolist(), record_queries=False)
        first = mx.argmax(last_logits)
        runs = {}
        for label, params in CACHES.items():
            start = time.perf_counter()
            cfg = method_config(**params)
            cache = loaded_cache(model, cfg, prefilled) if cfg.needs_queries else derive_cache(model, cfg, prefilled)
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
