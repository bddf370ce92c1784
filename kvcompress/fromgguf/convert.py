"""Convert a GGUF file once into a plain mlx-lm model directory in the cache, and load it from there.

The directory (`config.json`, `model-*.safetensors`, `tokenizer.json`, `tokenizer_config.json`,
`gguf_source.json`) is what `mlx_lm.load` reads, so loading a conversion needs neither `gguf` nor the
GGUF file, and the directory can be carried to another machine as it is. Its name is the file's
sha256, the weights' dtype and the re-quantization bits (`<sha256[:16]>-<dtype>-<bits or dense>`),
under `$KVCOMPRESS_CACHE/gguf` (default ~/.cache/kvcompress/gguf). It is written to a temporary
directory and renamed, so a killed conversion leaves no half directory behind.

Weights are dequantized to float32 by `gguf` (exact for every ggml type), then cast to `dtype`, or
re-quantized with MLX's affine quantization (`mx.quantize`, groups of `GROUP_SIZE` along the input
axis) when `bits` is given: every 2-D weight whose rows divide into groups, embeddings and the output
matrix included, as mlx-lm's own `convert` does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from ..embedded import cache_dir, file_sha256
from ..errors import ConfigError
from .architectures import architecture, mlx_name, model_config, permuted_heads, unpermute_rows
from .reader import GGUFFile
from .tokenizer import TOKENIZER_KEYS, eos_token_ids, gguf_tokenizer

CONVERTER_VERSION = 1  # part of every cache key: a change to what a conversion writes invalidates old ones
GROUP_SIZE = 64  # MLX affine quantization group (mlx-lm's default)
BITS = (2, 3, 4, 5, 6, 8)
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
SHARD_BYTES = 1 << 30  # bounds the memory a conversion holds (one shard of converted weights)


def conversions_dir() -> Path:
    return cache_dir() / "gguf"


def check_options(dtype: str, bits: int | None) -> None:
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    if bits is not None and bits not in BITS:
        raise ConfigError(f"bits: expected None (dense weights) or one of {list(BITS)}, got {bits!r}")


def conversion_dir(sha256: str, dtype: str, bits: int | None) -> Path:
    """Where the conversion of the file with this sha256 under these options lives."""
    check_options(dtype, bits)
    return conversions_dir() / f"{sha256[:16]}-{dtype}-{f'{bits}bit' if bits else 'dense'}-v{CONVERTER_VERSION}"


def existing_conversions(sha256: str) -> list[Path]:
    """Finished conversions of the file with this sha256, any options."""
    return sorted(p for p in conversions_dir().glob(f"{sha256[:16]}-*-v{CONVERTER_VERSION}") if (p / "config.json").exists())


def convert(path: str | Path, dtype: str = "float32", bits: int | None = None, sha256: str | None = None) -> Path:
    """The conversion directory of a GGUF file, converting it first if the cache has none."""
    check_options(dtype, bits)
    sha256 = sha256 or file_sha256(path)
    target = conversion_dir(sha256, dtype, bits)
    if (target / "config.json").exists():
        return target
    start = time.perf_counter()
    gguf = GGUFFile(path)
    gguf.check_readable()
    arch, spec = architecture(gguf)
    config = model_config(gguf)
    names = {t.name: mlx_name(t.name, spec, arch) for t in gguf.tensors}  # every name checked before any work
    tokenizer = gguf_tokenizer({k: gguf.metadata(k) for k in TOKENIZER_KEYS if gguf.has(k)})
    config["eos_token_id"] = eos_token_ids({k: gguf.metadata(k) for k in TOKENIZER_KEYS if gguf.has(k)})
    if bits:
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": bits}

    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _write_weights(gguf, names, config, spec, DTYPES[dtype], bits, scratch)
        tokenizer.save_pretrained(str(scratch))
        (scratch / "config.json").write_text(json.dumps(config, indent=2))
        (scratch / "gguf_source.json").write_text(json.dumps({
            "file": Path(path).name, "sha256": sha256, "bytes": Path(path).stat().st_size, "architecture": arch,
            "dtype": dtype, "bits": bits, "group_size": GROUP_SIZE if bits else None,
            "converter_version": CONVERTER_VERSION, "convert_s": round(time.perf_counter() - start, 1)}, indent=2))
        scratch.chmod(0o755)  # mkdtemp's 0700 would follow the directory when it is carried elsewhere
        os.replace(scratch, target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return target


def _write_weights(gguf: GGUFFile, names: dict[str, str], config: dict, spec, dtype: mx.Dtype,
                   bits: int | None, into: Path) -> None:
    """Dequantize, unpermute, cast or re-quantize, and write in shards of about SHARD_BYTES."""
    shard: dict[str, mx.array] = {}
    shard_bytes, count = 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, count
        if shard:
            count += 1
            mx.save_safetensors(str(into / f"model-{count:05d}.safetensors"), shard, metadata={"format": "mlx"})
            shard, shard_bytes = {}, 0

    for gguf_name, name in names.items():
        values = gguf.dequantize(gguf_name)
        heads = permuted_heads(gguf_name, config, spec)
        if heads is not None:
            values = unpermute_rows(values, heads)
        weight = mx.array(values).astype(dtype)
        if bits and weight.ndim == 2 and weight.shape[-1] % GROUP_SIZE == 0:
            codes, scales, biases = mx.quantize(weight, group_size=GROUP_SIZE, bits=bits)
            module = name.removesuffix(".weight")
            arrays = {name: codes, f"{module}.scales": scales, f"{module}.biases": biases}
        else:
            arrays = {name: weight}
        mx.eval(list(arrays.values()))
        shard.update(arrays)
        shard_bytes += sum(a.nbytes for a in arrays.values())
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()


def load_converted(directory: Path):
    """(model, tokenizer) from a conversion directory, through mlx-lm's own loader."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(directory))
    mx.eval(model.parameters())
    return model, tokenizer
