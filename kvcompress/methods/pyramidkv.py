"""PyramidKV (Cai et al., 2024, arXiv:2406.02069): SnapKV with budgets that shrink with depth.

Lower layers attend broadly, upper layers to a few tokens, so the per-layer budget falls linearly
from the first layer to the last while the total over layers stays budget x layers. Beyond the
window w each layer keeps c_l tokens: with a = capacity - w, the last layer gets a / beta, the first
2a - a / beta, linear in between (the paper's Eq. 5-6, beta = 20), rounded so the sum is exactly
layers x a. Scoring is SnapKV's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import check, is_int
from .snapkv import SnapKV


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV: SnapKV scoring, pyramid layer budgets with the same total (beta: top-layer ratio).

    budget: mean tokens kept per KV head over layers (int) or a fraction of the prompt (float).
    recent, kernel, pooling: SnapKV's. beta: the last layer keeps 1/beta of the mean (paper 20).
    """

    name = "pyramidkv"
    beta: int = 20

    def __post_init__(self):
        check(is_int(self.beta) and self.beta >= 1, f"{self.name}.beta", "an int >= 1", self.beta)
        super().__post_init__()

    def layer_capacity(self, capacity: int, recent: int, layer: int, n_layers: int) -> int:
        return recent + layer_shares(capacity - recent, n_layers, self.beta)[layer]


def layer_shares(mean: int, n_layers: int, beta: int) -> list[int]:
    """Integer tokens per layer, linear from 2 mean - mean / beta down to mean / beta, summing to
    n_layers x mean (largest remainders get the rounding)."""
    if n_layers == 1:
        return [mean]
    top = mean / beta
    bottom = 2 * mean - top
    exact = [bottom - layer * (bottom - top) / (n_layers - 1) for layer in range(n_layers)]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(n_layers), key=lambda i: (shares[i] - exact[i], i))
    for i in by_remainder[: n_layers * mean - sum(shares)]:
        shares[i] += 1
    return shares
