"""A saved cache decodes exactly as the original (kvcompress/api.py's load_prompt_cache): every
registered method and the composed caches, saved at any point of a drop-in run and loaded with
`kvcompress.load_prompt_cache(path, model)`, give the original's greedy tokens and, bit for bit on
this process, its logits for 8 more tokens.

A drop-in run feeds the prompt as mlx-lm's generate does (chunks, then its last token alone, which
completes the prompt: eviction methods compress there) and then the answer token by token. The save
points: after the first prompt chunk; after all chunks but before the last token (mlx-lm's
generate_step at its prefill's end: the compression is pending, and what it needs of the prompt's
queries must be in the file); after the last token (mlx-lm's cache_prompt); mid-answer. KVzip runs
as `kvcompress.compress_prompt` drives it: the whole prompt in chunks, then the reconstruction pass.
Settings leave something to compress: every cache ends smaller than the full cache (a composed one
smaller than its eviction method alone: its store holds codes).
"""

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache as mlx_load_prompt_cache
from mlx_lm.models.cache import save_prompt_cache

from kvcompress.errors import ConfigError
from kvcompress.memory import live_kv_bytes
from kvcompress.methods import REGISTRY, method_config
from kvcompress.reconstruct import ReconstructionPrompt, reconstruct

PROMPT, CHUNK, MORE = 96, 32, 8
BUDGET = 24  # tokens per KV head: 72 of the 96 to evict
REQUEST = ReconstructionPrompt(first=(7, 8, 9, 10), later=(7, 8, 11), suffix=(12, 13))  # KVzip's, in tiny ids
SNAP = {"budget": BUDGET, "recent": 4, "kernel": 3}  # a 4-query window: its queries are what a save must keep

# One setting per registered method (the test asserts every one is here), sized for the 96-token prompt.
METHODS = {
    "full": {},
    "mlx-quant": {"group_size": 32},
    "kivi": {"bits": 4, "group_size": 32, "residual": 32},
    "turboquant": {"bits": 3},
    "qjl": {"buffer": 32},
    "kvquant": {"residual": 16},
    "streaming": {"budget": BUDGET, "n_sink": 2},
    "h2o": {"budget": BUDGET},
    "keyformer": {"budget": BUDGET, "anneal_steps": 5},
    "snapkv": SNAP,
    "pyramidkv": {**SNAP, "beta": 4},
    "adakv": {"budget": 0.75},  # SnapKV's defaults: a 32-query window
    "tova": {"budget": BUDGET},
    "knorm": {"budget": BUDGET},
    "random": {"budget": BUDGET},
    "keydiff": {"budget": BUDGET},
    "expected_attention": {"budget": BUDGET, "n_future_positions": 16},
    "criticalkv": {"budget": 0.5, "scorer": "expected_attention"},  # running moments, RoPE and W_o
    "duoattention": {"budget": 0.5, "n_sink": 2, "recent": 6},
    # SnapKV's 32-query window over the generated tokens; compresses them at the 40th (see ANSWER_STEPS)
    "decoding": {"budget": 0.75, "scorer": "snapkv", "compression_interval": 8, "target_size": 34},
    "kvzip": {"budget": BUDGET, "chunk_size": 32},
}
# Eviction with each quantizer that can store its kept tokens (methods/composed.py), and AdaKV's padded rows
COMPOSED = {
    "snapkv+kivi": ("snapkv", {**SNAP, "budget": 64, "quantize": {"name": "kivi", "bits": 4, "residual": 32}}),
    "snapkv+turboquant": ("snapkv", {**SNAP, "quantize": {"name": "turboquant", "bits": 3}}),
    "snapkv+qjl": ("snapkv", {**SNAP, "budget": 64, "quantize": {"name": "qjl", "buffer": 32}}),
    "adakv+turboquant": ("adakv", {"budget": 0.75, "quantize": {"name": "turboquant", "bits": 3}}),
}
CONFIGS = {**{name: (name, params) for name, params in METHODS.items()}, **COMPOSED}
# answer tokens before the mid-answer save: past the decoding wrapper's window, before its compression
ANSWER_STEPS = {"decoding": 36}
SAVE_POINTS = ("prompt_chunk", "prompt_pending", "prompt_done", "mid_answer")


def test_every_registered_method_is_covered():
    assert set(METHODS) == set(REGISTRY)


def _calls(config, tokens: list[int], answer_steps: int) -> list:
    """The calls of a drop-in run: token lists, "reconstruct" (KVzip's pass), None (the next greedy token)."""
    if config.reconstructs:  # compress_prompt: the whole prompt in chunks, then the pass
        chunks = [tokens[s : s + CHUNK] for s in range(0, PROMPT, CHUNK)]
        return [*chunks, "reconstruct", *[None] * (answer_steps + MORE)]
    chunks = [tokens[s : min(PROMPT - 1, s + CHUNK)] for s in range(0, PROMPT - 1, CHUNK)]
    return [*chunks, tokens[-1:], *[None] * (answer_steps + MORE)]


def _save_index(point: str, n_chunks: int, answer_steps: int) -> int:
    """How many calls run before the save."""
    return {"prompt_chunk": 1, "prompt_pending": n_chunks, "prompt_done": n_chunks + 1,
            "mid_answer": n_chunks + 1 + answer_steps}[point]


class Run:
    """One cache driven call by call; `step` returns the call's last logits (None for the pass)."""

    def __init__(self, model, caches, tokens):
        self.model, self.caches, self.tokens, self.logits = model, caches, tokens, None

    def step(self, call):
        if call == "reconstruct":
            reconstruct(self.model, self.caches, self.tokens, REQUEST)
            return None
        if call is None:
            call = [int(mx.argmax(self.logits[0, -1]).item())]
        self.logits = self.model(mx.array(call)[None], cache=self.caches)
        mx.eval(self.logits, [c.state for c in self.caches])
        return self.logits


def _prompt() -> list[int]:
    return mx.random.randint(1, 128, (PROMPT,), key=mx.random.key(4)).tolist()


@pytest.mark.parametrize("point", SAVE_POINTS)
@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_a_saved_cache_decodes_exactly_as_the_original(tiny_llama, key, point, tmp_path):
    model = tiny_llama
    name, params = CONFIGS[key]
    config = method_config(name, **params)
    try:
        original = Run(model, config.make_cache(model), _prompt())
    except ConfigError as missing:  # MLX 0.32.4 on CUDA lacks mlx-quant's kernels: test_methods
        assert name == "mlx-quant", missing
        pytest.skip(str(missing))
    answer_steps = ANSWER_STEPS.get(name, 3)
    calls = _calls(config, original.tokens, answer_steps)
    n_chunks = len(calls) - 1 - answer_steps - MORE
    saved_at = _save_index(point, n_chunks, answer_steps)
    for call in calls[:saved_at]:
        original.step(call)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, original.caches)
    loaded = Run(model, kvcompress.load_prompt_cache(path, model), original.tokens)
    loaded.logits = original.logits
    assert [type(c) for c in loaded.caches] == [type(c) for c in original.caches]
    tokens = ([], [])
    for call in calls[saved_at:]:
        a, b = original.step(call), loaded.step(call)
        if a is None:
            continue
        assert mx.array_equal(a, b).item(), (key, point, call)
        for run, out in zip((original, loaded), tokens):
            out.append(int(mx.argmax(run.logits[0, -1]).item()))
    assert tokens[0] == tokens[1] and len(tokens[0]) >= MORE


@pytest.mark.parametrize("key", sorted(set(CONFIGS) - {"full"}))
def test_the_settings_compress_something(tiny_llama, key):
    """Each setting changes the run's logits from the full cache's; a composed one from its eviction
    method's alone (its store holds codes, not only a full-precision residual)."""
    name, params = CONFIGS[key]
    baseline = ("full", {}) if key == name else (name, {k: v for k, v in params.items() if k != "quantize"})
    logits = []
    for method, settings in ((name, params), baseline):
        try:
            config = method_config(method, **settings)
            run = Run(tiny_llama, config.make_cache(tiny_llama), _prompt())
        except ConfigError as missing:  # MLX 0.32.4 on CUDA lacks mlx-quant's kernels: test_methods
            assert name == "mlx-quant", missing
            pytest.skip(str(missing))
        outs = [run.step(call) for call in _calls(config, run.tokens, ANSWER_STEPS.get(name, 3))]
        logits.append(mx.concatenate([out[0, -1:] for out in outs if out is not None]))
    assert not mx.array_equal(*logits).item()


def test_the_decoding_wrapper_compresses_after_the_mid_answer_save(tiny_llama):
    """The mid-answer save of `decoding` falls between its window filling and its compression, so the
    loaded cache compresses with the saved generated queries: the equality test covers that compression."""
    config = method_config("decoding", **METHODS["decoding"])
    run = Run(tiny_llama, config.make_cache(tiny_llama), _prompt())
    calls = _calls(config, run.tokens, ANSWER_STEPS["decoding"])
    saved_at = _save_index("mid_answer", len(calls) - 1 - ANSWER_STEPS["decoding"] - MORE, ANSWER_STEPS["decoding"])
    for call in calls[:saved_at]:
        run.step(call)
    before = run.caches[0].tokens_kept
    assert run.caches[0].query_summary.shape[2] == 32  # the generated queries' window, full
    for call in calls[saved_at:]:
        run.step(call)
    assert run.caches[0].tokens_kept < before + MORE  # compressed after the save


@pytest.mark.parametrize("name", ["expected_attention", "criticalkv"])
def test_a_pending_compression_loaded_without_the_model_says_how_to_load_it(tiny_llama, name, tmp_path):
    """mlx-lm's own loader cannot give a cache the model's modules: a compression that needs them
    (Expected Attention's RoPE rotations, CriticalKV's W_o) raises and names the loader that can,
    instead of scoring as if the layer had no RoPE."""
    run = Run(tiny_llama, method_config(name, **METHODS[name]).make_cache(tiny_llama), _prompt())
    prompt_calls = [call for call in _calls(run.caches[0].config, run.tokens, 0) if call is not None]
    for call in prompt_calls[:-1]:
        run.step(call)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, run.caches)
    bare = Run(tiny_llama, mlx_load_prompt_cache(path), run.tokens)
    with pytest.raises(RuntimeError, match=r"kvcompress.load_prompt_cache\(path, model\)"):
        bare.step(prompt_calls[-1])  # the prompt's last token: the compression
