"""Each eviction method's prompt selection against an independent float64 NumPy restatement of its
reference code, on the embedded model's real keys and queries (issue #37, item 6); and KIVI's cache
state after prefill against jy-yuan/KIVI's quantization.

One real prompt (passkey, 510 tokens) is prefilled once with SmolLM2-135M (30 layers, 9 query heads,
3 KV heads, head_dim 64). Every method compresses it through the public path (`runner.compress_kv`:
`make_cache`, then `from_prefill` per layer) with its default config (PyramidKV also at other
budgets, AdaKV at a safeguard that binds), and the positions it keeps
(`kept_rows`, one row per KV head) are compared on every layer and KV head with the set the
reference keeps. The references below were written from the reference repositories (read at
FMInference/H2O ac75c2a, d-matrix-ai/keyformer-llm f327831, FasterDecoding/SnapKV e216ddc,
Zefan-Cai/KVCache-Factory c97f9d7, FFY0/AdaKV efe4e2e, NVIDIA/kvpress 8bb29b9,
schwartz-lab-NLP/TOVA 9c7d09b, mit-han-lab/streaming-llm 2e50426, jy-yuan/KIVI 876b4d2), in
float64 from the float32 keys and queries, and call none of kvcompress's scoring or selection code.

Sets must be equal, except where float rounding may flip a near-tie: our caches score in float32
(logits, float32 softmax, sums of up to 9 x 510 terms), whose relative error is ~1e-6, so a token
whose float64 reference score lies within NEAR_TIE (relative) of the reference's cutoff (the lowest
kept score of its ranking) may fall on either side. Only such tokens may differ, and only a few
(each test's `near_ties`, set from what this prompt gives with room for another platform's BLAS).
A swap outside that band, a protected token missing, or one token too many or too few fails.
"""

from __future__ import annotations

import kvcompress  # noqa: F401  (first: loads the optimized BLAS before mlx)

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from kvcompress.datasets import load_dataset, prompt_tokens
from kvcompress.methods import method_config
from kvcompress.runner import compress_kv, prefill

NEAR_TIE = 1e-5


@dataclass
class Prompt:
    model: object
    kv: list  # per layer (keys, values) [1, H, T, D] float32, as the runner passes them
    queries: list  # per layer [1, H_q, T, D] float32
    keys: np.ndarray  # [layers, H, T, D] float64
    values: np.ndarray  # [layers, H, T, D] float64
    query64: np.ndarray  # [layers, H_q, T, D] float64

    @property
    def T(self) -> int:
        return self.keys.shape[2]


@pytest.fixture(scope="module")
def prompt(embedded) -> Prompt:
    model, tokenizer = embedded
    sample = load_dataset("passkey", tokenizer=tokenizer, context_tokens=512, num_samples=1)[0]
    caches, _, _ = prefill(model, prompt_tokens(sample, tokenizer), record_queries=True)
    kv = [c.keys_and_values() for c in caches]
    queries = [c.prompt_queries for c in caches]
    mx.eval(kv, queries)
    as64 = lambda arrays: np.stack([np.array(a[0]) for a in arrays]).astype(np.float64)  # noqa: E731
    return Prompt(model, kv, queries, as64(k for k, _ in kv), as64(v for _, v in kv), as64(queries))


def compress(prompt: Prompt, name: str, **params) -> list:
    method = method_config(name, **params)
    return compress_kv(prompt.model, method, prompt.kv, prompt.queries if method.needs_queries else None)


# -- the comparison ----------------------------------------------------------------------------------


@dataclass
class Selection:
    """A reference's choice for one layer: kept [H, T] bool; the scores it ranked [H, T] (protected
    tokens +inf); the lowest kept score of each row's ranking, [H] (one value for a layer-wide one)."""

    kept: np.ndarray
    ranked: np.ndarray
    cutoff: np.ndarray


def keep_top(scores: np.ndarray, k: int, protected: np.ndarray | None = None) -> Selection:
    """Per row, the protected tokens and the highest-scoring rest, k in all."""
    ranked = scores if protected is None else np.where(protected, np.inf, scores)
    top = np.argsort(-ranked, axis=1, kind="stable")[:, :k]
    kept = np.zeros(ranked.shape, bool)
    np.put_along_axis(kept, top, True, axis=1)
    return Selection(kept, ranked, np.take_along_axis(ranked, top[:, -1:], axis=1)[:, 0])


def compare(caches: list, reference: list[Selection], near_ties: int, per_row_counts: bool = True) -> None:
    """Assert every layer's kept rows equal the reference's but for at most `near_ties` swaps (tokens
    kept here and not there), each a near-tie (see the module docstring)."""
    swapped = 0
    for layer, (cache, ref) in enumerate(zip(caches, reference)):
        rows = cache.kept_rows()
        assert len(rows) == ref.kept.shape[0], f"layer {layer}: {len(rows)} rows, expected {ref.kept.shape[0]}"
        ours = np.zeros(ref.kept.shape, bool)
        for h, row in enumerate(rows):
            assert len(np.unique(row)) == len(row), f"layer {layer} head {h}: a position kept twice"
            ours[h, row] = True
        if per_row_counts:
            np.testing.assert_array_equal(ours.sum(1), ref.kept.sum(1), err_msg=f"layer {layer}: kept per head")
        else:  # a layer-wide top-k (AdaKV): heads may trade a near-tie, the layer's total may not change
            assert ours.sum() == ref.kept.sum(), f"layer {layer}: kept {ours.sum()}, expected {ref.kept.sum()}"
        for h in range(ours.shape[0]):
            differ = np.flatnonzero(ours[h] != ref.kept[h])
            if differ.size == 0:
                continue
            cutoff = ref.cutoff[h]
            gap = np.abs(ref.ranked[h, differ] - cutoff) / abs(cutoff)
            assert (gap < NEAR_TIE).all(), (
                f"layer {layer} head {h}: kept {differ[ours[h, differ]].tolist()}, reference kept "
                f"{differ[ref.kept[h, differ]].tolist()}; reference scores {ref.ranked[h, differ].tolist()} "
                f"against the cutoff {cutoff} (relative gaps {gap.tolist()})")
            swapped += int((ours[h] & ~ref.kept[h]).sum())
    assert swapped <= near_ties, f"{swapped} near-tie swaps, at most {near_ties} expected"


# -- float64 attention, as the references compute it ----------------------------------------------


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def logits_of(queries: np.ndarray, keys: np.ndarray, first: int) -> np.ndarray:
    """Causal attention logits [H_q, L, T] of queries [H_q, L, D] at positions first.. over keys
    [H, T, D]: query head h reads KV head h // G (transformers' repeat_kv layout), scaled by
    1/sqrt(head_dim) as every reference does; a key after its query gets -inf."""
    (H, T, D), (H_q, L, _) = keys.shape, queries.shape
    # the query group folded into the rows: one product per KV head (4x faster than repeating keys)
    logits = (queries.reshape(H, -1, D) @ keys.transpose(0, 2, 1)).reshape(H_q, L, T) / np.sqrt(D)
    causal = np.arange(T)[None, :] <= (first + np.arange(L))[:, None]
    return np.where(causal, logits, -np.inf)


def group_sum(per_query_head: np.ndarray, H: int) -> np.ndarray:
    """[H_q, T] -> [H, T]: the query heads of each KV head summed (GQA)."""
    return per_query_head.reshape(H, -1, per_query_head.shape[-1]).sum(axis=1)


# -- H2O ------------------------------------------------------------------------------------------


def h2o_reference(keys, queries, capacity: int, recent: int) -> Selection:
    """FMInference/H2O h2o_hf/utils_real_drop/modify_llama.py, H2OKVCache_LayerWise: hh_score is the
    attention every prompt query gave a key (softmax rows summed over queries); the cache keeps the
    last `recent_size` tokens and the top `hh_size` of the rest by hh_score. The reference is MHA;
    with GQA the query heads of a KV head are summed."""
    H, T = keys.shape[:2]
    scores = group_sum(softmax(logits_of(queries, keys, 0)).sum(axis=1), H)
    return keep_top(scores, capacity, np.arange(T)[None] >= T - recent)


def test_h2o_keeps_the_references_recent_window_and_heavy_hitters(prompt):
    capacity = round(0.2 * prompt.T)  # H2O's defaults: 20% of the prompt, half of it the recent window
    recent = round(0.5 * capacity)
    reference = [h2o_reference(prompt.keys[i], prompt.query64[i], capacity, recent) for i in range(len(prompt.kv))]
    compare(compress(prompt, "h2o"), reference, near_ties=2)


# -- Keyformer ------------------------------------------------------------------------------------

def lowbias32(x: np.ndarray) -> np.ndarray:
    """C. Wellons' lowbias32 integer hash on uint32 arrays (NumPy array products wrap modulo 2^32)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def keyformer_noise(seed: int, layer: int, n_heads: int, T: int) -> np.ndarray:
    """Gumbel noise zeta [H_q, T, T] of the prompt's queries, restated from the derivation that
    kvcompress/methods/eviction/keyformer.py and counter_hash.py document (the reference draws torch's RNG,
    which no implementation can match, so the test reproduces ours in NumPy, not through its code):
    a stream per (seed, layer, query head), lowbias32(stream ^ (query position + 1)) per query, then
    lowbias32(that ^ key position) per key; u = (top 24 bits + 0.5) / 2^24 in float32 (capped below 1)
    and zeta = -log(-log(u)), here in float64."""
    u32 = np.uint32
    stream = lowbias32(lowbias32(lowbias32(np.array([seed], u32)) ^ u32(layer)) ^ np.arange(n_heads, dtype=u32))
    step = lowbias32(stream[:, None] ^ (np.arange(T, dtype=u32) + u32(1)))  # [H_q, T]
    h = lowbias32(step[:, :, None] ^ np.arange(T, dtype=u32)[None, None, :])  # [H_q, T, T]
    u = ((h >> u32(8)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
    u = np.minimum(u, np.float32(1.0 - 2.0**-24)).astype(np.float64)
    return -np.log(-np.log(u))


def keyformer_reference(keys, queries, noise, tau: float, capacity: int, recent: int) -> Selection:
    """d-matrix-ai/keyformer-llm models/*-keyformer-lib (e.g. modeling_gptj.py, _attn): the score is
    gumbel_softmax(masked logits, tau) = softmax((logits + zeta) / tau) summed over the batch and
    the prompt's queries (tau = tau_init on the prompt: itr_count is 0); the cache keeps the last
    `recent` tokens and the top `key_tokens` of the rest. Masked logits stay at the mask value,
    so they get no probability. With GQA the query heads of a KV head are summed."""
    H, T = keys.shape[:2]
    scores = group_sum(softmax((logits_of(queries, keys, 0) + noise) / tau).sum(axis=1), H)
    return keep_top(scores, capacity, np.arange(T)[None] >= T - recent)


def test_keyformer_keeps_the_references_selection_under_the_same_noise(prompt):
    config = method_config("keyformer")
    capacity = round(config.budget * prompt.T)  # defaults: 60% of the prompt, 30% of it recent
    recent = round(config.recent * capacity)
    H_q = prompt.query64.shape[1]
    reference = [
        keyformer_reference(prompt.keys[i], prompt.query64[i], keyformer_noise(config.seed, i, H_q, prompt.T),
                            config.tau_init, capacity, recent)
        for i in range(len(prompt.kv))
    ]
    compare(compress(prompt, "keyformer"), reference, near_ties=2)


# -- SnapKV, PyramidKV, AdaKV ---------------------------------------------------------------------


def pool1d(scores: np.ndarray, kernel: int, pooling: str) -> np.ndarray:
    """torch max_pool1d / avg_pool1d(kernel, padding=kernel // 2, stride=1) along the last axis:
    max pooling ignores the padding, average pooling counts it as zeros (count_include_pad)."""
    half = kernel // 2
    padded = np.pad(scores, ((0, 0), (half, half)), constant_values=-np.inf if pooling == "max" else 0.0)
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel, axis=-1)
    return windows.max(axis=-1) if pooling == "max" else windows.mean(axis=-1)


def snapkv_scores(keys, queries, window: int, kernel: int, pooling: str) -> np.ndarray:
    """KVCache-Factory pyramidkv/pyramidkv_utils.py, _grouped_window_attn_cache (the GQA form of
    FasterDecoding/SnapKV's SnapKVCluster.update_kv): the last `window` queries attend causally over
    the prompt; their probabilities on the prefix (every token before the window) are summed over
    the window, averaged over the query group, then pooled over the prefix alone. The window itself
    is always kept (+inf here)."""
    H, T = keys.shape[:2]
    probs = softmax(logits_of(queries[:, T - window:], keys, T - window))  # [H_q, w, T]
    votes = probs[:, :, : T - window].sum(axis=1)
    votes = votes.reshape(H, -1, T - window).mean(axis=1)
    return np.concatenate([pool1d(votes, kernel, pooling), np.full((H, window), np.inf)], axis=1)


def snapkv_reference(keys, queries, capacity: int, window: int, kernel: int, pooling: str) -> Selection:
    """SnapKV's selection: the window plus the top capacity - window of the pooled prefix."""
    return keep_top(snapkv_scores(keys, queries, window, kernel, pooling), capacity)


def test_snapkv_keeps_the_references_window_and_pooled_top_prefix(prompt):
    config = method_config("snapkv")  # defaults: half the prompt, window 32, max pooling of width 7
    assert (config.recent, config.kernel, config.pooling) == (32, 7, "max")
    capacity = round(config.budget * prompt.T)
    reference = [snapkv_reference(prompt.keys[i], prompt.query64[i], capacity, 32, 7, "max")
                 for i in range(len(prompt.kv))]
    compare(compress(prompt, "snapkv"), reference, near_ties=2)


def pyramid_shares(mean_share: int, prompt_tokens: int, window: int, n_layers: int, beta: int) -> np.ndarray:
    """Tokens each layer keeps beyond the window, before rounding: KVCache-Factory's PyramidKVCluster
    (the same in FFY0/AdaKV's pyram_mode): from max_num = 2a - a/beta at layer 0 down to min_num = a/beta
    at the last, linear, mean a; where max_num exceeds the prefix (T - window) it is clamped to it
    and min_num = 2a - max_num, so the mean stays a (the surplus goes to the upper layers).
    Not followed: that code's integer steps (`//`, whose total misses layers x a) and its uniform
    SnapKV for T < 2a (kvpress also drops it: "always applies compression_ratio"); nor kvpress's
    fallback where the smallest share is below the window, since there the window is inside the
    share, here it is kept on top of it (KVCache-Factory's layout), so any share >= 0 holds it."""
    min_num = mean_share / beta
    max_num = 2 * mean_share - min_num
    if max_num >= prompt_tokens - window:
        max_num = prompt_tokens - window
        min_num = 2 * mean_share - max_num
    return max_num - np.arange(n_layers) * (max_num - min_num) / (n_layers - 1)


@pytest.mark.parametrize("budget", [0.25, 0.5, 0.75, 0.9])
def test_pyramidkv_layer_budgets_and_selection_follow_the_reference(prompt, budget):
    config = method_config("pyramidkv", budget=budget)  # window 32, kernel 7, max pooling, beta 20
    assert (config.recent, config.kernel, config.pooling, config.beta) == (32, 7, "max", 20)
    n_layers, T, window = len(prompt.kv), prompt.T, 32
    capacity = round(budget * T)
    exact = pyramid_shares(capacity - window, T, window, n_layers, 20)
    caches = compress(prompt, "pyramidkv", budget=budget)
    kept = np.array([[len(row) for row in cache.kept_rows()] for cache in caches])  # [layers, H]
    assert (kept == kept[:, :1]).all(), "a layer's heads keep different counts"
    shares = kept[:, 0] - window
    # integers from the exact linear shares: each within one token of its layer's, and the mean kept
    # over layers exactly the budget (PyramidKV's contract: the same total as SnapKV at that budget)
    assert np.abs(shares - exact).max() < 1, f"layer shares {shares.tolist()}, expected ~{np.round(exact, 2).tolist()}"
    assert kept[:, 0].sum() == n_layers * capacity
    # the selection at each layer's count is SnapKV's
    reference = [snapkv_reference(prompt.keys[i], prompt.query64[i], kept[i, 0], window, 7, "max") for i in range(n_layers)]
    compare(caches, reference, near_ties=2)


def adakv_reference(scores: np.ndarray, capacity: int, safeguard: float) -> Selection:
    """NVIDIA/kvpress presses/adakv_press.py, AdaKVPress.compress over a scorer's [H, T] scores:
    each head first keeps its own top int(n_kept * alpha_safeguard) (lifted to the largest value),
    then the layer keeps its H x n_kept highest scores across heads (kvpress prunes the lowest
    H x (T - n_kept), the same set). The scorer's window (SnapKVPress pads it with max + 1) is +inf."""
    H, T = scores.shape
    lifted = scores.copy()
    own = np.argsort(-scores, axis=1, kind="stable")[:, : int(capacity * safeguard)]
    np.put_along_axis(lifted, own, np.inf, axis=1)
    layer = keep_top(lifted.reshape(1, H * T), H * capacity)
    return Selection(layer.kept.reshape(H, T), lifted, np.repeat(layer.cutoff, H))


@pytest.mark.parametrize("safeguard", [0.2, 0.5])
def test_adakv_keeps_the_kvpress_selection_over_snapkv_scores(prompt, safeguard):
    config = method_config("adakv", safeguard=safeguard)  # defaults: half the prompt, SnapKV's scores
    assert config.scorer == "snapkv" and method_config("adakv").safeguard == 0.2
    capacity = round(config.budget * prompt.T)
    scores = [snapkv_scores(prompt.keys[i], prompt.query64[i], 32, 7, "max") for i in range(len(prompt.kv))]
    reference = [adakv_reference(s, capacity, safeguard) for s in scores]
    if safeguard == 0.5:  # the default's floor (51 tokens a head) binds nowhere on this prompt; this one does
        assert any((ref.kept != adakv_reference(s, capacity, 0.0).kept).any() for ref, s in zip(reference, scores))
    caches = compress(prompt, "adakv", safeguard=safeguard)
    compare(caches, reference, near_ties=2, per_row_counts=False)
    # the heads do trade budget (else this would be SnapKV): some layer keeps unequal counts per head
    assert any(len({len(r) for r in cache.kept_rows()}) > 1 for cache in caches)


# -- TOVA, StreamingLLM, KNorm --------------------------------------------------------------------


def tova_reference(keys, queries, capacity: int) -> Selection:
    """schwartz-lab-NLP/TOVA src/tova_cache.py, TOVACache.reduce: the last query's attention averaged
    over every (query) head of the layer, the top cache_size tokens kept, the same in every KV head."""
    H, T = keys.shape[:2]
    last = softmax(logits_of(queries[:, -1:], keys, T - 1))[:, 0].mean(axis=0)  # [T]
    return keep_top(np.broadcast_to(last, (H, T)), capacity)


def test_tova_keeps_the_tokens_the_last_query_attends_to_most(prompt):
    capacity = round(method_config("tova").budget * prompt.T)
    reference = [tova_reference(prompt.keys[i], prompt.query64[i], capacity) for i in range(len(prompt.kv))]
    compare(compress(prompt, "tova"), reference, near_ties=2)


def test_streaming_keeps_the_sinks_and_the_most_recent_tokens(prompt):
    # mit-han-lab/streaming-llm streaming_llm/kv_cache.py, StartRecentKVCache: keys [0, start_size)
    # and [seq_len - recent_size, seq_len); ranked here by position, the sinks protected
    config = method_config("streaming")  # defaults: half the prompt, 4 sinks
    T, H = prompt.T, prompt.keys.shape[1]
    capacity = round(config.budget * T)
    positions = np.broadcast_to(np.arange(T, dtype=np.float64), (H, T))
    reference = keep_top(positions, capacity, positions < 4)
    np.testing.assert_array_equal(np.flatnonzero(reference.kept[0]),
                                  np.r_[0:4, T - (capacity - 4) : T])  # what the reference slices
    compare(compress(prompt, "streaming"), [reference] * len(prompt.kv), near_ties=0)


def test_knorm_keeps_the_lowest_norm_keys_of_each_head(prompt):
    # NVIDIA/kvpress presses/knorm_press.py: score = -||k|| (L2 over head_dim), the top n_kept per
    # KV head of the prompt kept; no sinks, no window
    capacity = round(method_config("knorm").budget * prompt.T)
    reference = [keep_top(-np.linalg.norm(prompt.keys[i], axis=-1), capacity) for i in range(len(prompt.kv))]
    # layer 0's keys are functions of their token alone, and RoPE keeps norms: the repeated filler's
    # tokens tie exactly there (13 swaps of this prompt, all in layer 0, gaps ~2e-8), broken by float32
    # rounding of the rotation; from layer 1 on context separates them (no swap)
    caches = compress(prompt, "knorm")
    compare(caches[:1], reference[:1], near_ties=20)
    compare(caches[1:], reference[1:], near_ties=0)


# -- KeyDiff, Expected Attention, CriticalKV (NVIDIA/kvpress 8bb29b9) -----------------------------


def test_keydiff_keeps_the_keys_least_like_their_heads_mean_key(prompt):
    # NVIDIA/kvpress presses/keydiff_press.py: anchor = mean of the L2-normalised keys over the
    # sequence, score = -cosine_similarity(key, anchor), the top n_kept per KV head; post-RoPE keys
    capacity = round(method_config("keydiff").budget * prompt.T)
    reference = []
    for keys in prompt.keys:
        unit = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
        anchor = unit.mean(axis=1, keepdims=True)
        reference.append(keep_top(-(unit * anchor).sum(-1) / np.linalg.norm(anchor, axis=-1), capacity))
    compare(compress(prompt, "keydiff"), reference, near_ties=2)


def rope_angles(model, positions) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [len(positions), D/2] of the embedded model's RoPE (non-traditional, base from its
    module), in float64."""
    rope = model.layers[0].self_attn.rope
    assert type(rope).__name__ == "RoPE" and not rope.traditional and rope.scale == 1.0
    theta = rope.base ** (-np.arange(0, rope.dims, 2) / rope.dims)
    angles = np.asarray(positions, np.float64)[:, None] * theta
    return np.cos(angles), np.sin(angles)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Non-traditional RoPE rotation of x [..., D] by cos/sin [..., D/2] (pairs i and i + D/2)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def expected_attention_scores(model, keys, values, queries, n_future=512, n_sink=4, use_covariance=True,
                              use_vnorm=True, epsilon=0.0) -> np.ndarray:
    """NVIDIA/kvpress presses/expected_attention_press.py, ExpectedAttentionPress.score: pre-RoPE
    queries after the first n_sink (kvpress projects the hidden states; here the post-RoPE queries
    rotated back), their mean and population covariance per query head, both carried through the
    RoPE rotation averaged over positions T..T+n_future-1 (R_bar mu, R_bar Sigma R_bar^T), then
    mu.k / sqrt(d) + k Sigma k / (2 d) over the keys after the sinks, softmax, mean over the
    query group, (a + epsilon) ||v||; the sinks kept (+inf here)."""
    (H, T, D), H_q = keys.shape, queries.shape[0]
    cos, sin = rope_angles(model, range(n_sink, T))
    pre = rotate(queries[:, n_sink:], cos, -sin)  # [H_q, T - n_sink, D]
    cos, sin = rope_angles(model, range(T, T + n_future))
    # R_bar as a matrix: column j is the mean rotation of the unit vector e_j
    rotation = rotate(np.eye(D)[:, None, :], cos[None], sin[None]).mean(axis=1).T  # [D, D]
    mean = pre.mean(axis=1) @ rotation.T  # [H_q, D]
    k = np.repeat(keys[:, n_sink:], H_q // H, axis=0)  # [H_q, T', D] (transformers' repeat_kv)
    logits = np.einsum("hd,htd->ht", mean, k) / np.sqrt(D)
    if use_covariance:
        centred = pre - pre.mean(axis=1, keepdims=True)
        cov = rotation @ (np.einsum("hti,htj->hij", centred, centred) / centred.shape[1]) @ rotation.T
        logits += np.einsum("hti,hij,htj->ht", k, cov, k) / D / 2
    scores = softmax(logits).reshape(H, H_q // H, -1).mean(axis=1)
    if use_vnorm:
        scores = (scores + epsilon) * np.linalg.norm(values[:, n_sink:], axis=-1)
    return np.concatenate([np.full((H, n_sink), np.inf), scores], axis=1)


@pytest.mark.parametrize("params", [{}, {"epsilon": 0.0}, {"use_covariance": False, "use_vnorm": False}])
def test_expected_attention_keeps_the_kvpress_selection(prompt, params):
    # default: epsilon 1e-2, kvpress's leaderboard value; {"epsilon": 0.0}: the press's class default
    config = method_config("expected_attention", **params)
    assert (config.n_future_positions, config.n_sink, config.epsilon) == (512, 4, params.get("epsilon", 1e-2))
    params = {"epsilon": config.epsilon, **params}
    capacity = round(config.budget * prompt.T)
    reference = [keep_top(expected_attention_scores(prompt.model, prompt.keys[i], prompt.values[i],
                                                    prompt.query64[i], **params), capacity)
                 for i in range(len(prompt.kv))]
    compare(compress(prompt, "expected_attention", **params), reference, near_ties=2)


@pytest.mark.parametrize("scorer, epsilon", [("expected_attention", 1e-2),
                                             ({"name": "expected_attention", "epsilon": 0.0}, 0.0)])
def test_adakv_over_expected_attention_keeps_the_kvpress_selection(prompt, scorer, epsilon):
    # kvpress's leaderboard entry `expected_attention`: AdaKVPress(ExpectedAttentionPress(epsilon=1e-2)),
    # alpha_safeguard 0.2, by default; its old `adakv_expected_attention` (epsilon 0) as a scorer mapping
    capacity = round(0.5 * prompt.T)
    reference = [adakv_reference(expected_attention_scores(prompt.model, prompt.keys[i], prompt.values[i],
                                                           prompt.query64[i], epsilon=epsilon), capacity, 0.2)
                 for i in range(len(prompt.kv))]
    compare(compress(prompt, "adakv", scorer=scorer), reference, near_ties=2, per_row_counts=False)


def criticalkv_reference(scores, values, w_o, capacity: int, epsilon=1e-4, first_stage_ratio=0.5) -> Selection:
    """NVIDIA/kvpress presses/criticalkv_press.py, CriticalKVPress.score over a scorer's [H, T] scores
    (its protected tokens +inf, as kvpress pads them with the maximum): the top
    int(n_kept x first_stage_ratio) per head lifted, then (score + epsilon) x the L1 norm of
    v W_o^h averaged over the query group (vwl1norm: o_proj.weight^T viewed [H_q, D, hidden]); the
    top n_kept kept. w_o: [hidden, H_q x D] as nn.Linear holds it."""
    H, T, D = values.shape
    per_head = w_o.T.reshape(-1, D, w_o.shape[0])  # [H_q, D, hidden]
    G = per_head.shape[0] // H
    norms = np.stack([np.mean([np.abs(values[h] @ per_head[h * G + g]).sum(-1) for g in range(G)], axis=0)
                      for h in range(H)])
    first = np.argsort(-scores, axis=1, kind="stable")[:, : int(capacity * first_stage_ratio)]
    weighted = (scores + epsilon) * norms
    np.put_along_axis(weighted, first, np.inf, axis=1)
    return keep_top(weighted, capacity)


def test_criticalkv_keeps_the_kvpress_selection_over_snapkv_scores(prompt):
    config = method_config("criticalkv")  # defaults: SnapKV's scores at half the prompt
    assert (config.scorer, config.epsilon, config.first_stage_ratio) == ("snapkv", 1e-4, 0.5)
    capacity = round(config.budget * prompt.T)
    reference = []
    for i in range(len(prompt.kv)):
        w_o = np.array(prompt.model.layers[i].self_attn.o_proj.weight).astype(np.float64)
        scores = snapkv_scores(prompt.keys[i], prompt.query64[i], 32, 7, "max")
        reference.append(criticalkv_reference(scores, prompt.values[i], w_o, capacity))
    # the stage-2 weighting changes what is kept (else this would be SnapKV)
    snap = [snapkv_reference(prompt.keys[i], prompt.query64[i], capacity, 32, 7, "max") for i in range(3)]
    assert any((r.kept != s.kept).any() for r, s in zip(reference, snap))
    compare(compress(prompt, "criticalkv"), reference, near_ties=2)


# -- KIVI -----------------------------------------------------------------------------------------


def kivi_quantize(x: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """jy-yuan/KIVI quant/new_pack.py, triton_quantize_and_pack_along_last_dim, groups of `group`
    along the last axis: mn, mx per group, scale = (mx - mn) / (2^bits - 1), code = round(clamp((x -
    mn) / scale, 0, 2^bits - 1)) (torch rounds half to even, as np.rint). Returns codes, scale and mn
    (per group) and the unrounded (x - mn) / scale."""
    g = x.reshape(*x.shape[:-1], -1, group)
    mn, mx_ = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    scale = (mx_ - mn) / (2**bits - 1)
    ratio = np.clip((g - mn) / scale, 0, 2**bits - 1)
    return np.rint(ratio).reshape(x.shape), scale[..., 0], mn[..., 0], ratio.reshape(x.shape)


def unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """MLX's quantized layout: 32 / bits codes per uint32, the first in the lowest bits."""
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    codes = (words[..., None] >> shifts) & np.uint32(2**bits - 1)
    return codes.reshape(*words.shape[:-1], -1).astype(np.float64)


def test_kivi_prefill_state_is_the_references_quantization(prompt):
    """jy-yuan/KIVI models/llama_kivi.py, prefill: keys quantized per channel (groups of G tokens) up
    to the last multiple of R, the T mod R after stay full precision; values quantized per token
    (groups of G channels) but the last R. Codes, scales and minima equal the float64 restatement;
    a code may differ only where (x - mn) / scale is a near-tie at a half (float32 vs float64)."""
    config = method_config("kivi")
    bits, G, R = config.bits, config.group_size, config.residual
    assert (bits, G, R) == (2, 32, 128)
    T = prompt.T
    n_keys, n_values = T - T % R, T - R
    flipped = 0
    for layer, cache in enumerate(compress(prompt, "kivi")):
        keys, values = prompt.keys[layer], prompt.values[layer]
        np.testing.assert_array_equal(np.array(cache.keys[0]), keys[:, n_keys:])  # full-precision residuals
        np.testing.assert_array_equal(np.array(cache.values[0]), values[:, n_values:])
        sides = ((cache.keys_packed, keys[:, :n_keys].transpose(0, 2, 1)),  # per channel: K^T [H, D, tokens]
                 (tuple(a[:, :, :n_values] for a in cache.values_packed), values[:, :n_values]))
        for (words, scales, zeros), x in sides:
            codes, scale, mn, ratio = kivi_quantize(x, bits, G)
            np.testing.assert_array_equal(np.array(zeros[0]), mn)  # the group minimum, exact in float32
            np.testing.assert_allclose(np.array(scales[0]), scale, rtol=1e-6)  # a float32 quotient
            ours = unpack(np.array(words[0]), bits)
            differ = ours != codes
            half_tie = np.abs(ratio - np.floor(ratio) - 0.5) < NEAR_TIE
            assert (half_tie[differ] & (np.abs(ours - codes)[differ] == 1)).all(), f"layer {layer}: codes differ"
            flipped += int(differ.sum())
    assert flipped <= 3  # 1 of the 4.4M codes on this prompt
