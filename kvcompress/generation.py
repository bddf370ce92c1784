"""Generation with a compressed cache, streamed (`kvcompress generate`, as `mlx_lm.generate`).

`generate` yields the text as mlx-lm streams it, then one `GenerationStats`: the tokens the cache
holds and its resident bytes (kvcompress/memory.py, measured from the arrays) next to what the full
cache would hold for the same tokens, and the decode speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator

from .adapter import model_layout
from .api import compress_prompt, make_cache
from .memory import live_kv_bytes, tokens_kept
from .methods.eviction import EvictionCache


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    tokens_seen: int  # positions the cache was fed (mlx-lm feeds the last generated token too: it runs a step ahead)
    tokens_kept: int  # per attention layer (mean over layers)
    live_kv_bytes: int
    full_kv_bytes: int  # the full cache for the same tokens
    prompt_tok_s: float
    decode_tok_s: float

    def line(self) -> str:
        seen = self.tokens_seen
        return (f"tokens kept {self.tokens_kept}/{seen} ({self.tokens_kept / max(seen, 1):.0%}), "
                f"resident KV {self.live_kv_bytes / 2**20:.2f} MiB vs full {self.full_kv_bytes / 2**20:.2f} MiB "
                f"({self.live_kv_bytes / max(self.full_kv_bytes, 1):.2f}x); prompt {self.prompt_tokens} tokens at "
                f"{self.prompt_tok_s:.1f} tok/s, generated {self.generated_tokens} at {self.decode_tok_s:.1f} tok/s")


def full_kv_bytes(model, tokens: int) -> int:
    """Bytes of the uncompressed cache holding `tokens` tokens: keys and values of every attention
    layer (a sliding layer holds at most its window) in the activations' dtype."""
    layout = model_layout(model)
    return sum(min(tokens, a.window or tokens) * a.n_kv_heads * (a.head_dim + a.value_dim) * layout.dtype.size
               for a in layout.attention)


def prompt_tokens(tokenizer, prompt: str, chat: bool) -> list[int]:
    """The prompt's token ids; `chat`: wrapped in the model's chat template as one user turn."""
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))
    return list(tokenizer.encode(prompt))


def generate(model, tokenizer, prompt: list[int], method: str = "full", max_tokens: int = 256,
             **params: Any) -> Iterator[str | GenerationStats]:
    """Greedy generation from `prompt` (token ids) through a cache compressed by `method`: yields the
    text pieces, then the `GenerationStats`."""
    from mlx_lm import stream_generate

    cache = make_cache(model, method, max_tokens=max_tokens, **params)
    start = time.perf_counter()
    if any(isinstance(c, EvictionCache) and c.scorer.reconstructs for c in cache):
        # KVzip scores the prompt by reconstructing it, which mlx-lm's generate cannot run
        compress_prompt(model, tokenizer, cache, prompt[:-1])
        rest = prompt[-1:]
    else:
        rest = prompt
    prefill_s = time.perf_counter() - start
    response = None
    for response in stream_generate(model, tokenizer, rest, max_tokens=max_tokens, prompt_cache=cache):
        yield response.text
    if response is None:
        raise RuntimeError("generate: mlx-lm produced no response")
    prompt_tok_s = len(prompt) / (prefill_s + len(rest) / max(response.prompt_tps, 1e-9))
    seen = max(c.offset for c in cache if hasattr(c, "offset"))
    yield GenerationStats(len(prompt), response.generation_tokens, seen, tokens_kept(cache), live_kv_bytes(cache),
                          full_kv_bytes(model, seen), prompt_tok_s,
                          response.generation_tps)
