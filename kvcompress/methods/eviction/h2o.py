"""H2O, Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023, arXiv:2306.14048).

A key's score is the attention it has received, summed over every query so far (prompt and
generated), s_j += softmax_j(x_tj); the cache keeps the recent window plus the highest-scoring
"heavy hitters". The paper splits the budget equally between the two (recent = 0.5 of the budget)
and evaluates at 20% of the prompt. No noise, no temperature: those are Keyformer's.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Eviction


@dataclass(frozen=True)
class H2O(Eviction):
    """H2O: recent window + heavy hitters by accumulated attention (paper: equal shares, 20% budget).

    budget: tokens kept per KV head (int) or a fraction of the prompt (float; paper 0.2).
    recent: recent window, tokens (int) or a fraction of the budget (float; paper 0.5).
    """

    name = "h2o"
    needs_queries = True
    budget: int | float = 0.2
    recent: int | float = 0.5
