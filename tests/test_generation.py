"""`kvcompress generate` (kvcompress/generation.py): streamed generation through a compressed cache,
and its line of tokens kept, resident KV against the full cache, and speed."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from kvcompress.generation import GenerationStats, full_kv_bytes, generate, prompt_tokens
from kvcompress.memory import live_kv_bytes
from tests.test_cli import kvcompress, one_line_error

PROMPT = ("The passkey is 7241. Remember it. " + "The grass is green and the sky is blue. " * 20
          + "What is the passkey? The passkey is")

pytestmark = pytest.mark.slow  # the embedded model


def run(model, tokenizer, tokens, method, max_tokens, **params) -> tuple[str, GenerationStats]:
    pieces = list(generate(model, tokenizer, tokens, method, max_tokens, **params))
    assert all(isinstance(p, str) for p in pieces[:-1]) and isinstance(pieces[-1], GenerationStats)
    return "".join(pieces[:-1]), pieces[-1]


def test_full_kv_bytes_is_what_a_full_cache_holds(embedded):
    """The formula (layers x kv heads x (key + value dims) x dtype bytes per token) against a real
    mlx-lm cache's measured bytes after a prefill."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = embedded
    tokens = tokenizer.encode(PROMPT)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache))
    assert full_kv_bytes(model, len(tokens)) == live_kv_bytes(cache) == len(tokens) * 30 * 3 * (64 + 64) * 4


def test_generation_through_the_full_cache_is_mlx_lms_and_compression_shows_in_the_line(embedded):
    from mlx_lm import generate as mlx_generate

    model, tokenizer = embedded
    tokens = prompt_tokens(tokenizer, PROMPT, chat=False)
    text, full = run(model, tokenizer, tokens, "full", 8)
    assert text == mlx_generate(model, tokenizer, tokens, max_tokens=8)  # greedy, the same tokens
    assert full.generated_tokens == 8 and full.tokens_seen == len(tokens) + 8  # mlx-lm runs one step ahead
    assert full.tokens_kept == full.tokens_seen and full.live_kv_bytes == full.full_kv_bytes
    _, snap = run(model, tokenizer, tokens, "snapkv", 8, budget=0.5)
    assert snap.tokens_seen == full.tokens_seen
    assert snap.tokens_kept == round(0.5 * len(tokens)) + 8  # the budget of the prompt, then every new token
    kept_kv = full.full_kv_bytes * snap.tokens_kept / snap.tokens_seen  # (plus each kept token's position index)
    assert kept_kv <= snap.live_kv_bytes <= 1.01 * kept_kv
    _, kivi = run(model, tokenizer, tokens, "kivi", 8, bits=4, residual=32)
    assert kivi.tokens_kept == kivi.tokens_seen and kivi.live_kv_bytes < 0.5 * kivi.full_kv_bytes
    assert re.fullmatch(r"tokens kept \d+/\d+ \(\d+%\), resident KV [\d.]+ MiB vs full [\d.]+ MiB \(0\.\d\dx\); "
                        r"prompt \d+ tokens at [\d.]+ tok/s, generated 8 at [\d.]+ tok/s", kivi.line())
    chat = prompt_tokens(tokenizer, "Hello", chat=True)
    assert len(chat) > len(tokenizer.encode("Hello")) and tokenizer.decode(chat).rstrip().endswith("assistant")


def test_the_command_streams_the_answer_then_its_cache_line(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT)
    done = kvcompress("generate", "--method", "kivi", "--bits", "4", "--param", "residual=32", "--prompt-file",
                      str(prompt), "--max-tokens", "6")
    assert done.returncode == 0, done.stderr[-3000:]
    *text, last = done.stdout.rstrip("\n").split("\n")
    assert "".join(text).strip()  # the answer came first
    assert re.fullmatch(r"\[kivi bits=4 residual=32\] tokens kept \d+/\d+ \(100%\), resident KV [\d.]+ MiB vs full "
                        r"[\d.]+ MiB \(0\.\d\dx\); prompt \d+ tokens at [\d.]+ tok/s, generated 6 at [\d.]+ tok/s", last)
    done = kvcompress("generate", "--method", "snapkv", "--budget", "0.5", "--chat", "--prompt", PROMPT,
                      "--max-tokens", "4")
    assert done.returncode == 0 and "[snapkv budget=0.5] tokens kept" in done.stdout, done.stderr[-3000:]


def test_bad_input_is_one_line_before_the_model_loads():
    assert "kivi.bits: expected one of" in one_line_error(kvcompress("generate", "--method", "kivi", "--bits", "5",
                                                                     "--prompt", "hi"))
    assert one_line_error(kvcompress("generate", "--method", "snapkv")) == \
        "error: --prompt, --prompt-file: expected exactly one of them"
    assert one_line_error(kvcompress("generate", "--prompt-file", "/nonexistent/p.txt")).startswith(
        "error: --prompt-file: cannot read '/nonexistent/p.txt'")
