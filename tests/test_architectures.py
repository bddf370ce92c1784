"""The architecture matrix: every method on a tiny random-weight model of each mlx-lm architecture
(tests/arch_models.py) is right or refused up front.

Each cell feeds the same 40-token prompt the way mlx-lm's generate does (all but the last token in
one call, the last alone) and 8 greedy tokens, and compares with mlx-lm's own prompt cache
(`make_prompt_cache`, the reference):
- lossless settings (`full`; every eviction method with a budget above prompt + answer) give
  exactly mlx-lm's tokens and the same log-probabilities;
- KIVI at 8 bits stays within a few times mlx-lm's own 8-bit cache's error;
- eviction with a quantizer (snapkv + kivi-8 above the prompt) stays within a few times plain
  KIVI-8's error, and lossy compositions run;
- QJL with its default recent buffer (128 tokens, more than the 48 fed) holds every token exactly:
  mlx-lm's tokens and log-probabilities, through its own attention;
- lossy settings (half budgets, 2-bit KIVI, 3- and 2.5-bit TurboQuant, QJL with a 32-token buffer)
  run and give finite log-probabilities;
- a cell that cannot be right raises ConfigError from `make_cache`, before any token is fed (on the
  KV-sharing models, Gemma 4's shared layers, IQuest Loop Coder, AFM 7, every method but `full`).
KVzip reconstructs the prompt with the model before it compresses (kvcompress/reconstruct.py): its
cells run that pass after the prompt, over every layer kind (windows and recurrent state see it
through copies and must come out unchanged: the lossless cells check it).
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from arch_models import ARCHITECTURES, WINDOW, tiny_model
from kvcompress import attention, make_cache
from kvcompress.adapter import model_layout, positional_rope
from kvcompress.errors import ConfigError
from kvcompress.kernels.evict import rotate_pairs
from kvcompress.memory import live_kv_bytes
from kvcompress.adapter import rope_rotations
from kvcompress.reconstruct import ReconstructionPrompt, reconstruct

PROMPT, ANSWER = 40, 8
LOSSLESS_BUDGET = 64  # > PROMPT + ANSWER: nothing is ever evicted
EVICTION = ("streaming", "h2o", "keyformer", "snapkv", "pyramidkv", "adakv", "tova", "knorm", "random", "keydiff",
            "expected_attention", "criticalkv", "duoattention", "decoding", "kvzip")
# settings sized for the 40-token prompt (duoattention's streaming heads: 128 + 256 tokens by default)
SMALL = {"duoattention": {"n_sink": 4, "recent": 8}}
# KVzip's "repeat the context" request, as ids of the tiny models' vocabulary (they have no tokenizer)
REQUEST = ReconstructionPrompt(first=(7, 8, 9, 10), later=(7, 8, 11), suffix=(12, 13))

# Where a cell must refuse, and the reason make_cache's ConfigError gives (every other cell must run).
ATTENTION_REFUSED = {  # no kvcompress cache can serve these models' attention layers
    "gemma2": "computes attention itself",  # soft-capped logits: the hook never runs
    "deepseek_v3": "other arrays than the cache returned",  # MLA: latent keys expanded per head
    "stablelm": "other arrays than the cache returned",  # keys cast to float32 after the cache
    "falcon_h1": "no global attention layer",  # attention and Mamba side by side in a CacheList
}
# a layer's keys read outside its attention call (KV sharing across layers): only `full` serves them
KV_SHARING_REFUSED = {name: "read outside its own attention call"
                      for name in ("gemma4_kv_shared", "iquestloopcoder", "afm7")}
EVICTION_REFUSED = {"deepseek_v2": "values have 32 dims and its keys 48"}
# CriticalKV reads W_o v: no module takes Qwen3-Next's attention output as it is (it is gated first)
OUTPUT_PROJECTION_REFUSED = {"qwen3_next": "no output projection"}
QUANTIZER_REFUSED = {"deepseek_v2": "divisor of the model's head_dim 48"}  # 48-dim keys, groups of 32
# KVQuant quantizes keys before RoPE by rotating them back: refused where a compressed layer has no RoPE
# the adapter can invert by position (NoPE layers, none found, a length-dependent base)
PRE_ROPE_REFUSED = {"cohere2": "rotate by position alone", "exaone4": "rotate by position alone",
                    "granitemoehybrid": "rotate by position alone", "internlm3": "rotate by position alone",
                    "smollm3": "rotate by position alone"}


def expected_refusal(name: str, method: str) -> str | None:
    if method == "full":
        return None
    if name in KV_SHARING_REFUSED:
        return KV_SHARING_REFUSED[name]
    if method == "kvquant" and name == "deepseek_v2":
        return "multiples of 32"
    if name in ATTENTION_REFUSED:
        return ATTENTION_REFUSED[name]
    if method == "kvquant" and name in PRE_ROPE_REFUSED:
        return PRE_ROPE_REFUSED[name]
    if method in ("qjl", "turboquant"):  # no channel groups on keys (QJL's values' groups divide every value dim here)
        return None
    if method == "criticalkv" and name in OUTPUT_PROJECTION_REFUSED:
        return OUTPUT_PROJECTION_REFUSED[name]
    if method in EVICTION:
        return EVICTION_REFUSED.get(name)
    return QUANTIZER_REFUSED.get(name)


def _decode(model, caches, prompt: list[int], steps: int = ANSWER):
    """Greedy tokens and the log-probabilities [steps, V] that chose them."""
    tokens, logprobs = [], []
    logits = model(mx.array(prompt[:-1])[None], cache=caches)
    mx.eval(logits)
    reconstruct(model, caches, prompt[:-1], REQUEST)  # KVzip's pass; nothing for other caches
    token = prompt[-1]
    for _ in range(steps):
        logits = model(mx.array([[token]]), cache=caches)[0, -1].astype(mx.float32)
        lp = logits - mx.logsumexp(logits)
        token = int(mx.argmax(lp).item())
        tokens.append(token)
        logprobs.append(np.array(lp))
    return tokens, np.stack(logprobs)


@pytest.fixture(scope="module")
def models():
    attention.install()
    built = {}

    def get(name):
        if name not in built:
            model = tiny_model(name)
            rng = np.random.default_rng(0)
            prompt = rng.integers(1, 500, PROMPT).tolist()
            built[name] = (model, prompt, _decode(model, make_prompt_cache(model), prompt))
        return built[name]

    return get


ARCHS = sorted(ARCHITECTURES)


@pytest.mark.parametrize("name", ARCHS)
def test_full_is_mlx_lms_own_cache(name, models):
    model, prompt, (ref_tokens, ref_lp) = models(name)
    caches = make_cache(model, "full")
    assert [type(c) for c in caches] == [type(c) for c in make_prompt_cache(model)]
    tokens, lp = _decode(model, caches, prompt)
    assert tokens == ref_tokens
    np.testing.assert_array_equal(lp, ref_lp)
    # the baseline's bytes are what mlx-lm holds: a sliding layer its window, not the whole context
    for layer in model_layout(model).attention:
        if layer.kind == "sliding":
            assert caches[layer.index].keys.shape[2] <= max(WINDOW, 256)
            assert min(caches[layer.index].offset, WINDOW) == WINDOW


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("method", EVICTION)
def test_eviction_above_the_prompt_is_lossless_or_refused(name, method, models):
    model, prompt, (ref_tokens, ref_lp) = models(name)
    reason = expected_refusal(name, method)
    if reason:
        with pytest.raises(ConfigError, match=reason):
            make_cache(model, method, budget=LOSSLESS_BUDGET, **SMALL.get(method, {}))
        return
    caches = make_cache(model, method, budget=LOSSLESS_BUDGET, **SMALL.get(method, {}))
    tokens, lp = _decode(model, caches, prompt)
    assert tokens == ref_tokens
    np.testing.assert_allclose(lp, ref_lp, atol=2e-4, rtol=0)
    # the layers the method leaves to the model (windows, recurrent state) keep the model's caches
    native = make_prompt_cache(model)
    for layer in model_layout(model).attention:
        if layer.kind != "global":
            assert type(caches[layer.index]) is type(native[layer.index])


@pytest.mark.parametrize("name", ARCHS)
def test_lossy_settings_run(name, models):
    model, prompt, _ = models(name)
    full_bytes = None
    for method, params in (("h2o", {"budget": 0.5}), ("snapkv", {"budget": 0.5, "recent": 8}),
                           ("pyramidkv", {"budget": 0.5, "recent": 8}), ("adakv", {"budget": 0.9}),  # window 32
                           ("keyformer", {"budget": 24, "positions": "compact"}), ("streaming", {"budget": 24}),
                           ("keydiff", {"budget": 0.5}), ("expected_attention", {"budget": 0.5}),
                           ("criticalkv", {"budget": 0.5, "scorer": "expected_attention"}),
                           ("duoattention", {"budget": 0.5, "n_sink": 4, "recent": 8}),
                           ("decoding", {"budget": 0.5, "scorer": "keydiff", "compression_interval": 3, "target_size": 2}),
                           ("kvzip", {"budget": 0.5, "chunk_size": 16}), ("kvzip", {"budget": 0.5, "kvzip_plus": True}),
                           ("kivi", {"bits": 2, "group_size": 32, "residual": 32}), ("turboquant", {"bits": 3}),
                           ("turboquant", {"bits": 2.5}), ("qjl", {"buffer": 32}),
                           ("kvquant", {"bits": 3})):
        if reason := expected_refusal(name, method) or (params.get("kvzip_plus") and OUTPUT_PROJECTION_REFUSED.get(name)):
            with pytest.raises(ConfigError, match=reason):
                make_cache(model, method, **params)
            continue
        try:
            caches = make_cache(model, method, **params)
        except ConfigError as error:  # only compact positions on a RoPE that is not positional
            assert method == "keyformer" and "positions" in str(error), error
            continue
        tokens, lp = _decode(model, caches, prompt)
        assert np.isfinite(lp).all() and len(tokens) == ANSWER, (method, params)
        if method == "h2o":
            full = make_cache(model, "full")
            _decode(model, full, prompt)
            full_bytes = live_kv_bytes(full)
            assert live_kv_bytes(caches) < full_bytes
        if method == "duoattention" and full_bytes:  # streaming heads' middle tokens are freed, not masked
            assert live_kv_bytes(caches) < full_bytes


@pytest.mark.parametrize("name", ARCHS)
def test_qjl_within_its_buffer_is_lossless_or_refused(name, models):
    model, prompt, (ref_tokens, ref_lp) = models(name)
    if reason := expected_refusal(name, "qjl"):
        with pytest.raises(ConfigError, match=reason):
            make_cache(model, "qjl")
        return
    tokens, lp = _decode(model, make_cache(model, "qjl"), prompt)
    assert tokens == ref_tokens
    np.testing.assert_allclose(lp, ref_lp, atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", ARCHS)
def test_kivi_8bit_within_mlx_lms_8bit_error(name, models):
    model, prompt, (ref_tokens, ref_lp) = models(name)
    if reason := expected_refusal(name, "kivi"):
        for method, params in (("kivi", {"bits": 8, "group_size": 32, "residual": 32}), ("mlx-quant", {"bits": 8})):
            with pytest.raises(ConfigError, match=reason):
                make_cache(model, method, **params)
        return
    _, kivi_lp = _decode(model, make_cache(model, "kivi", bits=8, group_size=32, residual=32), prompt)
    kivi_err = float(np.abs(kivi_lp - ref_lp).max())
    try:
        mlx_quant = make_cache(model, "mlx-quant", bits=8, group_size=32)
    except ConfigError as error:  # Phi-2 reads the dtype of mlx-lm's quantized tuples: the bound is absolute
        assert name == "phi" and "does not run on phi" in str(error), error
        assert kivi_err < 0.05
        return
    _, mlx_lp = _decode(model, mlx_quant, prompt)
    mlx_err = float(np.abs(mlx_lp - ref_lp).max())
    assert kivi_err <= max(4 * mlx_err, 1e-3), (kivi_err, mlx_err)


@pytest.mark.parametrize("name", ARCHS)
def test_eviction_with_a_quantizer_is_right_or_refused(name, models):
    """snapkv + kivi-8 at a budget above the prompt keeps every token, held as 8-bit codes: within a few
    times plain KIVI-8's error of mlx-lm's cache (its prompt's last token attends in full precision,
    as the eviction cache compresses after it); the half budget with 2-bit codes and AdaKV's padded
    rows over TurboQuant run. Refused where either part is (methods/composed.py)."""
    model, prompt, (ref_tokens, ref_lp) = models(name)
    lossless = {"budget": LOSSLESS_BUDGET, "quantize": {"name": "kivi", "bits": 8, "group_size": 32, "residual": 32}}
    lossy = (("snapkv", {"budget": 0.5, "recent": 8, "quantize": {"name": "kivi", "bits": 2, "residual": 32}}),
             ("adakv", {"budget": 0.9, "quantize": {"name": "turboquant", "bits": 3}}))
    reason = expected_refusal(name, "snapkv") or expected_refusal(name, "kivi")
    if reason:
        with pytest.raises(ConfigError, match=reason):
            make_cache(model, "snapkv", **lossless)
        return
    _, kivi_lp = _decode(model, make_cache(model, "kivi", bits=8, group_size=32, residual=32), prompt)
    _, lp = _decode(model, make_cache(model, "snapkv", **lossless), prompt)
    kivi_err, err = float(np.abs(kivi_lp - ref_lp).max()), float(np.abs(lp - ref_lp).max())
    assert err <= max(4 * kivi_err, 1e-3), (err, kivi_err)
    for method, params in lossy:
        if (reason := expected_refusal(name, params["quantize"]["name"])):
            with pytest.raises(ConfigError, match=reason):
                make_cache(model, method, **params)
            continue
        caches = make_cache(model, method, **params)
        tokens, lp = _decode(model, caches, prompt)
        assert np.isfinite(lp).all() and len(tokens) == ANSWER, (method, params)


def test_the_matrix_covers_the_issue_families():
    families = {"llama", "qwen3", "gemma3_text", "ministral3", "mixtral", "gpt_oss", "phi3", "deepseek_v3",
                "gemma2", "phi", "stablelm", "qwen3_next", "lfm2", "falcon_h1", "granitemoehybrid", "internlm2",
                "gemma4_kv_shared", "iquestloopcoder", "afm7"}
    assert families <= set(ARCHITECTURES) and len(ARCHITECTURES) >= 25


@pytest.mark.parametrize("name", ["llama", "llama3_rope", "qwen2_yarn", "ministral3", "phi3_longrope", "gpt_oss", "phi",
                                  "gemma3_text"])
def test_compact_positions_re_rotate_keys_exactly_with_the_models_rope(name, models):
    """Compact positions move a key rotated at position p to slot i by rotating it back by p - i with
    rotations read off the model's RoPE module: that must equal the module's own rotation at i, for
    scaled RoPEs too (SuScaledRoPE and YaRN also scale the rotated part by a constant; before the
    rotations were normalised that constant was applied again, an error of ~1 on keys of norm ~3)."""
    model, _, _ = models(name)
    layer = next(a for a in model_layout(model).attention if a.rope is not None)
    assert positional_rope(layer.rope), type(layer.rope).__name__
    D = layer.head_dim
    x = mx.random.normal((1, 2, 64, D), key=mx.random.key(1))
    rotated = layer.rope(x)  # positions 0..63
    keep = mx.array(sorted(np.random.default_rng(0).choice(64, 20, replace=False).tolist()))
    cos, sin = rope_rotations(layer.rope, D, 64)
    back = keep - mx.arange(20)
    moved = rotate_pairs(rotated[:, :, keep], cos[back], -sin[back], getattr(layer.rope, "traditional", False))
    expected = layer.rope(x[:, :, keep])  # the same keys rotated at positions 0..19
    assert float(mx.abs(moved - expected).max()) < 1e-4


def test_a_layer_that_never_calls_its_rope_has_none():
    """Cohere 2's global layer holds a RoPE module and does not apply it (NoPE): compact positions must
    not re-rotate its keys, so the layer has no RoPE and compact positions are refused."""
    model = tiny_model("cohere2")
    layout = model_layout(model)
    assert [a.rope is None for a in layout.attention] == [False, False, False, True]
    with pytest.raises(ConfigError, match="positions"):
        make_cache(model, "keyformer", budget=24, positions="compact")
    assert type(model.layers[3].self_attn.rope).__name__ == "RoPE"  # the probe put the module back


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_next", "gpt_oss"])
def test_the_runner_on_windowed_recurrent_and_sink_models(name, embedded):
    """The sweep's path (one shared full prefill, each method derived from it, both protocols) on a
    windowed, a recurrent hybrid and a sinks model: `full` reproduces the reference decode exactly
    (the layers the model keeps to itself are restored after the reference and copied per run, the
    context part's under query_agnostic too), and the methods run."""
    from kvcompress import load_dataset
    from kvcompress.methods import method_config
    from kvcompress.runner import RunContext, run_sample

    _, tokenizer = embedded
    vocab = len(tokenizer._tokenizer.get_vocab())
    ARCHITECTURES[f"{name}@vocab"] = {**ARCHITECTURES[name], "vocab_size": vocab}
    try:
        model = tiny_model(f"{name}@vocab")
    finally:
        del ARCHITECTURES[f"{name}@vocab"]
    params = {"context_tokens": 256, "num_samples": 1, "seed": 0}
    sample = load_dataset("passkey", tokenizer=tokenizer, **params)[0]
    methods = [method_config("full"), method_config("h2o", budget=0.5), method_config("kivi", bits=4)]
    context = RunContext(name, "tiny", "passkey", params, 6)
    records = run_sample(model, tokenizer, sample, methods, context, protocols=("query_aware", "query_agnostic"))
    assert len(records) == 6 and all(r.run["status"] == "ok" for r in records), [r.run["error"] for r in records]
    for record in records:
        if record.method == "full":
            assert all(s["kl"] == 0.0 and s["top1_agree"] for s in record.steps)
            assert record.run["live_kv_bytes"] == record.run["full_kv_bytes"]
        else:
            assert record.run["live_kv_bytes"] < record.run["full_kv_bytes"]


@pytest.mark.parametrize("name", ["llama", "phi3", "gpt_oss", "qwen3_next"])
def test_the_probe_finds_the_attention_output_projection(name):
    """The adapter's output projection is the module that takes the heads' outputs side by side (Llama's
    and GPT-OSS's `o_proj`, Phi-3's too), and its per-head matrices are that module's weight; Qwen3-Next
    gates the output before its projection, so it has none (CriticalKV refuses it)."""
    model = tiny_model(name)
    for layer in model_layout(model).global_layers:
        projection = layer.out_proj
        if name == "qwen3_next":
            assert projection is None
            continue
        o_proj = model.layers[layer.index].self_attn.o_proj
        assert projection.module is o_proj and (projection.n_heads, projection.value_dim) == (4, 32)
        expected = o_proj.weight.T.reshape(4, 32, -1)
        assert float(mx.abs(projection.per_head() - expected).max()) < 1e-6


@pytest.mark.parametrize("name", ARCHS)
def test_kvquant_keys_rotated_back_are_pre_rope(name, models):
    """KVQuant rotates the post-RoPE keys mlx-lm hands the cache back to pre-RoPE with the model's own
    RoPE: in the model's first layer a repeated token's key is the same at every position before
    RoPE, so the rotated-back keys must be equal along the prompt (checked where layer 0 is one the
    method compresses); a model whose RoPE cannot be inverted by position is refused up front."""
    model, _, _ = models(name)
    if reason := expected_refusal(name, "kvquant"):
        with pytest.raises(ConfigError, match=reason):
            make_cache(model, "kvquant")
        return
    caches = make_cache(model, "kvquant", residual=64, n_sink=0)  # nothing leaves the window: keys as they came
    model(mx.full((1, 24), 7, mx.int32), cache=caches)
    if type(caches[0]).__name__ != "KVQuantCache":
        pytest.skip("layer 0 is not compressed (a sliding-window or recurrent layer)")
    back = caches[0]._rotate(caches[0].keys, 0, -1)  # [1, H_kv, 24, D]
    assert float(mx.abs(back - back[:, :, :1]).max()) < 1e-4 * max(1.0, float(mx.abs(back).max()))
