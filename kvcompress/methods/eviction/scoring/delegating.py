"""The base of eviction methods that rank by another method's prompt scores (AdaKV, CriticalKV).

Such a method names its scorer (`scorer`) and changes only how the scores select: the scorer's
budget resolution, protected sinks and window, and whether it needs the prompt's queries are the
scorer's. Like the scorers' own prompt-time compression (kvpress's presses wrap any ScorerPress the
same way), only the prompt is compressed.

`scorer` is a name (the scorer at its own defaults) or a mapping of the name and the scorer's own
parameters, as kvpress wraps a configured press (`AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))`):
`scorer={"name": "expected_attention", "epsilon": 0.01}`, in a grid `scorer: {name: expected_attention,
epsilon: 0.01}`. The scorer's config validates them (errors name `adakv.scorer.epsilon`); its budget
is the owner's, and `layers` / `quantize` are the owner's too, so a scorer mapping may not set them.

Identity: a scorer whose parameters all equal its defaults is held as its name, so configs written
before scorer parameters existed keep their run ids; one with parameters is held as its validated
config, and its run config, id and label carry the parameters that differ from the scorer's defaults
(`to_dict`: `{"name": "expected_attention", "epsilon": 0.0}`; label: `scorer=expected_attention(epsilon=0.0)`).
A fix that changes what a scorer computes (its `revision`) changes the ids of the methods that
delegate to it (`revisions()`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

from ....errors import ConfigError, build
from ...base import Method
from ...registry import REGISTRY
from ..base import Eviction

# every eviction method that scores the prompt itself (not one that delegates)
SCORERS = ("snapkv", "h2o", "tova", "knorm", "keyformer", "streaming", "random", "keydiff", "expected_attention",
           "kvzip")
# Scorer revisions made before a delegating method's run config carried its scorer's (2026-12-07):
# those configs keep the ids they had; later revisions of a scorer change its delegators' ids.
UNTRACKED_REVISIONS = {"knorm": 1, "random": 1, "keyformer": 2}
# a scorer's parameters that belong to the method delegating to it
OWNER_PARAMS = ("budget", "layers", "quantize")


@dataclass(frozen=True)
class Delegating(Eviction):
    """Base config: `scorer` names the method whose prompt scores rank tokens, with its parameters."""

    decode = "grow"
    # the scorers a method accepts, and why others are refused (shown in the error)
    allowed_scorers: ClassVar[tuple[str, ...]] = SCORERS
    scorer_note: ClassVar[str] = ""
    budget: int | float = 0.5
    scorer: Any = "snapkv"  # a name, or {"name": ..., **the scorer's parameters} (module docstring)

    def __post_init__(self):
        object.__setattr__(self, "scorer", scorer_config(self, self.scorer))
        super().__post_init__()

    @property
    def scorer_name(self) -> str:
        return self.scorer if isinstance(self.scorer, str) else self.scorer.name

    @property
    def needs_queries(self) -> bool:
        return self.scoring().needs_queries

    @property
    def reconstructs(self) -> bool:
        return self.scoring().reconstructs

    def scoring(self) -> Eviction:
        """The scorer's config at this method's budget."""
        if isinstance(self.scorer, str):
            return REGISTRY[self.scorer](budget=self.budget)
        return replace(self.scorer, budget=self.budget)

    def resolve(self, prompt_tokens: int, layer: int = 0, n_layers: int = 1) -> tuple[int, int]:
        return self.scoring().resolve(prompt_tokens, layer, n_layers)

    def window_shortfall(self, prompt_tokens: int) -> str:
        return self.scoring().window_shortfall(prompt_tokens)

    @property
    def n_sink(self) -> int:
        return self.scoring().n_sink

    def params(self) -> dict[str, Any]:
        """The scorer as its name, or its name and the parameters that differ from its defaults."""
        values = super().params()
        if not isinstance(self.scorer, str):
            values["scorer"] = {"name": self.scorer.name, **scorer_params(self.scorer)}
        return values

    def revisions(self) -> dict[str, int]:
        scorer = self.scoring()
        revision = scorer.revision - UNTRACKED_REVISIONS.get(scorer.name, 0)
        return {**super().revisions(), **({"scorer_revision": revision} if revision else {})}


def scorer_params(config: Eviction) -> dict[str, Any]:
    """A scorer config's parameters that differ from its defaults, less its owner's (OWNER_PARAMS)."""
    default = type(config)()
    return {f.name: getattr(config, f.name) for f in fields(config)
            if f.name not in OWNER_PARAMS and getattr(config, f.name) != getattr(default, f.name)}


def scorer_config(owner: Delegating, value: Any) -> str | Eviction:
    """`owner.scorer` validated: the scorer's name where every parameter is its default, else the
    scorer's config (at the scorer's default budget; `scoring()` sets the owner's). ConfigError naming
    `<owner>.scorer...` and the allowed values."""

    field, allowed = f"{owner.name}.scorer", owner.allowed_scorers
    name_field = field if isinstance(value, str) else f"{field}.name"
    if isinstance(value, Method):
        value = {"name": value.name, **scorer_params(value)} if isinstance(value, Eviction) else {"name": value.name}
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict):
        raise ConfigError(f"{field}: expected a scorer name, one of {allowed}, or a mapping such as "
                          f"{{'name': 'expected_attention', 'epsilon': 0.01}}, got {value!r}")
    name = value.get("name")
    if name not in allowed:
        raise ConfigError(f"{name_field}: expected one of {allowed}{owner.scorer_note}, got {name!r}")
    params = {k: v for k, v in value.items() if k != "name"}
    owned = sorted(set(params) & set(OWNER_PARAMS))
    if owned:
        raise ConfigError(f"{field}.{owned[0]}: set by {owner.name}.{owned[0]} (the scorer scores at its owner's "
                          f"budget, layers and quantizer); expected it unset, got {params[owned[0]]!r}")
    try:
        config = build(field, REGISTRY, name, params)
    except ConfigError as exc:  # "expected_attention.epsilon: ..." -> "adakv.scorer.epsilon: ..."
        message = str(exc)
        raise ConfigError(f"{field}.{message[len(name) + 1:]}" if message.startswith(f"{name}.")
                          else f"{field}: {message}") from None
    except TypeError as exc:
        raise ConfigError(f"{field}: {exc}") from None
    return config if scorer_params(config) else name
