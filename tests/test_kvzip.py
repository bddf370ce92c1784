"""KVzip (kvcompress/methods/eviction/kvzip.py, kvcompress/reconstruct.py): the reconstruction scores against
a float64 NumPy restatement of the reference code on random inputs, the head-wise kept sets, the
padded layout at the budget with the memory freed, the runner and the drop-in path on the
embedded model, and AdaKV over KVzip's scores."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import mlx.nn as nn
import mlx.utils
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from kvcompress.adapter import OutputProjection
from kvcompress.datasets import load_dataset, sample_prompt
from kvcompress.errors import ConfigError
from kvcompress.memory import live_kv_bytes
from kvcompress.methods import method_config
from kvcompress.methods.eviction.base import PAD
from kvcompress.reconstruct import ReconstructionPrompt, reconstruct, reconstruction_prompt
from kvcompress import runner
from test_eviction import Drive, rope_at, softmax


def kvzip_reference(Q, K, V, Krep, start, end, n_sink, scale, w_o=None):
    """KVzip's attention/score.py `_get_score` (snu-mllab/KVzip) and kvpress's `score_kvzip`, in float64:
    Q [H, G, S, D] the repeated tokens' queries, K, V [H, T, D] the context, Krep [H, S, D] the
    repeated tokens' keys (all post-RoPE); w_o [H * G, D, hidden] for KVzip+ -> scores [H, end - start]."""
    H, G, S, D = Q.shape
    sink = min(n_sink, start)
    keys = np.concatenate([K[:, :sink], K[:, start:end], Krep], axis=1)
    logits = np.einsum("hgsd,hnd->hgsn", Q, keys) * scale
    logits[..., -S:, -S:] += np.where(np.triu(np.ones((S, S)), 1) > 0, -np.inf, 0.0)  # causal among the repeat
    probs = softmax(logits)
    if w_o is not None:  # KVzip+: times ||W_o^h v||_2 of each query head (kvpress's `kvzip_plus_normalization`)
        values = np.concatenate([V[:, :sink], V[:, start:end], np.zeros_like(Krep)], axis=1)
        norms = np.linalg.norm(np.einsum("hnd,hgde->hgne", values, w_o.reshape(H, G, D, -1)), axis=-1)
        probs = probs * norms[:, :, None, :]
    return probs[..., sink : sink + end - start].max(axis=(1, 2))


def headwise_reference(scores, capacity, n_sink, most):
    """KVzip's head-wise choice (kvpress: AdaKV's compress without the safeguard) over [H, T], each
    head first cut to its own best `most` (None: uncapped) -> kept [H, T] bool."""
    ranked = scores.copy()
    ranked[:, :n_sink] = np.inf
    if most is not None:
        for h in range(len(ranked)):
            ranked[h, np.argsort(-ranked[h], kind="stable")[most:]] = -np.inf
    top = np.argsort(-ranked.ravel(), kind="stable")[: capacity * len(ranked)]
    kept = np.zeros(ranked.size, bool)
    kept[top] = True
    return kept.reshape(ranked.shape)


def reconstruction_pass(drive, chunk_size, seed=1):
    """Drive KVzip's pass over drive's prefilled cache as a model would: per chunk, S random repeated
    tokens at positions T.. (post-RoPE), attended and scored. Returns per chunk (start, end, Q, Krep)
    and checks each pass's attention output against plain causal attention over context + repeat."""
    rng = np.random.default_rng(seed)
    c, T, H, G, D = drive.cache, drive.T, drive.H, drive.rep, drive.D
    chunks = []
    for start in range(0, T, chunk_size):
        end = min(T, start + chunk_size)
        S = end - start + 5  # the request's tokens, then the chunk's
        q = drive.rope(mx.array(rng.standard_normal((1, H * G, S, D)).astype(np.float32)), offset=T)
        k = drive.rope(mx.array(rng.standard_normal((1, H, S, D)).astype(np.float32)), offset=T)
        v = mx.array(rng.standard_normal((1, H, S, D)).astype(np.float32))
        c.chunk = (start, end)
        keys, values = c.update_and_fetch(k, v)
        out = c.attention(q, keys, values, scale=drive.scale, mask="causal")
        c.chunk = None
        assert c.length == T and c.position == T  # nothing of the pass is held
        all_k = np.concatenate([rotated_keys(drive), np.array(k[0])], axis=1)  # [H, T + S, D]
        all_v = np.concatenate([drive.V[0, :, :T], np.array(v[0])], axis=1)
        logits = np.einsum("hgsd,hnd->hgsn", np.array(q[0]).reshape(H, G, S, D), all_k) * drive.scale
        logits = np.where(np.arange(T + S)[None, :] <= (T + np.arange(S))[:, None], logits, -np.inf)
        expected = np.einsum("hgsn,hnd->hgsd", softmax(logits), all_v).reshape(H * G, S, D)
        np.testing.assert_allclose(np.array(out[0]), expected, atol=2e-4, rtol=1e-3)
        chunks.append((start, end, np.array(q[0]).reshape(H, G, S, D).astype(np.float64), np.array(k[0]).astype(np.float64)))
    return chunks


def rotated_keys(drive) -> np.ndarray:
    """The prompt's keys [H, T, D] float64 as the cache holds them (rotated at their positions)."""
    return np.stack([rope_at(k.astype(np.float64), np.arange(drive.T)) for k in drive.K[0, :, : drive.T]])


@pytest.mark.parametrize("params", [dict(), dict(max_head_share=None), dict(headwise=False), dict(kvzip_plus=True),
                                    dict(n_sink=0, chunk_size=40)])
def test_scores_and_kept_sets_match_the_reference_on_random_inputs(params):
    T, H, G, D, budget, chunk = 40, 3, 2, 16, 20, params.get("chunk_size", 16)
    cfg = method_config("kvzip", budget=budget, chunk_size=chunk, **{k: v for k, v in params.items() if k != "chunk_size"})
    drive = Drive(cfg, B=1, H=H, rep=G, D=D, T=T, steps=6, seed=5)
    drive.prefill()
    c = drive.cache
    assert c.prompt_len is None and c.offset == T  # no selection before the pass; its tokens rotate from T
    chunks = reconstruction_pass(drive, chunk)
    K, V = rotated_keys(drive), drive.V[0, :, :T].astype(np.float64)
    w_o = None
    if cfg.kvzip_plus:  # the per-head W_o^h as Drive's projection applies it: x @ W^T
        w_o = np.array(drive.out_proj.weight).T.astype(np.float64).reshape(H * G, D, -1)
    expected = np.zeros((H, T))
    for start, end, Q, Krep in chunks:
        expected[:, start:end] = kvzip_reference(Q, K, V, Krep, start, end, cfg.n_sink, drive.scale, w_o)
    np.testing.assert_allclose(np.array(c.scores), expected, rtol=1e-4, atol=1e-6)

    c.end_reconstruction()
    capacity, _ = cfg.resolve(T)
    if cfg.headwise:
        most = None if cfg.max_head_share is None else max(capacity, int(cfg.max_head_share * capacity))
        kept = headwise_reference(expected, capacity, cfg.n_sink, most)
    else:
        ranked = expected.copy()
        ranked[:, : cfg.n_sink] = np.inf
        kept = np.zeros((H, T), bool)
        np.put_along_axis(kept, np.argsort(-ranked, axis=1, kind="stable")[:, :capacity], True, axis=1)
    rows = c.kept_rows()
    assert [r.tolist() for r in rows] == [np.flatnonzero(k).tolist() for k in kept]
    counts = kept.sum(axis=1)
    assert counts.sum() == capacity * H and (counts[:] >= 0).all()
    if cfg.headwise and cfg.max_head_share is not None:
        assert counts.max() <= int(cfg.max_head_share * capacity)
    assert c.tokens_kept == counts.max() and c.keys.shape[1] == counts.max()  # rows padded to the longest, no more
    for p in range(T, T + 6):  # decoding appends to every row; padding is never attended
        out, before = drive.feed(p)
        np.testing.assert_allclose(out, drive.reference(p, [k[k != PAD] for k in before], False), atol=2e-4, rtol=1e-3)


def test_config_is_validated_before_any_work():
    for field, value in (("chunk_size", 0), ("postfix", -1), ("headwise", 1), ("max_head_share", 0.9),
                         ("kvzip_plus", "yes"), ("budget", 0)):
        with pytest.raises(ConfigError, match=rf"kvzip\.{field}: expected"):
            method_config("kvzip", **{field: value})
    defaults = method_config("kvzip")  # kvpress's KVzipPress: n_sink 4, chunks of 2048, head-wise, no KVzip+
    assert (defaults.n_sink, defaults.chunk_size, defaults.postfix, defaults.headwise, defaults.kvzip_plus) == \
        (4, 2048, 8, True, False)


def test_a_generate_call_without_the_pass_is_refused(tiny_llama):
    caches = kvcompress.make_cache(tiny_llama, "kvzip", budget=8)
    with pytest.raises(RuntimeError, match="compress_prompt"):
        list(generate_step(mx.arange(1, 30), tiny_llama, max_tokens=2, prompt_cache=caches))


def test_round_trips_through_mlx_lm_save_and_load(tiny_llama, tmp_path):
    model = tiny_llama
    prompt = mx.random.randint(0, 128, (60,), key=mx.random.key(4)).tolist()
    caches = kvcompress.make_cache(model, "kvzip", budget=20, chunk_size=25)
    model(mx.array(prompt)[None], cache=caches)
    reconstruct(model, caches, prompt, ReconstructionPrompt((1, 2, 3), (1, 2, 4), (5,)))
    assert all(c.tokens_kept <= int(1.03 * 20) for c in caches)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    token = mx.array([[prompt[-1]]])
    for _ in range(4):  # continues decoding identically
        a, b = model(token, cache=caches), model(token, cache=loaded)
        assert mx.array_equal(a, b).item()
        token = mx.argmax(a[:, -1:], axis=-1)


# -- the embedded model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def passkey(embedded):
    model, tokenizer = embedded
    sample = load_dataset("passkey", tokenizer=tokenizer, context_tokens=256, num_samples=1)[0]
    prompt = sample_prompt(sample, tokenizer)
    context = prompt.tokens[: prompt.question_start]
    prefilled, _, _ = runner.prefill(model, context, record_queries=False)
    return model, tokenizer, sample, prompt, context, prefilled


def test_the_request_is_kvpress_wording_in_the_chat_template(embedded):
    _, tokenizer = embedded
    request = reconstruction_prompt(tokenizer)
    assert tokenizer.decode(list(request.first)) == "\n\nRepeat the previous context exactly."
    assert tokenizer.decode(list(request.later)).endswith("previous context exactly, starting with")
    # SmolLM2's template: the user turn's end, then the assistant's header
    assert tokenizer.decode(list(request.suffix)) == "<|im_end|>\n<|im_start|>assistant\n"


def test_runner_and_drop_in_keep_the_same_tokens_at_the_budget_with_memory_freed(passkey):
    model, tokenizer, _, prompt, context, prefilled = passkey
    method = method_config("kvzip", budget=0.5)
    full = live_kv_bytes(prefilled)
    caches = runner.derive_cache(model, method, prefilled, context, reconstruction_prompt(tokenizer))
    # resident bytes (padding counted) within 5% of the budget; the arrays held are that small
    assert abs(live_kv_bytes(caches) / full / 0.5 - 1) <= 0.05
    differ = 0
    for c in caches:
        counts = [len(r) for r in c.kept_rows()]
        assert sum(counts) == c.capacity * len(counts) and max(counts) <= int(1.03 * c.capacity)
        differ += len(set(counts)) > 1
        assert c._keys.shape[1] == c._values.shape[1] == max(counts) == c.tokens_kept  # no room kept beyond them
    assert differ > len(caches) // 2  # head-wise: most layers' heads keep different counts
    drop_in = kvcompress.compress_prompt(model, tokenizer, kvcompress.make_cache(model, "kvzip", budget=0.5), context)
    for a, b in zip(caches, drop_in):
        assert [r.tolist() for r in a.kept_rows()] == [r.tolist() for r in b.kept_rows()]
    # then mlx-lm generates from the compressed cache with the question
    question = mx.array(prompt.tokens[prompt.question_start :])
    tokens = [int(t) for t, _ in generate_step(question, model, max_tokens=4, prompt_cache=drop_in)]
    assert len(tokens) == 4 and drop_in[0].offset > len(prompt.tokens)


def test_uncapped_is_adakv_over_kvzip_scores_without_safeguard(passkey):
    model, tokenizer, _, _, context, prefilled = passkey
    request = reconstruction_prompt(tokenizer)
    uncapped = runner.derive_cache(model, method_config("kvzip", budget=0.5, max_head_share=None), prefilled,
                                   context, request)
    adakv = runner.derive_cache(model, method_config("adakv", budget=0.5, scorer="kvzip", safeguard=0.0), prefilled,
                                context, request)
    assert method_config("adakv", scorer="kvzip").reconstructs
    for a, b in zip(uncapped, adakv):
        assert [r.tolist() for r in a.kept_rows()] == [r.tolist() for r in b.kept_rows()]
    # uncapped, the padded layout holds far more than the budget (why the cap is the default)
    assert live_kv_bytes(uncapped) / live_kv_bytes(prefilled) > 0.6


def test_sweep_runner_times_the_pass_in_prefill_s(passkey, monkeypatch):
    model, tokenizer, sample, _, _, _ = passkey
    timed, refs = [], []
    real_reconstruct, real_reference = runner.reconstruct, runner.reference

    def reconstruct(*args):
        import time

        start = time.perf_counter()
        real_reconstruct(*args)
        timed.append(time.perf_counter() - start)

    def reference(*args, **kwargs):
        refs.append(real_reference(*args, **kwargs))
        return refs[-1]

    monkeypatch.setattr(runner, "reconstruct", reconstruct)
    monkeypatch.setattr(runner, "reference", reference)
    context = runner.RunContext("smollm2-135m", "test", "passkey", {"context_tokens": 256}, decode_steps=2)
    records = runner.run_sample(model, tokenizer, sample, [method_config("kvzip", budget=0.5)], context,
                                protocols=("query_aware", "query_agnostic"))
    assert [r.run["status"] for r in records] == ["ok", "ok"], [r.run["error"] for r in records]
    assert len(timed) == 2
    for record, seconds in zip(records, timed):
        assert record.run["prefill_s"] >= refs[-1].prefill_s + seconds
    aware, agnostic = records
    # the compressed prompt, then the answer's tokens appended
    assert aware.run["tokens_kept"] <= int(1.03 * round(0.5 * len(refs[-1].prompt))) + refs[-1].steps
