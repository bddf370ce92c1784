"""KIVI quality on the embedded SmolLM2-135M through the project's runner (kvcompress/runner.py).

`.venv/bin/python benchmarks/kivi_quality.py [samples] [lm] [retrieval]` prints, for full, KIVI-2, KIVI-4, K4V2,
KIVI-8 and mlx-lm QuantizedKVCache 4/8 (G = 64):
- language modelling (essay continuation after a 1024-token prompt, 128 teacher-forced decode
  steps): mean per-step KL(full || method), top-1 agreement, measured live KV bytes;
- passkey and NIAH (single needle) retrieval scores at 1k and 2k tokens (mean over samples);
- `policies`: the paper's residual policy (Algorithm 1, the default) against the earlier grouped
  one, KIVI-2 and KIVI-4, per-sample mean KL with a paired 95% t-interval of the difference.
Every method is derived from the same full-cache prefill per sample (KIVI compresses after prefill).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvcompress  # noqa: E402  (BLAS preload before mlx)
from kvcompress.methods import method_config  # noqa: E402
from kvcompress.model import model_fingerprint  # noqa: E402
from kvcompress.runner import RunContext, run_sample  # noqa: E402

METHODS = {
    "full": method_config("full"),
    "KIVI-2": method_config("kivi", bits=2),
    "KIVI-4": method_config("kivi", bits=4),
    "K4V2": method_config("kivi", key_bits=4, value_bits=2),
    "KIVI-8": method_config("kivi", bits=8),
    "mlx-quant-4": method_config("mlx-quant", bits=4),
    "mlx-quant-8": method_config("mlx-quant", bits=8),
}


def run(model, tokenizer, dataset: str, params: dict, decode_steps: int, methods: dict | None = None):
    methods = methods or METHODS
    data = kvcompress.load_dataset(dataset, tokenizer=tokenizer, **params)
    context = RunContext("smollm2-135m", model_fingerprint("smollm2-135m"), dataset, params, decode_steps)
    by_method = {name: [] for name in methods}
    for sample in data:
        records = run_sample(model, tokenizer, sample, list(methods.values()), context)
        for name, record in zip(methods, records):
            assert record.run["status"] == "ok", record.run["error"]
            by_method[name].append(record)
    return by_method


def lm_table(model, tokenizer, samples: int):
    t = time.time()
    lm = run(model, tokenizer, "lm", {"context_tokens": 1024, "continuation_tokens": 129, "num_samples": samples}, 128)
    print(f"\n## Language modelling, 1024-token essay prompt, 128 teacher-forced decode steps, {samples} samples")
    print("(top-1 vs full: argmax equals the full cache's argmax; vs text: equals the continuation token)")
    print(f"{'method':12} {'mean KL':>10} {'max step KL':>11} {'top-1 vs full':>13} {'top-1 vs text':>13} "
          f"{'live KV KiB':>11} {'x smaller':>9}")
    full_bytes = statistics.mean(r.run["full_kv_bytes"] for r in lm["full"])
    full_tokens = [s["token"] for r in lm["full"] for s in r.steps]
    for name, records in lm.items():
        steps = [s for r in records for s in r.steps]
        kl = statistics.mean(s["kl"] for s in steps)
        agree_full = statistics.mean(s["token"] == f for s, f in zip(steps, full_tokens))
        agree_text = statistics.mean(s["top1_agree"] for s in steps)
        live = statistics.mean(r.run["live_kv_bytes"] for r in records)
        print(f"{name:12} {kl:10.2e} {max(s['kl'] for s in steps):11.2e} {agree_full:13.3f} {agree_text:13.3f} "
              f"{live / 1024:11.0f} {full_bytes / live:9.2f}")
    print(f"[{time.time() - t:.0f} s]")


def retrieval_table(model, tokenizer, samples: int):
    scores = {}
    for dataset in ("passkey", "niah"):
        for tokens in (1024, 2048):
            t = time.time()
            res = run(model, tokenizer, dataset, {"context_tokens": tokens, "num_samples": samples}, 8)
            scores[(dataset, tokens)] = {n: statistics.mean(r.run["score"] for r in rs) for n, rs in res.items()}
            print(f"[{dataset} {tokens}: {time.time() - t:.0f} s]")
    cols = list(scores)
    print(f"\n## Retrieval scores (mean over {samples} samples; 1 = all answers right)")
    print(f"{'method':12} " + " ".join(f"{d + ' ' + str(n):>13}" for d, n in cols))
    for name in METHODS:
        print(f"{name:12} " + " ".join(f"{scores[c][name]:13.2f}" for c in cols))


# two-sided 95% Student t quantiles by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 19: 2.093, 24: 2.064, 29: 2.045}


def t95(n: int) -> float:
    return T95.get(n - 1) or T95[max(k for k in T95 if k <= n - 1)]


def policies_table(model, tokenizer, samples: int):
    """The paper's residual policy vs the grouped one, per-sample mean KL, paired over samples."""
    t = time.time()
    methods = {"full": method_config("full")}
    for bits in (2, 4):
        for policy in ("paper", "grouped"):
            methods[f"KIVI-{bits} {policy}"] = method_config("kivi", bits=bits, residual_policy=policy)
    lm = run(model, tokenizer, "lm", {"context_tokens": 1024, "continuation_tokens": 129, "num_samples": samples}, 128, methods)
    per_sample = {n: [statistics.mean(s["kl"] for s in r.steps) for r in rs] for n, rs in lm.items()}
    print(f"\n## KIVI residual policy, language modelling, 1024-token prompt, 128 teacher-forced steps, n = {samples} samples")
    print(f"{'method':18} {'mean KL':>10} {'95% CI':>23} {'live KV KiB':>11}")
    for name in list(methods)[1:]:
        kls = per_sample[name]
        half = t95(samples) * statistics.stdev(kls) / samples**0.5
        live = statistics.mean(r.run["live_kv_bytes"] for r in lm[name])
        print(f"{name:18} {statistics.mean(kls):10.3e} [{statistics.mean(kls) - half:10.3e}, {statistics.mean(kls) + half:10.3e}] "
              f"{live / 1024:11.0f}")
    for bits in (2, 4):
        diff = [a - b for a, b in zip(per_sample[f"KIVI-{bits} paper"], per_sample[f"KIVI-{bits} grouped"])]
        half = t95(samples) * statistics.stdev(diff) / samples**0.5
        mean = statistics.mean(diff)
        print(f"KIVI-{bits}: paper - grouped mean KL {mean:+.3e}, paired 95% CI [{mean - half:+.3e}, {mean + half:+.3e}]")
    print(f"[{time.time() - t:.0f} s]")


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    samples = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    parts = sys.argv[2:] or ["lm", "retrieval"]
    model, tokenizer = kvcompress.load_model()
    if "lm" in parts:
        lm_table(model, tokenizer, samples)
    if "retrieval" in parts:
        retrieval_table(model, tokenizer, samples)
    if "policies" in parts:
        policies_table(model, tokenizer, samples)
