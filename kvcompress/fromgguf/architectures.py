"""GGUF architectures as mlx-lm models: the config from the metadata, the tensor names, and
llama.cpp's q/k row permutation undone where llama.cpp applies it.

llama.cpp's convert_hf_to_gguf.py permutes the q and k projection rows of llama-family models
(`LlamaModel.modify_tensors`: each head's rows go from HF's rotate-half order to interleaved pairs,
for its "normal" RoPE kernel). Qwen2 and Qwen3 are written unpermuted (they use its NEOX RoPE, which
is HF's order). mlx-lm's models use HF's order (`rope_traditional=False`), so only llama's rows are
permuted back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ConfigError

# GGUF block tensor names -> mlx-lm module paths under model.layers.N (shared by these architectures)
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


@dataclass(frozen=True)
class Architecture:
    """How one `general.architecture` becomes an mlx-lm model."""

    model_type: str  # mlx-lm's module (mlx_lm/models/<model_type>.py)
    permuted_qk: bool  # llama.cpp permuted the q/k rows (undone on load)
    extra_block_names: dict[str, str] = field(default_factory=dict)
    extra_args: Callable[[Any, str], dict] = lambda gguf, arch: {}

    @property
    def block_names(self) -> dict[str, str]:
        return {**BLOCK_NAMES, **self.extra_block_names}


def _qwen3_args(gguf, arch: str) -> dict:
    return {"head_dim": _head_dim(gguf, arch)}


ARCHITECTURES = {
    "llama": Architecture("llama", permuted_qk=True),
    "qwen2": Architecture("qwen2", permuted_qk=False),
    "qwen3": Architecture("qwen3", permuted_qk=False,
                          extra_block_names={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
                          extra_args=_qwen3_args),
}


def architecture(gguf) -> tuple[str, Architecture]:
    arch = gguf.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"general.architecture: expected one of {sorted(ARCHITECTURES)} (GGUF architectures "
                          f"kvcompress maps to mlx-lm models), got {arch!r}")
    return arch, ARCHITECTURES[arch]


def _head_dim(gguf, arch: str) -> int:
    hidden, heads = gguf.require(f"{arch}.embedding_length"), gguf.require(f"{arch}.attention.head_count")
    return int(gguf.metadata(f"{arch}.attention.key_length", hidden // heads))


def model_config(gguf) -> dict:
    """mlx-lm's config.json for the file (what `mlx_lm.utils.load_model` reads)."""
    arch, spec = architecture(gguf)
    tensors = {t.name: t for t in gguf.tensors}
    scaling = gguf.metadata(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ConfigError(f"{arch}.rope.scaling.type: expected 'none' (RoPE scaling from GGUF is not mapped yet), "
                          f"got {scaling!r}")
    heads = int(gguf.require(f"{arch}.attention.head_count"))
    config = {
        "model_type": spec.model_type,
        "hidden_size": int(gguf.require(f"{arch}.embedding_length")),
        "num_hidden_layers": int(gguf.require(f"{arch}.block_count")),
        "intermediate_size": int(gguf.require(f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf.metadata(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": _head_dim(gguf, arch),
        "rms_norm_eps": float(gguf.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "max_position_embeddings": int(gguf.require(f"{arch}.context_length")),
        "rope_theta": float(gguf.metadata(f"{arch}.rope.freq_base", 10000.0)),
        "rope_traditional": False,  # HF's rotate-half order: llama's rows are unpermuted on load
        "tie_word_embeddings": "output.weight" not in tensors,
        **spec.extra_args(gguf, arch),
    }
    for key in ("bos_token_id", "eos_token_id"):
        if gguf.has(f"tokenizer.ggml.{key}"):
            config[key] = int(gguf.metadata(f"tokenizer.ggml.{key}"))
    return config


def mlx_name(gguf_name: str, spec: Architecture, arch: str) -> str:
    """The mlx-lm parameter name of a GGUF tensor ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"); a ConfigError for a tensor the model has no place for."""
    *stem, suffix = gguf_name.split(".")
    if stem[0] == "blk" and len(stem) == 3 and stem[2] in spec.block_names:
        return f"model.layers.{stem[1]}.{spec.block_names[stem[2]]}.{suffix}"
    if len(stem) == 1 and stem[0] in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem[0]]}.{suffix}"
    raise ConfigError(f"{gguf_name}: a tensor kvcompress does not map for architecture {arch!r} "
                      f"(block tensors it maps: {sorted(spec.block_names)}; global: {sorted(GLOBAL_NAMES)})")


def unpermute_rows(rows, heads: int):
    """Undo llama.cpp's q/k permutation on the output-row axis (numpy or mx arrays).

    convert_hf_to_gguf.py reorders each head's rows from HF's rotate-half layout (first half, second
    half) to interleaved pairs (`reshape(heads, 2, D/2).swapaxes(1, 2)`) for its RoPE kernel. Rows
    are quantization-group independent, so the same index map applies to weight, scales and biases.
    """
    out_rows = rows.shape[0]  # heads * D
    return rows.reshape(heads, out_rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def permuted_heads(gguf_name: str, config: dict, spec: Architecture) -> int | None:
    """The head count to unpermute this tensor's rows by, or None (not a permuted q/k tensor)."""
    if not spec.permuted_qk:
        return None
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else None
    return {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(kind)
