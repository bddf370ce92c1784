"""Small GGUF files written by ggml's own `gguf` package (no downloads): a byte-level BPE vocabulary,
model metadata as llama.cpp's convert_hf_to_gguf.py writes it, and random weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokens() -> list[str]:
    """GPT-2's 256 byte symbols (tokenizers' ByteLevel alphabet, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    """(tokens, token types): 256 bytes, one token per merge, then the CONTROL tokens."""
    tokens = byte_tokens() + [m.replace(" ", "") for m in MERGES] + SPECIALS
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS)
    return tokens, [int(t) for t in types]


def add_tokenizer(writer: gguf.GGUFWriter, pre: str) -> None:
    tokens, types = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def random_k_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K data (gguf quantizes neither): random codes and sub-block scales, with
    finite fp16 super-block scales of a weight's size."""
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_values, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.0005).tobytes(), np.uint8)
    if qtype == Q.Q4_K:  # d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        blocks[..., 0:2], blocks[..., 2:4] = scale, np.frombuffer(np.float16(0.0002).tobytes(), np.uint8)
    elif qtype == Q.Q6_K:  # 128 bytes low nibbles, 64 bytes high bits, 16 int8 scales, d
        blocks[..., 208:210] = scale
    else:
        raise ValueError(qtype)
    return blocks.reshape(rows, -1)


def encode(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """A tensor's GGUF data of type `qtype`: gguf's quantizer, or random K-quant blocks (the values
    are then the blocks', not `values`)."""
    if qtype in (Q.Q4_K, Q.Q6_K):
        return random_k_blocks(qtype, *values.shape, rng)
    return gguf.quants.quantize(values, qtype)


def write_file(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]], metadata: dict | None = None,
               pre: str | None = "qwen2") -> dict[str, np.ndarray]:
    """Write a GGUF file; returns each tensor as `gguf` decodes it back (the reference weights; none
    for a type `gguf` cannot decode)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    if pre is not None:
        add_tokenizer(writer, pre)
    decoded = {}
    for name, (data, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    for tensor in reader.tensors:
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            continue
        decoded[tensor.name] = np.asarray(values, np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))
    return decoded


# A tiny model, as llama.cpp writes it: hidden 256 (K-quant blocks are 256 values), 2 layers, 4 query
# heads and 2 KV heads of 64.
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, CONTEXT = 256, 2, 4, 2, 64, 512, 512
# Q4_K_M's mix, as llama.cpp's quantize writes it: Q6_K for ffn_down and the output matrix
Q4_K_M = {"ffn_down": Q.Q6_K, "output": Q.Q6_K}


def llama_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` (HF rotate-half rows -> interleaved pairs)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def tiny_model(path: Path, arch: str, rng: np.random.Generator, tied: bool = False,
               linear_type: Q = Q.Q8_0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A random tiny `arch` model written as GGUF, its matrices of `linear_type` (Q4_K: Q4_K_M's mix)
    and its embedding F16. Returns (the file's tensors decoded by `gguf`, the same weights under
    mlx-lm's names in HF's row order: what mlx-lm's model should be given)."""
    vocab = len(vocabulary()[0])
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not tied:
        shapes["output.weight"] = (vocab, HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}"
        shapes |= {f"{b}.attn_norm.weight": (HIDDEN,), f"{b}.ffn_norm.weight": (HIDDEN,),
                   f"{b}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN), f"{b}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   f"{b}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN), f"{b}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
                   f"{b}.ffn_gate.weight": (FFN, HIDDEN), f"{b}.ffn_up.weight": (FFN, HIDDEN),
                   f"{b}.ffn_down.weight": (HIDDEN, FFN)}
        if arch == "qwen2":
            shapes |= {f"{b}.attn_q.bias": (HEADS * HEAD_DIM,), f"{b}.attn_k.bias": (KV_HEADS * HEAD_DIM,),
                       f"{b}.attn_v.bias": (KV_HEADS * HEAD_DIM,)}
        if arch == "qwen3":
            shapes |= {f"{b}.attn_q_norm.weight": (HEAD_DIM,), f"{b}.attn_k_norm.weight": (HEAD_DIM,)}
    hf_rows = {name: rng.standard_normal(shape).astype(np.float32) * (0.2 if len(shape) == 2 else 0.1)
               for name, shape in shapes.items()}
    for name in hf_rows:
        if name.endswith("norm.weight"):
            hf_rows[name] += 1.0
    tensors = {}
    for name, values in hf_rows.items():
        stored = values
        if arch == "llama" and ".attn_q." in name:
            stored = llama_permute(values, HEADS)
        if arch == "llama" and ".attn_k." in name:
            stored = llama_permute(values, KV_HEADS)
        kind = name.split(".")[-2]
        qtype = Q.F32 if stored.ndim == 1 else Q.F16 if kind == "token_embd" else linear_type
        if qtype == Q.Q4_K:
            qtype = Q4_K_M.get(kind, Q.Q4_K)
        tensors[name] = (encode(stored, qtype, rng) if qtype not in (Q.F32, Q.F16) else stored, qtype)
    metadata = {f"{arch}.block_count": LAYERS, f"{arch}.context_length": CONTEXT,
                f"{arch}.embedding_length": HIDDEN, f"{arch}.feed_forward_length": FFN,
                f"{arch}.attention.head_count": HEADS, f"{arch}.attention.head_count_kv": KV_HEADS,
                f"{arch}.rope.freq_base": 10000.0, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6}
    if arch == "qwen3":
        metadata[f"{arch}.attention.key_length"] = HEAD_DIM
    decoded = write_file(path, arch, tensors, metadata, pre="qwen2" if arch != "llama" else "llama-bpe")
    reference = {}
    for name, values in decoded.items():
        if arch == "llama" and ".attn_q." in name:  # the test's own inverse of llama_permute
            values = values.reshape(HEADS, HEAD_DIM // 2, 2, -1).swapaxes(1, 2).reshape(values.shape)
        if arch == "llama" and ".attn_k." in name:
            values = values.reshape(KV_HEADS, HEAD_DIM // 2, 2, -1).swapaxes(1, 2).reshape(values.shape)
        reference[mlx_lm_name(name)] = values
    return decoded, reference


def mlx_lm_name(gguf_name: str) -> str:
    """The HF / mlx-lm name of a GGUF tensor, as llama.cpp's tensor_mapping.py pairs them."""
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}[parts[0]] + "." + parts[1]
