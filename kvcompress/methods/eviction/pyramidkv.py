"""PyramidKV (Cai et al., 2024, arXiv:2406.02069): SnapKV with budgets that shrink with depth.

Lower layers attend broadly, upper layers to a few tokens, so the per-layer budget falls linearly
from the first layer to the last while the total over layers stays budget x layers. Beyond the
window w each layer keeps c_l tokens: with a = capacity - w, the last layer gets a / beta, the first
2a - a / beta, linear in between (the paper's Eq. 5-6, beta = 20), rounded so the sum is exactly
layers x a. Scoring is SnapKV's.

Above about half the prompt the first layer's share would exceed the prompt (at 0.75 of a
767-token prompt it is ~1.5x the prompt): a layer cannot keep more than it has, so, as
KVCache-Factory and kvpress do, the first layer's share is clamped to the prompt (beyond the window)
and the last layer's raised to keep the mean, still one straight line between them: the mean kept
over layers stays equal to the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import check, is_int
from .snapkv import SnapKV


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV: SnapKV scoring, pyramid layer budgets with the same total (beta: top-layer ratio).

    budget: mean tokens kept per KV head over layers (int) or a fraction of the prompt (float).
    recent, kernel, pooling: SnapKV's. beta: the last layer keeps 1/beta of the mean (paper 20).
    """

    name = "pyramidkv"
    # 1: layer shares clamped to the prompt, the surplus redistributed (above ~52% of the prompt
    # fewer tokens were kept than the budget)
    revision = 1
    beta: int = 20

    def __post_init__(self):
        check(is_int(self.beta) and self.beta >= 1, f"{self.name}.beta", "an int >= 1", self.beta)
        super().__post_init__()

    def layer_capacity(self, capacity: int, recent: int, layer: int, n_layers: int, prompt_tokens: int) -> int:
        return recent + layer_shares(capacity - recent, n_layers, self.beta, prompt_tokens - recent)[layer]


def layer_shares(mean: int, n_layers: int, beta: int, most: int | None = None) -> list[int]:
    """Integer tokens per layer, linear from 2 mean - mean / beta down to mean / beta, summing to
    n_layers x mean (largest remainders get the rounding). With `most` (>= mean), where the first
    layer's share would exceed it, the line runs from `most` down to 2 mean - most instead."""
    if n_layers == 1:
        return [mean]
    top = mean / beta
    bottom = 2 * mean - top
    if most is not None and bottom > most:
        bottom, top = most, 2 * mean - most
    exact = [bottom - layer * (bottom - top) / (n_layers - 1) for layer in range(n_layers)]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(n_layers), key=lambda i: (shares[i] - exact[i], i))
    for i in by_remainder[: n_layers * mean - sum(shares)]:
        shares[i] += 1
    return shares
