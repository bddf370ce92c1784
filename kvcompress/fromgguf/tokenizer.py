"""A GGUF file's tokenizer, rebuilt from its metadata with `tokenizers` (transformers' own GGUF
loader needs torch).

Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with the pre-tokenizer its `tokenizer.ggml.pre`
names. llama.cpp keeps one regex list per name (src/llama-vocab.cpp, `llm_tokenizer_bpe`); the
splits below are the upstream tokenizer.json forms of the same regexes (llama.cpp rewrites
`(?i:'s|...)` as `'[sS]|...` because std::regex lacks `(?i:`; `tokenizers` has it):
- "smollm" (and starcoder, refact, command-r, ...): single digits, then GPT-2's regex.
- "gpt-2" (and phi-2, olmo, mpt, ...): GPT-2's regex.
- "qwen2": one regex with single digits (`\\p{N}`) and newline-aware runs.
- "llama-bpe" (Llama 3): the same with digit runs of up to three (`\\p{N}{1,3}`).
Tokens typed CONTROL are special (skipped when decoding with skip_special_tokens); USER_DEFINED
tokens are matched whole but decode as text; BOS is prepended only where the file says
`tokenizer.ggml.add_bos_token`.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import ConfigError

TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: <|im_start|>, <|endoftext|>, ...
TOKEN_TYPE_USER_DEFINED = 4  # added tokens that are text (Qwen's <tool_call>, FIM markers)

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = QWEN2_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

# tokenizer.ggml.pre -> the pre-tokenizer family (the names llama.cpp maps to the same regexes)
PRE_TOKENIZERS = {
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"], "digits+gpt2"),
    **dict.fromkeys(["gpt-2", "phi-2", "olmo", "mpt", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
                     "jina-v2-code"], "gpt2"),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen"], "qwen2"),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"], "llama3"),
}


def _plain(value: Any) -> Any:
    """Metadata as plain Python: `mx.load` gives 0-d and 1-d mx arrays, `gguf` gives Python values."""
    return value.tolist() if hasattr(value, "tolist") else value


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    family = PRE_TOKENIZERS.get(pre)
    if family is None:
        raise ConfigError(f"tokenizer.ggml.pre: expected one of {sorted(PRE_TOKENIZERS)}, got {pre!r}")
    if family in ("gpt2", "digits+gpt2"):
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if family == "gpt2":
            return byte_level
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    regex = QWEN2_REGEX if family == "qwen2" else LLAMA3_REGEX
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def gguf_tokenizer(metadata: Mapping[str, Any]):
    """A transformers fast tokenizer from GGUF metadata (a mapping of the `tokenizer.*` keys)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(f"tokenizer.ggml.model: expected 'gpt2' (byte-level BPE; SentencePiece vocabularies "
                          f"are not rebuilt yet), got {kind!r}")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()

    def token(key: str) -> str | None:
        return tokens[int(_plain(metadata[key]))] if key in metadata else None

    bos = token("tokenizer.ggml.bos_token_id")
    if bool(_plain(metadata.get("tokenizer.ggml.add_bos_token", False))) and bos is not None:
        backend.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, tokens.index(bos))]),
        ])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    token_types = _plain(metadata["tokenizer.ggml.token_type"])
    control = [t for t, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_CONTROL]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_USER_DEFINED])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=token("tokenizer.ggml.eos_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        additional_special_tokens=control,
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def eos_token_ids(metadata: Mapping[str, Any]) -> list[int]:
    """The ids generation stops at: EOS and, where the file names one, end-of-turn."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    return sorted({int(_plain(metadata[k])) for k in keys if k in metadata})


TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.eot_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")
