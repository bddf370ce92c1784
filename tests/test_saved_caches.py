"""Prompt caches saved before methods/ was grouped into families (issue 51) still load.

The files in tests/data/saved_caches/ were saved by commit 6a65b3b (the flat methods/ folder) with
`CASES` below on the `tiny_llama` fixture: the first PREFILL tokens of `TOKENS` as a prompt, then one
decode step. mlx-lm's loader finds a cache class by its name in `mlx_lm.models.cache` and a config by
its method name in the registry, so neither a module path nor a folder is in a file; this test holds
that contract. A loaded cache must hold what a cache built now from the same tokens holds, and
decode alike (one process, float tolerance: the saved arrays came from another process).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import save_prompt_cache

import kvcompress

SAVED = Path(__file__).parent / "data" / "saved_caches"
CASES = {  # file stem -> (method, parameters, cache class)
    "snapkv": ("snapkv", {"budget": 0.5}, "EvictionCache"),
    "decoding": ("decoding", {"budget": 0.5}, "DecodingCache"),
    "duoattention": ("duoattention", {"budget": 0.5, "n_sink": 4, "recent": 8}, "DuoAttentionCache"),
    "kivi": ("kivi", {"bits": 2, "residual": 32}, "KiviCache"),
    "turboquant": ("turboquant", {}, "TurboQuantCache"),
    "qjl": ("qjl", {"buffer": 32}, "QjlCache"),
    "kvquant": ("kvquant", {}, "KVQuantCache"),
    "mlx-quant": ("mlx-quant", {"bits": 4, "group_size": 32}, "QuantizedKVCache"),
    "snapkv+kivi": ("snapkv", {"budget": 0.5, "quantize": {"name": "kivi", "bits": 2, "residual": 32}},
                    "ComposedCache"),
}
TOKENS = np.random.default_rng(0).integers(0, 128, 80).tolist()
PREFILL = 72


def build(model, method: str, params: dict) -> list:
    """The cache as the files were saved: a prompt of PREFILL tokens, then one decode step."""
    caches = kvcompress.make_cache(model, method, **params)
    model(mx.array(TOKENS[:PREFILL])[None], cache=caches)
    model(mx.array(TOKENS[PREFILL : PREFILL + 1])[None], cache=caches)
    return caches


def test_every_saved_file_is_a_case():
    assert sorted(p.name.removesuffix(".safetensors") for p in SAVED.glob("*.safetensors")) == sorted(CASES)


# TurboQuant's rotations became independent per-layer draws the same day (issue 48): its old file is
# refused with the reason (its codes need the old rotations), tested below
@pytest.mark.parametrize("stem", sorted(set(CASES) - {"turboquant"}))
def test_a_cache_saved_before_the_families_loads_and_decodes_as_one_built_now(tiny_llama, stem):
    method, params, class_name = CASES[stem]
    loaded = kvcompress.load_prompt_cache(str(SAVED / f"{stem}.safetensors"), tiny_llama)
    built = build(tiny_llama, method, params)
    assert [type(c).__name__ for c in loaded] == [class_name] * len(built)
    assert [c.offset for c in loaded] == [c.offset for c in built] == [PREFILL + 1] * len(built)
    if hasattr(built[0], "config"):
        assert [c.config for c in loaded] == [c.config for c in built]
        assert [c.live_kv_bytes for c in loaded] == [c.live_kv_bytes for c in built]
    for token in TOKENS[PREFILL + 1 :]:
        a = tiny_llama(mx.array([[token]]), cache=built)
        b = tiny_llama(mx.array([[token]]), cache=loaded)
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), stem


def test_a_turboquant_cache_saved_with_the_old_rotations_is_refused_with_the_reason(tiny_llama):
    with pytest.raises(ValueError, match="saved before 2026-12-07.*re-create it"):
        kvcompress.load_prompt_cache(str(SAVED / "turboquant.safetensors"), tiny_llama)


def test_saving_again_reproduces_the_file_layout(tiny_llama, tmp_path):
    # the saved keys of a file made now are those of the old file: same arrays, same metadata fields
    method, params, _ = CASES["snapkv+kivi"]
    path = tmp_path / "now.safetensors"
    save_prompt_cache(str(path), build(tiny_llama, method, params))
    now, old = mx.load(str(path)), mx.load(str(SAVED / "snapkv+kivi.safetensors"))
    assert sorted(now) == sorted(old)
