"""The base of eviction methods that rank by another method's prompt scores (AdaKV, CriticalKV).

Such a method names its scorer (`scorer`, built with that method's defaults at the same budget) and
changes only how the scores select: the scorer's budget resolution, protected sinks and window,
and whether it needs the prompt's queries are the scorer's. Like the scorers' own prompt-time
compression (kvpress's presses wrap any ScorerPress the same way), only the prompt is compressed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import check
from .eviction import Eviction

# every eviction method that scores the prompt itself (not one that delegates)
SCORERS = ("snapkv", "h2o", "tova", "knorm", "keyformer", "streaming", "random", "keydiff", "expected_attention",
           "kvzip")


@dataclass(frozen=True)
class Delegating(Eviction):
    """Base config: `scorer` names the method whose prompt scores rank tokens (its defaults)."""

    decode = "grow"
    budget: int | float = 0.5
    scorer: str = "snapkv"

    def __post_init__(self):
        check(self.scorer in SCORERS, f"{self.name}.scorer", f"one of {SCORERS}", self.scorer)
        super().__post_init__()

    @property
    def needs_queries(self) -> bool:
        return self.scoring().needs_queries

    @property
    def reconstructs(self) -> bool:
        return self.scoring().reconstructs

    def scoring(self) -> Eviction:
        from . import REGISTRY  # the registry imports this module

        return REGISTRY[self.scorer](budget=self.budget)

    def resolve(self, prompt_tokens: int, layer: int = 0, n_layers: int = 1) -> tuple[int, int]:
        return self.scoring().resolve(prompt_tokens, layer, n_layers)

    def window_shortfall(self, prompt_tokens: int) -> str:
        return self.scoring().window_shortfall(prompt_tokens)

    @property
    def n_sink(self) -> int:
        return self.scoring().n_sink
