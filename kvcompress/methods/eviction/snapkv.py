"""SnapKV (Li et al., NeurIPS 2024, arXiv:2404.14469): the prompt's last queries vote.

The last `recent` = w prompt queries (the observation window) attend over the prompt; a key's score
is the attention it receives from them, summed over the window and averaged over the KV head's
query group, then smoothed by a 1-D pooling of width `kernel` so neighbours of a hit survive with
it (Sec. 4.1, Alg. 1). The window itself is always kept; the prompt is compressed once and
generated tokens are appended without eviction (the paper compresses only the prompt). Defaults:
window 32, kernel 7, max pooling (the paper's LongBench settings).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ...errors import check, is_int
from .base import Eviction
from .scoring.prompt_scores import folded_logits

POOLINGS = ("max", "avg")


@dataclass(frozen=True)
class SnapKV(Eviction):
    """SnapKV: prompt tokens ranked by the observation window's pooled attention; compress once.

    budget: tokens kept per KV head (int) or a fraction of the prompt (float).
    recent: the observation window w (tokens): its queries score, its tokens are kept (paper 32).
    kernel: pooling width, odd (paper 7). pooling: "max" (paper) or "avg".
    """

    name = "snapkv"
    needs_queries = True
    decode = "grow"
    budget: int | float = 0.5
    recent: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self):
        check(is_int(self.recent) and self.recent >= 1, f"{self.name}.recent", "an int >= 1 (window tokens)", self.recent)
        check(is_int(self.kernel) and self.kernel >= 1 and self.kernel % 2 == 1, f"{self.name}.kernel", "an odd int >= 1", self.kernel)
        check(self.pooling in POOLINGS, f"{self.name}.pooling", f"one of {POOLINGS}", self.pooling)
        super().__post_init__()

    def window(self) -> int:
        return self.recent

    def score_prompt(self, cache, keys, queries):
        # queries [R, G, w, D]: the window, at the prompt's last w positions
        T, w = keys.shape[1], queries.shape[2]
        logits = folded_logits(queries, keys, cache.scale)  # [R, G, w, T]: linear in T
        visible = mx.arange(T)[None, :] <= mx.arange(T - w, T)[:, None]
        probs = mx.softmax(mx.where(visible, logits, -mx.inf), axis=-1, precise=True)
        votes = probs.sum(axis=2).mean(axis=1)  # [R, T]
        # as the paper, only the prefix is pooled (the window is kept anyway)
        return mx.concatenate([pool(votes[:, : T - w], self.kernel, self.pooling), votes[:, T - w :]], axis=1)


def pool(scores: mx.array, kernel: int, pooling: str) -> mx.array:
    """Stride-1 1-D pooling along the last axis with same-size output ([R, T] -> [R, T]).

    Max pooling pads with -inf; average pooling pads with 0 and divides by `kernel` (PyTorch's
    avg_pool1d default, count_include_pad=True).
    """
    if kernel == 1:
        return scores
    half, T = kernel // 2, scores.shape[-1]
    padded = mx.pad(scores, ((0, 0), (half, half)), constant_values=-mx.inf if pooling == "max" else 0.0)
    windows = mx.stack([padded[:, i : i + T] for i in range(kernel)])
    return windows.max(axis=0) if pooling == "max" else windows.sum(axis=0) / kernel
