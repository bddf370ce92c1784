"""Per-step agreement between a method's next-token distribution and the full cache's."""

from __future__ import annotations

import mlx.core as mx


def step_metrics(ref_logits: mx.array, logits: mx.array, ref_token: int) -> dict[str, float]:
    """KL(P_full || P_method), logit cosine, NLL of the reference token, both argmax tokens.

    ref_logits, logits: [V] (any float dtype; computed in float32).
    """
    ref = ref_logits.astype(mx.float32)
    out = logits.astype(mx.float32)
    ref_logp = ref - mx.logsumexp(ref)
    logp = out - mx.logsumexp(out)
    kl = mx.sum(mx.exp(ref_logp) * (ref_logp - logp))
    cosine = mx.sum(ref * out) / (mx.linalg.norm(ref) * mx.linalg.norm(out))
    nll = -logp[ref_token]
    token, ref_argmax = mx.argmax(out), mx.argmax(ref)
    mx.eval(kl, cosine, nll, token, ref_argmax)
    return {
        "kl": max(kl.item(), 0.0),  # exact KL is >= 0; float rounding can give -1e-9
        "logit_cosine": cosine.item(),
        "nll": nll.item(),
        "token": int(token.item()),
        "ref_argmax": int(ref_argmax.item()),  # the full cache's own top-1 token
    }
