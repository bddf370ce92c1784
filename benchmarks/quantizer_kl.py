"""How far each quantized cache moves the embedded model's next-token distribution (docs/methods.md's
TurboQuant, QJL and KVQuant tables).

The embedded SmolLM2-135M (fp32, CPU) reads a prompt through the cache, all but its last token in
one call, then the last token alone, which attends over what the cache holds (codes; windows
exact). The figure is KL(full || cache) of that token's distribution, in nats; kv_bytes: the
cache's resident bytes after the prompt, all layers, against the full cache's. Three tables:

  seeds      the 217-token pass-key prompt ("The pass key is 4127. Remember it." + filler + "The
             pass key is"), TurboQuant and QJL over seeds 0-4 (rotations, sketches): median, min, max
  kvquant    the same prompt, KVQuant against KIVI and TurboQuant by bits (seed 0), bytes absolute
  essays     the same caches over five essay excerpts (the `lm` task's windows at seeded sentence
             starts, 512 tokens, seed 0), mean and max over the five

Every (prompt, cache, seed) measurement is a row of --jsonl (benchmarks/tables.py publishes the
tables from the archived rows); the tables are printed from the rows.

    .venv/bin/python benchmarks/quantizer_kl.py [--jsonl PATH] [--seeds N] [--quick]
    .venv/bin/python benchmarks/quantizer_kl.py --jsonl PATH --table    # the tables only
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

PASSKEY = "The pass key is 4127. Remember it. " + "The grass is green. " * 40 + "The pass key is"
ESSAYS = 5  # excerpts
ESSAY_TOKENS = 512

SEEDED = [
    *[dict(name="turboquant", bits=b) for b in (2, 2.5, 3, 3.5, 4)],
    *[dict(name="turboquant", bits=b, qjl=False) for b in (2, 2.5, 3, 3.5, 4)],
    dict(name="qjl"),
    dict(name="qjl", buffer=32),  # nearly every token as codes
    dict(name="qjl", value_bits=8),  # the keys' share of the error
    dict(name="qjl", sketch_dim=1024, initial_sketch_dim=1024),
]
# the KVQuant tables' columns: (header, config without bits, the bits measured)
KVQUANT = [
    ("kvquant", dict(name="kvquant"), (2, 3, 4)),
    ('kvquant `codebook="channel"`', dict(name="kvquant", codebook="channel"), (3, 4)),
    ("kvquant `outlier_fraction=0`", dict(name="kvquant", outlier_fraction=0.0), (3, 4)),
    ("kivi `residual=32`", dict(name="kivi", residual=32), (2, 3, 4)),
    ("kivi (128)", dict(name="kivi"), (3, 4)),
    ("turboquant", dict(name="turboquant", qjl=False), (3, 4)),
]
ESSAY_COLUMNS = [
    ("kvquant", dict(name="kvquant"), (2, 3, 4)),
    ('kvquant `codebook="channel"`', dict(name="kvquant", codebook="channel"), (3, 4)),
    ("kvquant `residual=32`", dict(name="kvquant", residual=32), (3, 4)),
    ("kivi `residual=32`", dict(name="kivi", residual=32), (2, 3, 4)),
    ("turboquant", dict(name="turboquant", qjl=False), (3, 4)),
]


def label(config: dict) -> str:
    return " ".join([config["name"], *(f"{k}={v}" for k, v in config.items() if k != "name")])


def key(config: dict) -> str:
    """A config's identity, whatever the order of its parameters."""
    return json.dumps(config, sort_keys=True)


def by_bits(columns: list) -> list[dict]:
    return [dict(config, bits=b) for _, config, bits in columns for b in bits]


def measurements(seeds: int, quick: bool) -> list[tuple[str, dict, int]]:
    """(prompt, cache config, seed) in the order they run."""
    if quick:
        return [("passkey", config, seed) for config in (SEEDED[2], SEEDED[10]) for seed in range(2)]
    plan = [("passkey", config, seed) for config in SEEDED for seed in range(seeds)]
    plan += [("passkey", config, 0) for config in by_bits(KVQUANT)]
    plan += [(f"essay-{i}", config, 0) for i in range(ESSAYS) for config in by_bits(ESSAY_COLUMNS)]
    return list({(p, key(c), s): (p, c, s) for p, c, s in plan}.values())  # each once


def run(path: Path, seeds: int, quick: bool) -> None:
    import kvcompress  # first: preloads OpenBLAS before mlx
    import mlx.core as mx

    from kvcompress.memory import live_kv_bytes

    model, tokenizer = kvcompress.load_model("smollm2-135m")
    essays = kvcompress.load_dataset("lm", tokenizer=tokenizer, context_tokens=ESSAY_TOKENS, continuation_tokens=2,
                                     num_samples=ESSAYS, seed=0)
    prompts = {"passkey": tokenizer.encode(PASSKEY)}
    prompts |= {f"essay-{i}": tokenizer.encode(s["context"]) for i, s in enumerate(essays)}

    def next_token(prompt, name, **params):
        cache = kvcompress.make_cache(model, name, **params)
        model(mx.array(prompt[:-1])[None], cache=cache)
        out = model(mx.array(prompt[-1:])[None], cache=cache)[0, -1].astype(mx.float32)
        return out - mx.logsumexp(out), live_kv_bytes(cache)

    full = {}
    with path.open("w") as f:
        for prompt, config, seed in measurements(seeds, quick):
            if prompt not in full:
                full[prompt] = next_token(prompts[prompt], "full")
            params = {k: v for k, v in config.items() if k != "name"} | ({"seed": seed} if config in SEEDED else {})
            log_probs, size = next_token(prompts[prompt], config["name"], **params)
            reference, full_bytes = full[prompt]
            kl = float((mx.exp(reference) * (reference - log_probs)).sum())
            row = {"prompt": prompt, "prompt_tokens": len(prompts[prompt]), "cache": label(config), "config": config,
                   "seed": seed, "kl": kl, "kv_bytes": size, "full_kv_bytes": full_bytes}
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"{prompt:8} {row['cache']:45} seed {seed}  KL {kl:.4f}  {size} B", flush=True)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open()]


def seeds_table(path: Path) -> str:
    """TurboQuant and QJL on the pass-key prompt: KL median, min, max over the seeds; bytes vs full."""
    found: dict[str, list[dict]] = {}
    for r in rows(path):
        if r["prompt"] == "passkey":
            found.setdefault(key(r["config"]), []).append(r)
    lines = ["| cache | KL median | KL min | KL max | kv bytes vs full | seeds |", "| --- " * 6 + "|"]
    for config in (c for c in SEEDED if key(c) in found):
        runs = list({r["seed"]: r for r in found[key(config)]}.values())  # a seed measured twice counts once
        kls = [r["kl"] for r in runs]
        ratio = runs[0]["kv_bytes"] / runs[0]["full_kv_bytes"]
        lines.append(f"| {label(config)} | {statistics.median(kls):.3f} | {min(kls):.3f} | {max(kls):.3f} | {ratio:.3f} | "
                     f"{len(kls)} |")
    return "\n".join(lines)


def bits_table(path: Path, columns: list, prompts, cell) -> str:
    """Rows by bits, a column per cache config; `cell` writes a cell from its rows (one per prompt)."""
    found: dict[str, dict[str, dict]] = {}  # config -> prompt -> row
    for r in rows(path):
        if prompts(r["prompt"]) and r["seed"] == 0:
            found.setdefault(key(r["config"]), {})[r["prompt"]] = r
    lines = ["| bits | " + " | ".join(header for header, _, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for bits in (2, 3, 4):
        cells = [cell(list(found[key(dict(config, bits=bits))].values())) if bits in measured else ""
                 for _, config, measured in columns]
        lines.append(f"| {bits} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kvquant_table(path: Path) -> str:
    """KVQuant, KIVI and TurboQuant on the pass-key prompt (seed 0): KL (resident bytes)."""
    return bits_table(path, KVQUANT, lambda p: p == "passkey",
                      lambda rs: f"{rs[0]['kl']:.4f} ({rs[0]['kv_bytes']:,} B)")


def essays_table(path: Path) -> str:
    """The same over the essay excerpts: KL mean / max over them (n per cell)."""
    def cell(rs):
        kls = [r["kl"] for r in rs]
        return f"{sum(kls) / len(kls):.4f} / {max(kls):.4f}" + ("" if len(kls) == ESSAYS else f" (n={len(kls)})")

    return bits_table(path, ESSAY_COLUMNS, lambda p: p.startswith("essay-"), cell)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl", type=Path, default=None, help="write the rows here (default: a temporary file)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="two configs, two seeds, the pass-key prompt only")
    parser.add_argument("--table", action="store_true", help="print the tables of --jsonl, measure nothing")
    args = parser.parse_args()
    if args.table and args.jsonl is None:
        parser.error("--table prints the table of --jsonl PATH: name the rows to read")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.jsonl or Path(tmp) / "quantizer-kl.jsonl"
        if not args.table:
            run(path, args.seeds, args.quick)
        print("\n" + seeds_table(path))
        if not args.quick:
            print("\n" + kvquant_table(path) + "\n\n" + essays_table(path))


if __name__ == "__main__":
    main()
