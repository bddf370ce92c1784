"""CriticalKV (kvcompress/methods/eviction/criticalkv.py) on random inputs against a float64 NumPy
restatement of kvpress's CriticalKVPress (its selection on the embedded model's real keys:
tests/test_reference_selection.py); its config and its refusal where no output projection is found."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import numpy as np
import pytest

from kvcompress.errors import ConfigError
from kvcompress.methods import method_config
from kvcompress.methods.eviction.base import PAD

from test_eviction import Drive


@pytest.mark.parametrize("first_stage_ratio, epsilon", [(0.5, 1e-4), (0.0, 1e-4), (1.0, 0.0), (0.3, 0.5)])
def test_two_stage_selection_is_kvpress_over_knorm_scores(first_stage_ratio, epsilon):
    T, budget, B, H, rep, D = 40, 12, 2, 3, 2, 8
    config = method_config("criticalkv", budget=budget, scorer="knorm", first_stage_ratio=first_stage_ratio,
                           epsilon=epsilon)
    drive = Drive(config, B=B, H=H, rep=rep, D=D, T=T, steps=4, seed=7)
    drive.prefill()
    keys = np.array(drive.rope(mx.array(drive.K[:, :, :T]))).astype(np.float64)  # [B, H, T, D] post-RoPE
    values = drive.V[:, :, :T].astype(np.float64)
    # kvpress's vwl1norm: o_proj.weight^T viewed [H_q, D, hidden], ||v W_o^h||_1 averaged over the group
    per_head = np.array(drive.out_proj.weight).astype(np.float64).T.reshape(H * rep, D, -1)
    reweighted = False
    for b in range(B):
        for h in range(H):
            scores = -np.linalg.norm(keys[b, h], axis=-1)  # KnormPress
            norms = np.mean([np.abs(values[b, h] @ per_head[h * rep + g]).sum(-1) for g in range(rep)], axis=0)
            first = np.argsort(-scores, kind="stable")[: int(budget * first_stage_ratio)]
            weighted = (scores + epsilon) * norms
            weighted[first] = np.inf
            expected = np.sort(np.argsort(-weighted, kind="stable")[:budget])
            assert drive.cache.kept_rows()[b * H + h].tolist() == expected.tolist()
            reweighted |= expected.tolist() != np.sort(np.argsort(-scores, kind="stable")[:budget]).tolist()
    assert reweighted == (first_stage_ratio < 1)  # the weighting changes the choice (else this is KNorm)
    assert (np.array(drive.cache.positions) != PAD).all()  # one budget per row: nothing padded
    for p in range(T, T + 4):  # decoding appends to every row
        drive.feed(p)
    assert all(len(row) == budget + 4 for row in drive.cache.kept_rows())


@pytest.mark.parametrize("params, fragment", [
    ({"scorer": "adakv"}, "criticalkv.scorer: expected one of"),
    ({"epsilon": -0.1}, "criticalkv.epsilon: expected a number >= 0"),
    ({"first_stage_ratio": 1.5}, "criticalkv.first_stage_ratio: expected a number in [0, 1], got 1.5"),
])
def test_bad_config_names_the_field_and_the_allowed_values(params, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")):
        method_config("criticalkv", **params)


def test_defaults_are_kvpress_and_the_scorer_decides_budget_and_queries():
    config = method_config("criticalkv")
    assert (config.scorer, config.epsilon, config.first_stage_ratio, config.budget) == ("snapkv", 1e-4, 0.5, 0.5)
    assert config.needs_queries and not method_config("criticalkv", scorer="keydiff").needs_queries
    assert config.resolve(1000) == (500, 32)  # SnapKV's window is protected
    assert method_config("criticalkv", scorer="expected_attention").n_sink == 4


def test_a_model_without_a_plain_output_projection_is_refused_before_any_work():
    from arch_models import tiny_model

    with pytest.raises(ConfigError, match=r"criticalkv: qwen3_next\.Model layer 3 has no output projection"):
        method_config("criticalkv", budget=0.5).make_cache(tiny_model("qwen3_next"))
