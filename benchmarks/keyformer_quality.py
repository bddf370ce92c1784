"""Quality of Keyformer variants on the embedded model through the runner (issue 3, item 12).

Embedded NIAH (single needle) and passkey at 1k and 2k tokens, budgets 25% and 50% of the prompt:
task score and mean per-step KL(full || method) over teacher-forced decode steps, for full,
keyformer (paper: real queries, redrawn noise, tau 1 -> 2 over the decoded tokens), keyformer in
the reference system's proxy mode (incoming key as query, frozen noise), h2o and streaming.

    .venv/bin/python benchmarks/keyformer_quality.py [contexts...] [--samples N]   (default 1024 2048, 2)
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict

import kvcompress
from kvcompress.methods import method_config
from kvcompress.runner import RunContext, run_sample

DECODE_STEPS = 24


def methods(fraction):
    return [
        ("keyformer", method_config("keyformer", budget=fraction, anneal_steps=DECODE_STEPS)),
        ("keyformer-proxy", method_config("keyformer", budget=fraction, anneal_steps=DECODE_STEPS, score="proxy", noise="frozen")),
        ("h2o", method_config("h2o", budget=fraction)),
        ("streaming", method_config("streaming", budget=fraction)),
    ]


def main(contexts, samples):
    model, tok = kvcompress.load_model()
    table = defaultdict(list)  # (task, context, method, budget) -> [(score, kl)]
    print(f"{'task':>8} {'context':>7} {'method':>16} {'budget':>6} {'score':>6} {'kl_mean':>8} {'n':>2}", flush=True)
    for context in contexts:
        for name in ("niah", "passkey"):
            params = {"context_tokens": context, "num_samples": samples}
            run_context = RunContext("smollm2-135m", "embedded", name, params, DECODE_STEPS)
            for sample in kvcompress.load_dataset(name, **params):
                runs = [("full", method_config("full"), "-")]
                for fraction in (0.25, 0.5):
                    runs += [(label, cfg, f"{int(fraction * 100)}%") for label, cfg in methods(fraction)]
                records = run_sample(model, tok, sample, [cfg for _, cfg, _ in runs], run_context)
                for (label, _, budget), record in zip(runs, records):
                    if record.run["status"] != "ok":
                        print(f"  {label} {budget}: {record.run['status']} {record.run['error']}", flush=True)
                        continue
                    kl = [s["kl"] for s in record.steps]
                    table[(name, context, label, budget)].append((record.run["score"], sum(kl) / max(1, len(kl))))
            for (task, ctx, label, budget), values in table.items():
                if task == name and ctx == context:
                    score = sum(v[0] for v in values) / len(values)
                    kl = sum(v[1] for v in values) / len(values)
                    print(f"{task:>8} {ctx:>7} {label:>16} {budget:>6} {score:>6.2f} {kl:>8.4f} {len(values):>2}", flush=True)
    assert all(math.isfinite(v[1]) for values in table.values() for v in values)


if __name__ == "__main__":
    args = sys.argv[1:]
    samples = 2
    if "--samples" in args:
        at = args.index("--samples")
        samples = int(args[at + 1])
        del args[at : at + 2]
    main([int(a) for a in args] or [1024, 2048], samples)
