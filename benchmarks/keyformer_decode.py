"""Decode speed of the embedded model (SmolLM2-135M, fp32, CPU): Keyformer at 25% / 50% budget vs full.

Each context is prefilled once by the runner's own `prefill` (full caches recording the post-RoPE
queries); Keyformer caches are derived from it by the runner's `derive_cache` (`from_prefill`).
Then a handful of greedy decode steps are timed per cache (median ms/step -> tok/s); setup_s is the
prefill (full) or the prompt scoring + selection (Keyformer). Prompt: embedded essay text.

    .venv/bin/python benchmarks/keyformer_decode.py [contexts...]   (default 2048 4096)
"""

from __future__ import annotations

import sys
import time

import kvcompress
import mlx.core as mx

from kvcompress.attention import install
from kvcompress.runner import derive_cache, prefill
from kvcompress.methods.keyformer import Keyformer

STEPS = 6


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


def decode_ms(model, cache, first):
    token, times = first, []
    for _ in range(STEPS + 1):
        start = time.perf_counter()
        logits = model(token[None, None], cache=cache)
        token = mx.argmax(logits[0, -1])
        mx.eval(token, [c.state for c in cache])
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[1:])[STEPS // 2]  # the first step pays the prompt-end selection


def main(contexts):
    model, tok = kvcompress.load_model()
    install()
    print(f"{'context':>7} {'cache':>16} {'tokens_kept':>11} {'ms/step':>8} {'tok/s':>6} {'vs_full':>7} {'setup_s':>7}")
    for T in contexts:
        prompt = prompt_tokens(tok, T)
        prefilled, last_logits, prefill_s = prefill(model, prompt.tolist(), record_queries=True)
        first = mx.argmax(last_logits)
        rows = []
        for fraction in (0.25, 0.5):
            start = time.perf_counter()
            cache = derive_cache(model, Keyformer(budget=fraction), prefilled)
            setup_s = time.perf_counter() - start
            rows.append((f"keyformer {int(fraction * 100)}%", cache[0].tokens_kept, decode_ms(model, cache, first), setup_s))
            del cache
        full_ms = decode_ms(model, prefilled, first)  # last: decoding extends the prefilled caches
        print(f"{T:>7} {'full':>16} {T:>11} {full_ms:>8.1f} {1e3 / full_ms:>6.2f} {1.0:>7.2f} {prefill_s:>7.1f}")
        for name, kept, ms, setup_s in rows:
            print(f"{T:>7} {name:>16} {kept:>11} {ms:>8.1f} {1e3 / ms:>6.2f} {full_ms / ms:>7.2f} {setup_s:>7.1f}")
        del prefilled


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [2048, 4096])
