"""GGUF files as models (kvcompress/fromgguf): synthetic llama / qwen2 / qwen3 files against mlx-lm's
own models built from the same weights, the conversion cache, re-quantization, the tokenizer's
pre-tokenizers, and the embedded SmolLM2 GGUF through this path against the embedded loader."""

import kvcompress  # noqa: F401  (preloads OpenBLAS before mlx)

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import gguf_files
from gguf_files import CONTEXT, FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, Q, tiny_model, vocabulary, write_file
from kvcompress.embedded import QWEN_SHA256, smollm2_gguf
from kvcompress.errors import ConfigError
from kvcompress.fromgguf.convert import conversion_dir, convert, existing_conversions
from kvcompress.fromgguf.tokenizer import gguf_tokenizer
from kvcompress.model import build_embedded, context_window, load_model, load_tokenizer, model_fingerprint

PROMPT = [[5, 70, 200, 33, 261, 12, 99, 100, 3]]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Conversions go to this test's own cache directory."""
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def mlx_lm_reference(arch: str, weights: dict[str, np.ndarray], tied: bool) -> nn.Module:
    """mlx-lm's own model of `arch`, configured by hand and given the reference weights."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    args = module.ModelArgs.from_dict({
        "model_type": arch, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "intermediate_size": FFN,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
        "vocab_size": len(vocabulary()[0]), "max_position_embeddings": CONTEXT, "rope_theta": 10000.0,
        "tie_word_embeddings": tied})
    model = module.Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return model


@pytest.mark.parametrize("arch, linear_type, tied", [("qwen2", Q.Q4_K, False), ("qwen2", Q.Q8_0, True),
                                                    ("qwen3", Q.Q5_0, False), ("llama", Q.Q8_0, False)])
def test_synthetic_model_equals_mlx_lm(tmp_path, arch, linear_type, tied):
    """A file as llama.cpp writes it (llama's q/k rows permuted, qwen's not; Q4_K_M's type mix) loads
    as mlx-lm's model of its architecture built from the same weights: the same logits."""
    _, reference = tiny_model(tmp_path / "m.gguf", arch, np.random.default_rng(1), tied=tied, linear_type=linear_type)
    model, tokenizer = load_model(str(tmp_path / "m.gguf"), dtype="float32")
    assert type(model).__module__ == f"mlx_lm.models.{arch}"
    expected = mlx_lm_reference(arch, reference, tied)(mx.array(PROMPT))
    logits = model(mx.array(PROMPT))
    assert logits.shape == (1, len(PROMPT[0]), len(vocabulary()[0]))
    assert mx.abs(logits - expected).max().item() <= 1e-4 * mx.abs(expected).max().item()
    assert float(mx.abs(expected).max()) > 1.0  # the comparison is not between two near-zero outputs
    assert context_window(str(tmp_path / "m.gguf")) == CONTEXT


def test_llama_without_unpermuting_differs(tmp_path):
    """The llama reference is sensitive to the q/k row order (so the test above checks the unpermute)."""
    decoded, reference = tiny_model(tmp_path / "m.gguf", "llama", np.random.default_rng(1))
    still_permuted = {**reference, **{gguf_files.mlx_lm_name(k): v for k, v in decoded.items()
                                      if ".attn_q." in k or ".attn_k." in k}}
    a = mlx_lm_reference("llama", reference, False)(mx.array(PROMPT))
    b = mlx_lm_reference("llama", still_permuted, False)(mx.array(PROMPT))
    assert mx.abs(a - b).max().item() > 1e-2 * mx.abs(a).max().item()


def test_conversion_is_cached_and_loads_without_gguf(tmp_path, cache):
    path = tmp_path / "m.gguf"
    tiny_model(path, "qwen2", np.random.default_rng(2))
    directory = convert(path, "float32")
    assert directory.parent == cache / "gguf" and existing_conversions(gguf_files_sha(path)) == [directory]
    source = json.loads((directory / "gguf_source.json").read_text())
    assert source["sha256"] == gguf_files_sha(path) and source["architecture"] == "qwen2" and source["bits"] is None
    mtime = (directory / "config.json").stat().st_mtime_ns
    assert convert(path, "float32") == directory and (directory / "config.json").stat().st_mtime_ns == mtime
    # a fresh process without the `gguf` package loads the conversion directory (what a GPU machine gets)
    code = ("import sys; sys.modules['gguf'] = None\n"
            "import kvcompress, mlx.core as mx\n"
            f"model, tok = kvcompress.load_model({str(path)!r}, dtype='float32')\n"
            f"print(model(mx.array({PROMPT})).sum().item())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "KVCOMPRESS_CACHE": str(cache)}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    model, _ = load_model(str(path), dtype="float32")
    assert float(done.stdout.split()[-1]) == pytest.approx(model(mx.array(PROMPT)).sum().item(), rel=1e-5)


def test_concurrent_first_loads_convert_once(tmp_path, cache):
    """The processes of a sweep that start together on an unconverted file: one converts, the others
    wait for it (a lock in the cache), and all load the same directory."""
    path = tmp_path / "m.gguf"
    tiny_model(path, "qwen2", np.random.default_rng(6))
    code = ("import kvcompress\n"
            "from kvcompress.fromgguf.convert import convert\n"
            f"print(convert({str(path)!r}, 'float32'))")
    env = {**os.environ, "KVCOMPRESS_CACHE": str(cache)}
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env) for _ in range(2)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err[-2000:] for _, err in outputs]
    directories = {out.split()[-1] for out, _ in outputs}
    assert directories == {str(existing_conversions(gguf_files_sha(path))[0])}
    assert [p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")] == [Path(*directories).name]


def gguf_files_sha(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_dtype_and_bits_options(tmp_path):
    path = tmp_path / "m.gguf"
    tiny_model(path, "qwen2", np.random.default_rng(3), linear_type=Q.Q8_0)
    dense, _ = load_model(str(path), dtype="float32")
    half, _ = load_model(str(path), dtype="float16")
    assert half.model.layers[0].mlp.up_proj.weight.dtype == mx.float16
    assert half.model.layers[0].self_attn.q_proj.bias.dtype == mx.float16
    four, _ = load_model(str(path), dtype="float32", bits=4)
    assert isinstance(four.model.layers[0].mlp.up_proj, nn.QuantizedLinear) and four.model.layers[0].mlp.up_proj.bits == 4
    assert isinstance(four.model.embed_tokens, nn.QuantizedEmbedding)
    # MLX's affine codes: within a step (a group's range / 15; MLX snaps 0.0 onto a code, so not half a step)
    # of the dense weight, and not equal to it
    for module in (lambda m: m.model.layers[1].mlp.up_proj, lambda m: m.model.embed_tokens, lambda m: m.lm_head):
        q, w = module(four), module(dense).weight
        back = mx.dequantize(q.weight, q.scales, q.biases, group_size=q.group_size, bits=q.bits)
        group_range = w.reshape(w.shape[0], -1, 64).max(-1) - w.reshape(w.shape[0], -1, 64).min(-1)
        error = mx.abs(back - w).reshape(w.shape[0], -1, 64).max(-1)
        assert (error <= group_range / 15 * 1.01 + 1e-6).all().item() and error.max().item() > 0
    assert mx.isfinite(four(mx.array(PROMPT))).all().item()
    assert mx.abs(half(mx.array(PROMPT)) - dense(mx.array(PROMPT))).max().item() < 1e-2 * mx.abs(dense(mx.array(PROMPT))).max().item()
    fingerprints = {model_fingerprint(str(path), dtype, bits) for dtype, bits in
                    [("float32", None), ("float16", None), ("float32", 4), ("float32", 8)]}
    assert len(fingerprints) == 4
    assert len(existing_conversions(gguf_files_sha(path))) == 3
    with pytest.raises(ConfigError, match=r"bits: expected None \(dense weights\) or one of \[2, 3, 4, 5, 6, 8\], got 7"):
        load_model(str(path), bits=7)
    with pytest.raises(ConfigError, match="bits: re-quantization is for GGUF models"):
        load_model("smollm2-135m", bits=4)


def test_bad_files_are_config_errors(tmp_path, cache):
    with pytest.raises(ConfigError, match="name_or_path: expected an existing GGUF file"):
        load_model(str(tmp_path / "missing.gguf"))
    path = tmp_path / "mamba.gguf"
    write_file(path, "mamba", {"w": (np.zeros((4, 32), np.float32), Q.F32)})
    with pytest.raises(ConfigError, match=r"general.architecture: expected one of \['llama', 'qwen2', 'qwen3'\].*'mamba'"):
        load_model(str(path))
    path = tmp_path / "partial.gguf"
    write_file(path, "qwen2", {"token_embd.weight": (np.zeros((4, 32), np.float32), Q.F32)},
               metadata={"qwen2.block_count": 1})
    with pytest.raises(ConfigError, match="qwen2.attention.head_count: expected in the GGUF metadata of partial.gguf, missing"):
        load_model(str(path))
    path = tmp_path / "extra.gguf"
    tiny_model(path, "llama", np.random.default_rng(4), extra={"rope_freqs.weight": (np.ones(32, np.float32), Q.F32)})
    with pytest.raises(ConfigError, match="rope_freqs.weight: a tensor kvcompress does not map for architecture 'llama'"):
        load_model(str(path))
    assert not (cache / "gguf").exists()  # every error comes before any conversion work


def test_embedded_qwen_name_needs_no_file_to_validate():
    """A grid on the Qwen model is validated (its window) without the 1 GB file; a conversion for
    its pinned sha256 is where load_model looks first."""
    assert context_window("qwen2.5-coder-1.5b") == context_window("Qwen2.5-Coder-1.5B") == 32768
    assert conversion_dir(QWEN_SHA256, "float16", None).name == f"{QWEN_SHA256[:16]}-float16-dense-v1"
    assert model_fingerprint("qwen2.5-coder-1.5b", "float16") != model_fingerprint("qwen2.5-coder-1.5b", "float32")


def test_wrong_pre_placed_qwen_file_is_refused(tmp_path, monkeypatch):
    from kvcompress.embedded import qwen_gguf

    monkeypatch.setenv("KVCOMPRESS_QWEN_GGUF", str(tmp_path / "nothing.gguf"))
    with pytest.raises(ConfigError, match="KVCOMPRESS_QWEN_GGUF: expected the path"):
        qwen_gguf()
    (tmp_path / "small.gguf").write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setenv("KVCOMPRESS_QWEN_GGUF", str(tmp_path / "small.gguf"))
    with pytest.raises(ConfigError, match="expected the Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF.*got a file of 104 bytes"):
        qwen_gguf()


# ----------------------------------------------------------------------------------------------
# Tokenizer


def pieces(pre: str, text: str) -> list[str]:
    tokens, types = vocabulary()
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.merges": gguf_files.MERGES, "tokenizer.ggml.token_type": types}
    backend = gguf_tokenizer(metadata).backend_tokenizer
    return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]


def test_pre_tokenizers_follow_llama_cpp():
    text = "Hi  there's 12345\n\n  x"
    # qwen2: single digits; a newline run stays whole; "'s" split off; the space before a word joins it
    assert pieces("qwen2", text) == ["Hi", "Ġ", "Ġthere", "'s", "Ġ", "1", "2", "3", "4", "5", "ĊĊ", "Ġ", "Ġx"]
    # llama3: digit runs of up to three
    assert pieces("llama-bpe", text) == ["Hi", "Ġ", "Ġthere", "'s", "Ġ", "123", "45", "ĊĊ", "Ġ", "Ġx"]
    # smollm: single digits split out first, then GPT-2's regex (newlines and spaces run together)
    assert pieces("smollm", text) == ["Hi", "Ġ", "Ġthere", "'s", "Ġ", "1", "2", "3", "4", "5", "ĊĊĠ", "Ġx"]
    # gpt-2: a digit run is one piece with its space
    assert pieces("gpt-2", text) == ["Hi", "Ġ", "Ġthere", "'s", "Ġ12345", "ĊĊĠ", "Ġx"]
    with pytest.raises(ConfigError, match=r"tokenizer.ggml.pre: expected one of \[.*'qwen2'.*\], got 'tekken'"):
        pieces("tekken", text)


def test_tokenizer_specials_and_chat_template(tmp_path):
    tiny_model(tmp_path / "m.gguf", "qwen2", np.random.default_rng(5))
    _, tokenizer = load_model(str(tmp_path / "m.gguf"), dtype="float32")
    tokens, _ = vocabulary()
    text = "the cat in a hat, 2024 \u00e9t\u00e9\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(" the in")) == ["Ġthe", "Ġ", "in"]  # the merges, in rank order
    assert tokenizer.encode("<|im_end|>") == [tokens.index("<|im_end|>")]
    assert tokenizer.eos_token_ids == {tokens.index("<|im_end|>")}
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert load_tokenizer(str(tmp_path / "m.gguf")).encode(chat) == tokenizer.encode(chat)


# ----------------------------------------------------------------------------------------------
# The embedded SmolLM2 GGUF through this path

# Token ids the embedded loader gave before kvcompress/fromgguf existed (main at 6a65b3b)
TODAYS_TOKENS = {
    "The capital of France is Paris.": [504, 3575, 282, 4649, 314, 7042, 30],
    "In 2023 the café sold 12,345 crêpes — 日本語 🎉\n\tIndented.": [
        788, 216, 34, 32, 34, 35, 260, 37366, 3459, 216, 33, 34, 28, 35, 36, 37, 1650, 22069, 3030, 1841, 17097,
        241, 115, 40993, 179, 120, 248, 15107, 232, 227, 198, 197, 5080, 6574, 30],
    "<|im_start|>user\nHi there<|im_end|>\n": [1, 4093, 198, 26843, 665, 2, 198],
    "don't   stop\n\n\nx = f(a,b)  # ok": [12420, 982, 256, 2853, 1116, 198, 104, 446, 275, 24, 81, 28, 82, 25, 216,
                                         907, 10907],
}


@pytest.mark.slow
def test_embedded_smollm2_through_the_gguf_path():
    """The SmolLM2 Q4_1 file converted by `gguf` gives the embedded loader's weights (mx.load's MLX
    triplets dequantized in float32) and today's tokens."""
    import shutil

    path = smollm2_gguf()
    converted, converted_tokenizer = load_model(str(path), dtype="float32")
    embedded = build_embedded(mx.float32)
    ours, theirs = dict(tree_flatten(converted.parameters())), dict(tree_flatten(embedded.parameters()))
    assert sorted(ours) == sorted(theirs)
    worst = max(mx.abs(ours[k] - theirs[k]).max().item() / (mx.abs(theirs[k]).max().item() or 1) for k in ours)
    assert worst < 1e-6
    for text, ids in TODAYS_TOKENS.items():
        assert converted_tokenizer.encode(text) == ids
        assert load_tokenizer("smollm2-135m").encode(text) == ids
    shutil.rmtree(existing_conversions(gguf_files_sha(path))[0])  # 540 MB of float32
