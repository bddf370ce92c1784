"""The embedded SmolLM2-135M-Instruct loader, its tokenizer, and the mlx_lm.load path (real model)."""

import kvcompress  # noqa: F401  (preloads OpenBLAS before mlx)

import dataclasses
import json

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.utils import save_config, save_model

from kvcompress.embedded import essays_dir
from kvcompress.errors import ConfigError
from kvcompress.model import build_embedded, load_model, load_tokenizer, model_fingerprint, model_info

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def embedded():
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def essay_tokens(embedded):
    """512 tokens of a Paul Graham essay: ordinary English (the model scores 3.04 nats/token on it)."""
    _, tokenizer = embedded
    text = (essays_dir() / "avg.txt").read_text()
    return mx.array(tokenizer.encode(text)[:512])


def token_nll(model, tokens: mx.array) -> float:
    """Mean next-token negative log-likelihood, in nats."""
    logits = model(tokens[None, :-1])[0].astype(mx.float32)
    nll = nn.losses.cross_entropy(logits, tokens[1:], reduction="mean")
    return nll.item()


def test_answers_capital_of_france(embedded):
    model, tokenizer = embedded
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=12)
    assert "Paris" in answer


def test_model_info_and_fingerprint(embedded):
    model, _ = embedded
    assert model_info(model) == {
        "model_class": "llama.Model",
        "n_layers": 30,
        "layer_kinds": "30 global",
        "n_heads": 9,
        "n_kv_heads": 3,
        "head_dim": 64,
        "dtype": "float32",
        "rope_theta": 100000.0,
    }
    assert model.args.vocab_size == 49152 and model.args.tie_word_embeddings
    fingerprint = model_fingerprint("smollm2-135m")
    assert len(fingerprint) == 16 and fingerprint == model_fingerprint("SmolLM2-135M")
    assert model_fingerprint("owner/some-model") != model_fingerprint("owner/other-model")
    assert load_model("smollm2-135m") is embedded  # cached per (name, dtype)


def test_tokenizer_round_trip_and_specials():
    tokenizer = load_tokenizer()
    assert tokenizer is load_tokenizer("SmolLM2-135M")  # one per process
    assert isinstance(tokenizer, mlx_lm.tokenizer_utils.TokenizerWrapper)
    text = "In 2023 the café sold 12,345 crêpes at €3.50 each — 日本語 too 🎉.\n\tIndented line."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # The "smollm" pre-tokenizer splits numbers into single digits.
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("year 2024")) == ["year", "Ġ", "2", "0", "2", "4"]
    assert tokenizer.encode("<|im_end|>") == [tokenizer.eos_token_id] == [2]
    assert tokenizer.encode("<|endoftext|>") == [0]
    assert tokenizer.eos_token_ids == {2}
    chat = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert chat[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.decode(chat).endswith("<|im_start|>assistant\n")
    # The streaming detokenizer mlx-lm uses in generate reproduces the text.
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == text


def test_dequantized_matches_quantized_as_shipped(embedded):
    """The fp32 weights are the GGUF codes expanded exactly: same logits as quantized matmuls."""
    model, tokenizer = embedded
    shipped = build_embedded(mx.float32, quantized=True)
    assert isinstance(shipped.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert shipped.layers[0].self_attn.q_proj.bits == 4 and shipped.model.embed_tokens.bits == 8
    tokens = mx.array(tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True))[None]
    dense_logits, shipped_logits = model(tokens), shipped(tokens)
    assert (dense_logits.argmax(-1) == shipped_logits.argmax(-1)).all().item()
    assert mx.abs(dense_logits - shipped_logits).max().item() < 1e-2


def test_qk_permutation_undone(embedded, essay_tokens):
    """llama.cpp's q/k row order breaks the model; undoing it gives low perplexity on an essay."""
    model, _ = embedded
    nll = token_nll(model, essay_tokens)
    assert nll < 3.5
    still_permuted = build_embedded(mx.float32, unpermute=False)
    assert token_nll(still_permuted, essay_tokens) > nll + 1.5  # measured 5.66 vs 3.04


def test_local_mlx_lm_directory_round_trip(embedded, tmp_path):
    model, tokenizer = embedded
    save_model(tmp_path, model)
    save_config(dataclasses.asdict(model.args), tmp_path / "config.json")
    tokenizer.save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"

    loaded, loaded_tokenizer = load_model(str(tmp_path))
    assert loaded is not model
    prompt = loaded_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert prompt == tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    tokens = mx.array(prompt)[None]
    assert mx.array_equal(loaded(tokens), model(tokens)).item()
    assert load_tokenizer(str(tmp_path)).encode("Paris, 1789") == tokenizer.encode("Paris, 1789")

    # Any other dtype: floating parameters are cast after mlx_lm.load.
    half, _ = load_model(str(tmp_path), dtype=mx.float16)
    assert model_info(half)["dtype"] == "float16" and half.layers[0].mlp.up_proj.weight.dtype == mx.float16
    assert model_fingerprint(str(tmp_path)) not in (model_fingerprint(), model_fingerprint("owner/model"))


def test_bad_names_raise_config_error(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="name_or_path.*no such file"):
        load_model(str(tmp_path / "no" / "such-model"))
    with pytest.raises(ConfigError, match="name_or_path.*no-such-owner/no-such-model"):
        load_model("no-such-owner/no-such-model")
    with pytest.raises(ConfigError, match="dtype.*float32"):
        load_model("smollm2-135m", dtype="int8")
