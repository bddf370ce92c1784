"""How far each quantized cache moves the embedded model's next-token distribution (docs/methods.md's
TurboQuant and QJL numbers).

The embedded SmolLM2-135M (fp32, CPU) reads a 250-token prompt ("The pass key is 4127. Remember
it." + filler + "The pass key is") through the cache, all but its last token in one call, then the
last token alone, which attends over what the cache holds (codes; QJL's recent window exact). The
figure is KL(full || cache) of that token's distribution, in nats, over seeds 0-4 (the rotations and
sketches): median, min and max. kv_bytes: the cache's resident bytes after the prompt, all layers,
against the full cache's.

    .venv/bin/python benchmarks/quantizer_kl.py [--seeds N] [--quick]
"""

from __future__ import annotations

import argparse

import kvcompress
import mlx.core as mx
import numpy as np

from kvcompress.memory import live_kv_bytes

CONFIGS = [
    *[dict(name="turboquant", bits=b) for b in (2, 2.5, 3, 3.5, 4)],
    *[dict(name="turboquant", bits=b, qjl=False) for b in (2, 2.5, 3, 3.5, 4)],
    dict(name="qjl"),
    dict(name="qjl", buffer=32),  # nearly every token as codes
    dict(name="qjl", value_bits=8),  # the keys' share of the error
    dict(name="qjl", sketch_dim=1024, initial_sketch_dim=1024),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="two configs, two seeds")
    args = parser.parse_args()
    configs, seeds = (CONFIGS[2:3] + CONFIGS[10:11], 2) if args.quick else (CONFIGS, args.seeds)
    model, tokenizer = kvcompress.load_model("smollm2-135m")
    prompt = tokenizer.encode("The pass key is 4127. Remember it. " + "The grass is green. " * 40 + "The pass key is")

    def run(name, **params):
        cache = kvcompress.make_cache(model, name, **params)
        model(mx.array(prompt[:-1])[None], cache=cache)
        out = model(mx.array(prompt[-1:])[None], cache=cache)[0, -1].astype(mx.float32)
        return out - mx.logsumexp(out), live_kv_bytes(cache)

    full, full_bytes = run("full")
    print(f"prompt {len(prompt)} tokens; full cache {full_bytes} bytes\n")
    print("| cache | KL median | KL min | KL max | kv_bytes vs full |")
    print("| --- | --- | --- | --- | --- |")
    for config in configs:
        params = {k: v for k, v in config.items() if k != "name"}
        kls, size = [], 0
        for seed in range(seeds):
            log_probs, size = run(config["name"], seed=seed, **params)
            kls.append(float((mx.exp(full) * (full - log_probs)).sum()))
        label = " ".join([config["name"], *(f"{k}={v}" for k, v in params.items())])
        print(f"| {label} | {np.median(kls):.3f} | {min(kls):.3f} | {max(kls):.3f} | {size / full_bytes:.3f} |", flush=True)


if __name__ == "__main__":
    main()
