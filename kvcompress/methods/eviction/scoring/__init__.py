"""Scoring machinery shared by eviction methods (none of these files is a method):
`prompt_scores` (attention over the prompt in bounded memory), `delegating` (the base of methods that
rank by another method's prompt scores: AdaKV, CriticalKV, Decoding), `scored_once` (the base of
methods that score a token once from its key alone: KNorm, random)."""
