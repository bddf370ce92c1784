"""StreamingLLM (Xiao et al., ICLR 2024, arXiv:2309.17453): attention sinks + a recent window.

Keeps the first `n_sink` tokens and the most recent `budget - n_sink`. Unlike the paper, which
re-assigns cache-relative RoPE positions, kept keys keep the positions they were rotated at and
`offset` stays the true sequence position: the same convention as Keyformer's default mode, so the
two eviction methods differ only in which tokens they keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from .base import CompressedCache, Method, array_bytes, budget_tokens, check, check_budget


@dataclass(frozen=True)
class Streaming(Method):
    """StreamingLLM: keep `n_sink` first tokens plus a recent window, `budget` tokens in all."""

    name = "streaming"
    budget: int | float = 0.5
    n_sink: int = 4

    def __post_init__(self):
        check_budget("streaming.budget", self.budget)
        check(isinstance(self.n_sink, int) and self.n_sink >= 0, "streaming.n_sink", "an int >= 0", self.n_sink)
        if isinstance(self.budget, int):
            check(self.budget > self.n_sink, "streaming.budget", f"more tokens than n_sink={self.n_sink}", self.budget)

    def make_cache(self, model) -> list:
        return [StreamingCache(self.budget, self.n_sink) for _ in model.layers]


class StreamingCache(CompressedCache):
    """Sinks + recent window. A fractional budget resolves against the prompt when decoding starts."""

    def __init__(self, budget: int | float, n_sink: int):
        self.budget, self.n_sink = budget, n_sink
        self.capacity = budget if isinstance(budget, int) else None
        self.keys = self.values = None  # [B, H_kv, n_kept, D]
        self.offset = 0  # true position of the next token

    def from_prefill(self, keys, values, queries=None):
        self.capacity = budget_tokens(self.budget, keys.shape[2])
        self.update_and_fetch(keys, values)

    def update_and_fetch(self, keys, values):
        # keys, values: [B, H_kv, S, D]; the S new tokens attend to everything kept so far
        if self.capacity is None and keys.shape[2] == 1:  # first decode step: the prompt is complete
            self.capacity = max(budget_tokens(self.budget, self.offset), self.n_sink + 1)
        self.offset += keys.shape[2]
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        fetched = self.keys, self.values
        if self.capacity is not None and self.keys.shape[2] > self.capacity:
            recent = self.capacity - self.n_sink
            self.keys = mx.concatenate([self.keys[:, :, : self.n_sink], self.keys[:, :, -recent:]], axis=2)
            self.values = mx.concatenate([self.values[:, :, : self.n_sink], self.values[:, :, -recent:]], axis=2)
        return fetched

    def make_mask(self, N, return_array=False, window_size=None):
        # stored keys are [kept..., new N]: causal relative to the kept count, not the position
        return create_attention_mask(N, self.tokens_kept, return_array, window_size)

    def kept_positions(self):
        n = self.tokens_kept
        if n == self.offset:
            return None
        recent = n - self.n_sink  # sinks, then the most recent tokens up to offset
        positions = mx.concatenate([mx.arange(self.n_sink), mx.arange(self.offset - recent, self.offset)])
        return mx.broadcast_to(positions, (self.keys.shape[0] * self.keys.shape[1], n))

    def held_kv(self):
        return self.keys, self.values

    @property
    def tokens_kept(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def live_kv_bytes(self) -> int:
        return array_bytes(self.keys, self.values)

    @property
    def state(self):
        return self.keys, self.values

    @state.setter
    def state(self, v):
        self.keys, self.values = v

    def empty(self):
        return self.keys is None
