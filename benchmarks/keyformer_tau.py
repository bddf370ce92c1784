"""Does Keyformer's tau schedule change anything? tau_end = 1 vs 2 on the embedded model.

One embedded NIAH sample per context; the runner's full prefill and reference decode; Keyformer
at `budget` with tau 1 -> 1 and 1 -> 2 annealed over the run's `steps` generated tokens (the
paper's schedule), decoded teacher-forced on the same reference tokens. Per decode step: the
largest score difference of a token both caches hold, relative to its
row's largest score (over layers and rows), the fraction of
(layer, row) kept sets that differ, and each config's KL(full || method).

    .venv/bin/python benchmarks/keyformer_tau.py [--context 1024] [--steps 32] [--budget 0.5] [--samples 2]
"""

from __future__ import annotations

import json
import sys

import kvcompress
import mlx.core as mx
import numpy as np

from kvcompress import datasets
from kvcompress.methods import method_config
from kvcompress.metrics import step_metrics
from kvcompress.runner import decode_step, derive_cache, reference


def main(context, steps, budget, samples):
    model, tok = kvcompress.load_model()
    params = {"variant": "single", "context_tokens": context, "num_samples": samples, "seed": 5}
    configs = {end: method_config("keyformer", budget=budget, tau_end=end).for_run(steps) for end in (1.0, 2.0)}
    print("| sample | step | max score diff (common tokens) / row max | kept sets differing | KL tau 1..1 | KL tau 1..2 | top-1 differs |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for sample in kvcompress.load_dataset("niah", tokenizer=tok, **params):
        ref = reference(model, tok, sample, list(configs.values()), steps)
        caches = {end: derive_cache(model, cfg, ref.prefilled) for end, cfg in configs.items()}
        for s in range(ref.steps):
            logits = {end: decode_step(model, ref.tokens[s], c) for end, c in caches.items()}
            kl = {end: step_metrics(ref.logits[s + 1], lg, ref.tokens[s + 1])["kl"] for end, lg in logits.items()}
            rel, differ, total = 0.0, 0, 0
            for a, b in zip(caches[1.0], caches[2.0]):
                sa, sb = np.array(a.scores), np.array(b.scores)
                pa, pb = np.array(a.positions), np.array(b.positions)
                for r in range(pa.shape[0]):  # scores of the tokens both caches hold
                    common, ia, ib = np.intersect1d(pa[r], pb[r], return_indices=True)
                    rel = max(rel, float(np.abs(sa[r, ia] - sb[r, ib]).max() / np.abs(sa[r]).max()))
                differ += int((pa != pb).any(axis=1).sum())
                total += pa.shape[0]
            top1 = int(mx.argmax(logits[1.0]).item() != mx.argmax(logits[2.0]).item())
            if s % 4 == 3 or s == ref.steps - 1:
                print(f"| {sample['id']} | {s} | {rel:.3g} | {differ}/{total} | {kl[1.0]:.5f} | {kl[2.0]:.5f} | {top1} |", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]

    def option(name, default, kind=int):
        if name in args:
            at = args.index(name)
            return kind(args[at + 1])
        return default

    main(option("--context", 1024), option("--steps", 32), option("--budget", 0.5, float), option("--samples", 2))
