"""Tiny random-weight mlx-lm models, one per architecture, for tests that run a KV-cache method over
the attention layouts mlx-lm 0.32.2 ships: plain, GQA, sliding window, NoPE layers, MLA, MoE and the
recurrent hybrids, and models that read a layer's keys outside its attention call (KV sharing).
Each config is a dict as a config.json would hold it, built the way mlx-lm's
`load_model` builds one (no weights, no network): 4 layers, hidden 128, 4 query / 2 KV heads of 32,
vocab 512, 4 experts top-2, and every window WINDOW tokens so that a ~40-token prompt crosses it.

The comment above each config names the caches `model.make_cache()` (or `make_prompt_cache`) returns,
layer by layer: KV = KVCache, Rot(16) = RotatingKVCache(max_size=16), Arrays(n) = ArraysCache(size=n).
Where a real config carries a `sliding_window` that mlx-lm 0.32.2 does not apply (Mistral v0.1,
Starcoder2, Phi-3, Gemma 2), the dict keeps it and the comment says every layer gets a full KVCache.

Skipped: `olmo` (OLMo 1). mlx-lm 0.32.2's olmo.py calls sys.exit(1) on import unless `hf_olmo` (the
ai2-olmo package) is installed, and past that its attention adds the mask to the scores as an array
while create_attention_mask hands it the string "causal", so any prompt longer than one token raises.
OLMo 2 and 3 are here.
"""

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes

WINDOW = 16

# The fields most decoder configs share; each architecture below overrides or adds its own.
_DENSE = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 64}
# YaRN as Qwen2.5 and DeepSeek configure it, the original context cut to 1024 for a 4096 model.
_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
_FOUR_SLIDING_LAST_FULL = ["sliding_attention"] * 3 + ["full_attention"]

ARCHITECTURES: dict[str, dict] = {
    # KV KV KV KV
    "llama": {**_DENSE, "model_type": "llama"},
    # KV KV KV KV; Llama 3.1's frequency-dependent rescaling.
    "llama3_rope": {
        **_DENSE,
        "model_type": "llama",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    },
    # Rot(16) Rot(16) Rot(16) KV
    "llama_sliding": {
        **_DENSE,
        "model_type": "llama",
        "layer_types": _FOUR_SLIDING_LAST_FULL,
        "sliding_window": WINDOW,
    },
    # KV KV KV KV: mlx-lm maps mistral to llama, which ignores sliding_window without layer_types.
    "mistral": {**_DENSE, "model_type": "mistral", "sliding_window": WINDOW},
    # KV KV KV KV; YaRN RoPE plus Llama 4's position-dependent query scale, which starts at
    # position 32 (its original_max_position_embeddings), inside a 40-token prompt.
    "ministral3": {
        **_DENSE,
        "model_type": "ministral3",
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    },
    # KV KV KV KV; q/k/v biases.
    "qwen2": {**_DENSE, "model_type": "qwen2", "rope_theta": 1000000.0},
    # KV KV KV KV
    "qwen2_yarn": {**_DENSE, "model_type": "qwen2", "rope_theta": 1000000.0, "rope_scaling": _YARN},
    # KV KV KV KV; per-head q/k RMSNorm.
    "qwen3": {**_DENSE, "model_type": "qwen3", "rope_theta": 1000000.0},
    # KV KV KV KV
    "qwen3_moe": {
        **_DENSE,
        **_MOE,
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    # KV KV KV KV
    "gemma": {**_DENSE, "model_type": "gemma"},
    # KV KV KV KV: mlx-lm's gemma2 has no sliding layers; logit soft-capping.
    "gemma2": {
        **_DENSE,
        "model_type": "gemma2",
        "query_pre_attn_scalar": 32,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": WINDOW,
    },
    # Rot(16) Rot(16) Rot(16) KV; local layers on rope_local_base_freq, global ones linearly scaled.
    "gemma3_text": {
        **_DENSE,
        "model_type": "gemma3_text",
        "query_pre_attn_scalar": 32,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 4,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    },
    # KV KV KV KV; LayerNorm, per-head q/k LayerNorm (Command R+), parallel attention and MLP.
    "cohere": {**_DENSE, "model_type": "cohere", "layer_norm_eps": 1e-5, "use_qk_norm": True},
    # Rot(16) Rot(16) Rot(16) KV; the global layer has no RoPE.
    "cohere2": {
        **_DENSE,
        "model_type": "cohere2",
        "layer_norm_eps": 1e-5,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 4,
    },
    # KV KV KV KV; q/k RMSNorm over all heads, norms after attention and MLP.
    "olmo2": {**_DENSE, "model_type": "olmo2"},
    # Rot(16) Rot(16) Rot(16) KV
    "olmo3": {
        **_DENSE,
        "model_type": "olmo3",
        "layer_types": _FOUR_SLIDING_LAST_FULL,
        "sliding_window": WINDOW,
    },
    # KV KV KV KV: mlx-lm's starcoder2 ignores sliding_window.
    "starcoder2": {
        **_DENSE,
        "model_type": "starcoder2",
        "norm_epsilon": 1e-5,
        "rope_theta": 100000.0,
        "sliding_window": WINDOW,
    },
    # KV KV KV KV; fused wqkv.
    "internlm2": {**_DENSE, "model_type": "internlm2", "bias": False},
    # KV KV KV KV; dynamic-NTK RoPE as InternLM3-8B ships it.
    "internlm3": {
        **_DENSE,
        "model_type": "internlm3",
        "rope_scaling": {"rope_type": "dynamic", "factor": 6.0},
    },
    # KV KV KV KV; layer 3 has no RoPE (no_rope_layer_interval 4).
    "smollm3": {**_DENSE, "model_type": "smollm3", "no_rope_layer_interval": 4},
    # KV KV KV KV; muP-style multipliers, attention scale 1/head_dim.
    "granite": {
        **_DENSE,
        "model_type": "granite",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_multiplier": 1 / 32,
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "logits_scaling": 8.0,
    },
    # KV KV KV KV
    "mixtral": {**_DENSE, **_MOE, "model_type": "mixtral", "num_local_experts": 4},
    # Rot(16) KV Rot(16) KV; attention sinks, YaRN.
    "gpt_oss": {
        **_DENSE,
        "model_type": "gpt_oss",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_theta": 150000.0,
        "rope_scaling": {**_YARN, "beta_fast": 32.0, "beta_slow": 1.0},
    },
    # KV KV KV KV: MLA expanded per head, keys 48 wide (32 no-RoPE + 16 RoPE) and values 32, so the
    # cache's keys and values differ in last dimension; always YaRN. Layer 0 dense, 1-3 MoE.
    "deepseek_v2": {
        **_DENSE,
        **_MOE,
        "model_type": "deepseek_v2",
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "topk_method": "greedy",
        "first_k_dense_replace": 1,
        "rope_scaling": {**_YARN, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    },
    # KV KV KV KV: MLA in latent form, the cache holds one shared "head" per token: keys = the
    # normalised latent [B, 1, L, 32], values = the RoPE'd key part [B, 1, L, 16]. YaRN; layer 0
    # dense, 1-3 MoE with sigmoid group-limited routing.
    "deepseek_v3": {
        **_DENSE,
        **_MOE,
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "rope_scaling": {**_YARN, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    # KV KV KV KV; muP-scaled embeddings and residuals.
    "minicpm": {
        **_DENSE,
        "model_type": "minicpm",
        "dim_model_base": 64,
        "scale_depth": 1.4,
        "scale_emb": 12.0,
        "tie_word_embeddings": True,
    },
    # KV KV KV KV; LayerNorm, parallel attention and MLP, RoPE on 12 of 32 dims.
    "phi": {**_DENSE, "model_type": "phi", "layer_norm_eps": 1e-5, "partial_rotary_factor": 0.4},
    # KV KV KV KV: mlx-lm's phi3 ignores sliding_window (Phi-3-mini-4k has 2047); fused qkv.
    "phi3": {**_DENSE, "model_type": "phi3", "original_max_position_embeddings": 4096, "sliding_window": WINDOW},
    # KV KV KV KV; Phi-3.5's LongRoPE. mlx-lm applies long_factor at every length (transformers
    # switches from short_factor past original_max_position_embeddings).
    "phi3_longrope": {
        **_DENSE,
        "model_type": "phi3",
        "original_max_position_embeddings": 1024,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0] * 16,
            "long_factor": [1.0 + 0.5 * i for i in range(16)],
        },
    },
    # KV KV KV KV; RoPE on 8 of 32 dims, per-head q/k LayerNorm, parallel residual (StableLM 2 12B).
    "stablelm": {
        **_DENSE,
        "model_type": "stablelm",
        "layer_norm_eps": 1e-5,
        "use_qkv_bias": False,
        "partial_rotary_factor": 0.25,
        "qk_layernorm": True,
        "use_parallel_residual": True,
    },
    # Rot(16) Rot(16) Rot(16) KV; the global layer has no RoPE, local layers Llama-3-scaled.
    "exaone4": {
        **_DENSE,
        "model_type": "exaone4",
        "rope_theta": 1000000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        "sliding_window": WINDOW,
        "sliding_window_pattern": "LLLG",
    },
    # Arrays(2) Arrays(2) Arrays(2) KV: Gated DeltaNet (conv state, recurrent state) and one gated
    # attention layer with RoPE on 8 of 32 dims; every layer MoE with a shared expert.
    "qwen3_next": {
        **_DENSE,
        **_MOE,
        "model_type": "qwen3_next",
        "num_experts": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": True,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 4,
        "rope_theta": 10000000.0,
    },
    # Arrays(1) Arrays(1) KV Arrays(1): gated short convolutions (state of conv_L_cache - 1 tokens)
    # around one attention layer, so a recurrent layer also follows it.
    "lfm2": {
        **_DENSE,
        "model_type": "lfm2",
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 128,
        "block_ff_dim": 192,
        "block_multiple_of": 64,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": True,
        "layer_types": ["conv", "conv", "full_attention", "conv"],
        "rope_theta": 1000000.0,
    },
    # CacheList(Arrays(2), KV) in every layer: Mamba-2 and attention side by side in each block.
    "falcon_h1": {
        **_DENSE,
        "model_type": "falcon_h1",
        "mamba_d_ssm": 128,
        "mamba_n_heads": 4,
        "mamba_d_head": 32,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_chunk_size": 16,
        "tie_word_embeddings": True,
    },
    # Arrays(2) Arrays(2) Arrays(2) KV: Mamba-2 layers and one attention layer without position
    # embedding (Granite 4.0-H); MoE with a shared expert.
    "granitemoehybrid": {
        **_DENSE,
        "model_type": "granitemoehybrid",
        "intermediate_size": 64,
        "attention_bias": False,
        "attention_multiplier": 1 / 32,
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "logits_scaling": 8.0,
        "layer_types": ["mamba", "mamba", "mamba", "attention"],
        "position_embedding_type": "nope",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 32,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_proj_bias": False,
        "mamba_conv_bias": True,
        "tie_word_embeddings": True,
    },
    # Rot(16) KV, then two KV-shared layers without a cache: layer 2 attends (cache=None) on layer 0's
    # keys, layer 3 on layer 1's (Gemma 4 E2B/E4B share the last 20 of 35 layers' KV so). Proportional
    # RoPE on a quarter of the global layer's dims; no per-layer inputs, single-wide MLPs.
    "gemma4_kv_shared": {
        **_DENSE,
        "model_type": "gemma4_text",
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": WINDOW,
        "global_head_dim": 32,
        "hidden_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
    },
    # KV KV KV KV Rot(16) Rot(16) Rot(16) Rot(16): two loops over the 4 blocks; the second loop's layer
    # i attends both on the first loop's keys of layer i (the KVCache's, through its own cache) and on
    # its own window, gated per head.
    "iquestloopcoder": {**_DENSE, "model_type": "iquestloopcoder", "loop_window_size": WINDOW},
    # KV KV, then two KV-reuse blocks without a cache that attend (cache=None) on the last cache's keys,
    # read with `cache[-1].keys_and_values()`.
    "afm7": {
        "model_type": "afm7",
        "vocab_size": 512,
        "hidden_dim": 128,
        "num_layers": 4,
        "num_kv_reuse_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "hidden_dim_scale_factor": 1.0,
    },
}


def tiny_config(name: str) -> dict:
    """A copy of ARCHITECTURES[name], free to edit."""
    return copy.deepcopy(ARCHITECTURES[name])


def tiny_model(name: str, seed: int = 0, dtype=mx.float32) -> nn.Module:
    """ARCHITECTURES[name] built as mlx-lm's load_model builds a checkpoint, with the random weights
    of each layer's own initialiser, drawn after mx.random.seed(seed), cast to dtype and evaluated.
    On the CPU, mlx 0.32.4's gather_mm runs float32 only, so the MoE models (qwen3_moe, mixtral, gpt_oss,
    deepseek_v2, deepseek_v3, qwen3_next, granitemoehybrid) raise in bfloat16 or float16 there."""
    config = tiny_config(name)
    model_class, model_args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(model_args_class.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def save_tiny_model(name: str, path, tokenizer, seed: int = 0) -> dict:
    """Write ARCHITECTURES[name] as a local mlx-lm model directory (config.json, model.safetensors and
    `tokenizer`'s files), its vocabulary widened to the tokenizer's: what a user points `model:` at.
    Returns the config written."""
    from mlx_lm.utils import save_config, save_model

    config = {**tiny_config(name), "vocab_size": len(tokenizer.get_vocab())}
    ARCHITECTURES[f"{name}@saved"] = config  # tiny_model builds by name
    try:
        model = tiny_model(f"{name}@saved", seed)
    finally:
        del ARCHITECTURES[f"{name}@saved"]
    save_model(path, model)
    save_config(dict(config), config_path=f"{path}/config.json")
    tokenizer.save_pretrained(str(path))
    return config
