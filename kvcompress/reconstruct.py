"""KVzip's reconstruction pass: the model re-reads the held prompt behind a "repeat the context"
request, chunk by chunk, over the full (not yet compressed) cache; the caches score their keys
from the passing queries, then select (kvcompress/methods/eviction/kvzip.py).

`reconstruct` is the pass over caches that hold a prefilled prompt and have not selected yet
(the runner's `compress_kv` gets them so from `from_prefill`); `compress_prompt` is the drop-in
entry: it prefills a prompt into `make_cache`'s caches and runs the pass, after which mlx-lm's
generate continues from the compressed cache. The request's tokens are read from the tokenizer as
kvpress's KVzipPress does (`reconstruction_prompt`).

The pass's tokens are attended and scored but never held: an eviction cache returns its held keys
with the new ones for attention and stores nothing (EvictionCache.update_and_fetch), and the
layers a method leaves to the model (sliding windows, recurrent state) see the pass through
throwaway copies. Only the scores are evaluated, so MLX computes no logits for the pass.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import mlx.core as mx

from .methods.eviction.base import EvictionCache

PREFILL_CHUNK = 2048  # as the runner's prefill and mlx-lm's generate


@dataclass(frozen=True)
class ReconstructionPrompt:
    """Token ids of the request around each chunk: `first` before the first chunk ("Repeat the
    previous context exactly."), `later` before the others ("... starting with", then the previous
    chunk's last tokens), `suffix` after the request (the chat template's turn end and the
    assistant's header; "\\n" without a template)."""

    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...]


def reconstruction_prompt(tokenizer) -> ReconstructionPrompt:
    """The request as KVzip's and kvpress's code word it, in `tokenizer`'s ids and chat template."""
    suffix = "\n"
    if getattr(tokenizer, "chat_template", None):
        # the text the template puts after a user turn's content (kvpress: a dummy turn, split)
        content = "dummy context"
        separator = "\n" + "#" * len(content)
        text = tokenizer.apply_chat_template([{"role": "user", "content": content + separator}],
                                             add_generation_prompt=True, tokenize=False)
        suffix = text.split(separator)[1]

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return ReconstructionPrompt(ids("\n\nRepeat the previous context exactly."),
                                ids("\n\nRepeat the part of the previous context exactly, starting with"), ids(suffix))


def reconstruct(model, caches: list, tokens: list[int], prompt: ReconstructionPrompt) -> None:
    """Score the held prompt `tokens` by reconstructing it, then select, in every cache whose method
    reconstructs; the others are left as they are. Each such cache holds exactly `tokens`, uncompressed."""
    scoring = [c for c in caches if isinstance(c, EvictionCache) and c.scorer.reconstructs]
    if not scoring:
        return
    T = len(tokens)
    for cache in scoring:
        if cache.prompt_len is not None or cache.position != T:
            raise ValueError(f"reconstruct: every cache must hold the {T} prompt tokens uncompressed; one holds "
                             f"{cache.position} ({'compressed' if cache.prompt_len is not None else 'uncompressed'})")
        if cache.batch != 1:
            raise ValueError(f"reconstruct: one prompt at a time (batch 1), got batch {cache.batch}")
    config = scoring[0].scorer
    chunks = [(start, min(T, start + config.chunk_size)) for start in range(0, T, config.chunk_size)]
    for start, end in chunks:
        request = prompt.first if start == 0 else prompt.later + tuple(tokens[max(0, start - config.postfix):start])
        ids = mx.array([*request, *prompt.suffix, *tokens[start:end]])[None]
        for cache in scoring:
            cache.chunk = (start, end)
        # other layers see the pass through copies, so their state stays the prompt's
        passing = [c if c in scoring else copy.deepcopy(c) for c in caches]
        try:
            model(ids, cache=passing)
            mx.eval([c.scores for c in scoring])
        finally:
            for cache in scoring:
                cache.chunk = None
    for cache in scoring:
        cache.end_reconstruction()
    mx.eval([c.state[:4] for c in scoring])


def compress_prompt(model, tokenizer, cache: list, prompt: list[int]) -> list:
    """Prefill `prompt` (token ids) into `cache` (from `kvcompress.make_cache`) and compress it;
    for a method that reconstructs (KVzip) the reconstruction pass runs here, which mlx-lm's
    generate cannot run. Then generate from `cache` with the tokens that follow the prompt (a
    question, or just the next one): mlx-lm feeds them through the compressed cache. Returns `cache`.
    Other methods compress as in generate: the prompt in chunks, its last token alone; so does KVzip
    where its budget covers the prompt (nothing to score: kept whole, `Eviction.resolve`)."""
    if not prompt:
        raise ValueError("compress_prompt: expected a prompt of at least 1 token, got none")
    T = len(prompt)
    reconstructing = any(isinstance(c, EvictionCache) and c.scorer.reconstructs
                         and c.config.resolve(T, c.layer, c.n_layers)[0] < T for c in cache)
    # a one-token call ends a prompt (the eviction base): a reconstructing method's must not come alone
    last = len(prompt) if reconstructing else len(prompt) - 1
    bounds = sorted({*range(0, last, PREFILL_CHUNK), last})
    if reconstructing and len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    bounds += [] if reconstructing else [len(prompt)]
    for begin, end in zip(bounds, bounds[1:]):
        mx.eval(model(mx.array(prompt[begin:end])[None], cache=cache))
    if reconstructing:
        reconstruct(model, cache, prompt, reconstruction_prompt(tokenizer))
    return cache
