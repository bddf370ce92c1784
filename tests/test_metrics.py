"""kvcompress.metrics.step_metrics against values computed by hand."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

import kvcompress  # noqa: F401  (BLAS before mlx)
from kvcompress.metrics import step_metrics


def test_step_metrics_match_hand_computed_values():
    # full cache: logits (2, 1, 0); method: uniform logits (1, 1, 1); reference token 0
    z = math.exp(2) + math.exp(1) + 1
    p = [math.exp(2) / z, math.exp(1) / z, 1 / z]
    kl = sum(pi * (math.log(pi) - math.log(1 / 3)) for pi in p)  # KL(P_full || P_method), nats
    m = step_metrics(mx.array([2.0, 1.0, 0.0]), mx.array([1.0, 1.0, 1.0]), 0)
    assert m["kl"] == pytest.approx(kl, rel=1e-5)  # = log 3 - H(P_full) = 0.2662...
    assert m["kl"] == pytest.approx(0.26622, abs=1e-4)
    assert m["logit_cosine"] == pytest.approx(3 / (math.sqrt(5) * math.sqrt(3)), rel=1e-6)
    assert m["nll"] == pytest.approx(math.log(3), rel=1e-6)  # -log(1/3): the method's p of token 0
    assert (m["token"], m["ref_argmax"]) == (0, 0)  # ties: the first index, as argmax


def test_step_metrics_identical_and_opposite_distributions():
    logits = mx.array([0.5, -1.0, 3.0, 0.0])
    same = step_metrics(logits, logits, 1)
    assert same["kl"] == pytest.approx(0.0, abs=1e-7) and same["logit_cosine"] == pytest.approx(1.0, rel=1e-6)
    lse = math.log(sum(math.exp(v) for v in (0.5, -1.0, 3.0, 0.0)))
    assert same["nll"] == pytest.approx(lse + 1.0, rel=1e-6)  # -(-1 - logsumexp)
    flipped = step_metrics(logits, -logits, 2)
    assert flipped["logit_cosine"] == pytest.approx(-1.0, rel=1e-6)
    assert (flipped["token"], flipped["ref_argmax"]) == (1, 2)
    assert flipped["nll"] == pytest.approx(3.0 + math.log(sum(math.exp(-v) for v in (0.5, -1.0, 3.0, 0.0))), rel=1e-6)


def test_step_metrics_compute_in_float32_from_half_precision():
    a = mx.array([2.0, 1.0, 0.0], dtype=mx.float16)
    b = mx.array([1.0, 1.0, 1.0], dtype=mx.bfloat16)
    assert step_metrics(a, b, 0)["kl"] == pytest.approx(0.26622, abs=1e-3)
