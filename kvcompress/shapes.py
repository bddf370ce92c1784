"""Random-weight models of a named mlx-lm shape, for speed measurements (a decode step's time does not
depend on the weights' values, only on the shape and dtype).

A shape is a dict as the model's config.json holds it (the fields mlx-lm's model classes read), built
the way mlx-lm's `load_model` builds a checkpoint (`mlx_lm.utils._get_classes`), without weights or a
network. `random_model("llama-3.1-8b", "float16")` is 16 GB of float16 weights; `layers=` keeps the
first N layers (a CPU smoke run). A path to a config.json (or a directory holding one) is a shape too.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from .errors import ConfigError

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B-Instruct
    "llama-3.1-8b": {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
    },
    # meta-llama/Llama-3.2-1B-Instruct
    "llama-3.2-1b": {
        "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
        "max_position_embeddings": 131072, "tie_word_embeddings": True,
    },
    # Qwen/Qwen3-8B
    "qwen3-8b": {
        "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "intermediate_size": 12288,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
    # mistralai/Mistral-7B-Instruct-v0.3
    "mistral-7b": {
        "model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    # a small Llama for CPU smoke runs and tests (benchmarks/e2e.py --tiny)
    "tiny-llama": {
        "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
}
DTYPES = ("float16", "bfloat16", "float32")
WEIGHT_SCALE = 0.02  # small weights keep activations finite through 32 random layers


def shape_config(shape: str, layers: int | None = None) -> dict[str, Any]:
    """The config dict of a named shape or of a config.json path (a directory holding one);
    `layers` replaces its layer count. A ConfigError names the known shapes otherwise."""
    if shape in SHAPES:
        config = copy.deepcopy(SHAPES[shape])
    else:
        path = Path(shape).expanduser()
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(f"model.shape: expected one of {sorted(SHAPES)} or a config.json path, got {shape!r}")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model.shape: {path} is not JSON ({exc})") from None
        config = config.get("text_config", config) if "model_type" not in config else config
        if "model_type" not in config:
            raise ConfigError(f"model.shape: {path} has no model_type (not an mlx-lm / transformers config)")
    if layers is not None:
        if not (isinstance(layers, int) and not isinstance(layers, bool) and layers >= 1):
            raise ConfigError(f"model.layers: expected an int >= 1 or null, got {layers!r}")
        config["num_hidden_layers"] = layers
    return config


def random_model(shape: str, dtype: str = "float16", layers: int | None = None, seed: int = 0) -> nn.Module:
    """A random-weight mlx-lm model of `shape` in `dtype`; cached per process (the last two built)."""
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype: expected one of {list(DTYPES)}, got {dtype!r}")
    return _build(json.dumps(shape_config(shape, layers), sort_keys=True), dtype, seed)


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """(model class, args class) of a config, as mlx-lm's loader picks them; ConfigError for a
    model_type mlx-lm does not know."""
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)
    except ValueError as exc:  # mlx-lm's "Model type X not supported."
        raise ConfigError(f"model.shape: {exc}") from None


@functools.lru_cache(maxsize=2)
def _build(config_json: str, dtype: str, seed: int) -> nn.Module:
    config = json.loads(config_json)
    model_class, args_class = model_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map(lambda p: (p * WEIGHT_SCALE).astype(getattr(mx, dtype)), model.parameters()))
    mx.eval(model.parameters())
    return model
