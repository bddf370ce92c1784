"""The fused-kernel dispatch (kvcompress/kernels/dispatch.py): forced modes, self-test verdicts,
warn-once fallback and the recorded paths, on any machine (a GPU backend is simulated where the
logic needs one; the real kernels' fallback runs in tests/test_kivi_attention.py on a GPU)."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)

import json
import warnings

import mlx.core as mx
import pytest

from kvcompress.kernels import dispatch


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: "cuda")
    monkeypatch.delenv(dispatch.ENV, raising=False)
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    yield
    dispatch.forget_verdicts()
    dispatch.reset_paths()


def test_bad_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "fast")
    with pytest.raises(ValueError, match="KVCOMPRESS_KERNELS: expected one of auto, reference, fused"):
        dispatch.mode()


def test_self_test_runs_once_per_key_and_passing_means_fused(fake_gpu):
    calls = []
    for _ in range(3):
        assert dispatch.select("k", mx.float16, (2,), lambda b: calls.append(b)) == "cuda"
    assert calls == ["cuda"]
    dispatch.select("k", mx.float16, (4,), lambda b: calls.append(b))  # another variant: its own self-test
    dispatch.select("k", mx.float32, (2,), lambda b: calls.append(b))  # another dtype too
    assert len(calls) == 3
    assert dispatch.paths_used() == {"k/cuda/float16": "fused", "k/cuda/float32": "fused"}


def test_failing_self_test_warns_once_and_falls_back(fake_gpu):
    def broken(backend):
        raise RuntimeError("nvrtc: error: expected a ';'")

    with pytest.warns(RuntimeWarning, match=r"fused kernel k \(cuda, float16, \(2,\)\) failed its self-test.*nvrtc"):
        assert dispatch.select("k", mx.float16, (2,), broken) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.select("k", mx.float16, (2,), broken) is None
    # a passing variant of the same (kernel, backend, dtype) does not hide the fallback in the record
    assert dispatch.select("k", mx.float16, (4,), lambda b: None) == "cuda"
    assert dispatch.paths_used() == {"k/cuda/float16": "reference"}


def test_forced_modes(fake_gpu, monkeypatch):
    def never(backend):
        raise AssertionError("forced modes do not self-test")

    monkeypatch.setenv(dispatch.ENV, "reference")
    assert dispatch.select("k", mx.float16, (2,), never) is None
    monkeypatch.setenv(dispatch.ENV, "fused")
    assert dispatch.select("k", mx.bfloat16, (2,), never) == "cuda"
    assert dispatch.paths_used() == {"k/cuda/bfloat16": "fused", "k/cuda/float16": "reference"}


def test_forced_fused_without_gpu_is_an_error(monkeypatch):
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: None)
    monkeypatch.setenv(dispatch.ENV, "fused")
    with pytest.raises(RuntimeError, match="KVCOMPRESS_KERNELS=fused but the default device has no"):
        dispatch.select("k", mx.float32, (), lambda b: None)


def test_run_config_records_the_kernel_paths():
    """A real KIVI run (embedded model, CPU) records in its config which path each kernel took;
    the run id does not depend on it."""
    from kvcompress.datasets import load_dataset
    from kvcompress.methods import method_config
    from kvcompress.runner import RunContext, run_config, run_sample
    from kvcompress.results import run_id

    model, tokenizer = kvcompress.load_model("smollm2-135m")
    params = {"context_tokens": 256, "continuation_tokens": 4, "num_samples": 1, "seed": 1}
    sample = load_dataset("lm", tokenizer=tokenizer, **params)[0]
    context = RunContext("smollm2-135m", "fp", "lm", params, 3)
    kivi = method_config("kivi", bits=4, residual=32)
    (record,) = run_sample(model, tokenizer, sample, [kivi], context)
    assert record.run["status"] == "ok"
    config = json.loads(record.run["config"])
    # on the CPU: the attention's C++ kernel (after its self-test), the quantizer's MLX reference
    assert config["kernels"] == {"kivi_decode_attention/cpu/float32": "fused",
                                 "kivi_quantize_pack/cpu/float32": "reference"}
    assert record.run["run_id"] == run_id(run_config(context, sample, kivi))


def test_a_kept_answer_is_not_decided_again(fake_gpu, monkeypatch):
    """A decode step asks once per kernel per layer: after the first call, a dict lookup (the key
    once held `mx.default_device()`, which hashes by identity: every call decided anew, and the
    answers piled up)."""
    decide, decided = dispatch._decide, []
    monkeypatch.setattr(dispatch, "_decide", lambda *args: decided.append(1) or decide(*args))
    for _ in range(5):
        assert dispatch.select("k", mx.float16, (2,), lambda b: None) == "cuda"
        dispatch.record_reference("r", mx.float16)
    assert len(decided) == 1 and len(dispatch._decisions) == 1 and len(dispatch._reference_keys) == 1


def test_answers_are_kept_per_key_yet_recorded_and_the_variable_still_applies_at_once(fake_gpu, monkeypatch):
    calls = []
    assert dispatch.select("k", mx.float16, (2,), calls.append) == "cuda"
    dispatch.reset_paths()
    assert dispatch.select("k", mx.float16, (2,), calls.append) == "cuda"  # a kept answer is recorded again
    assert calls == ["cuda"] and dispatch.paths_used() == {"k/cuda/float16": "fused"}
    monkeypatch.setenv(dispatch.ENV, "reference")
    assert dispatch.select("k", mx.float16, (2,), calls.append) is None
    monkeypatch.setenv(dispatch.ENV, "auto")
    assert dispatch.select("k", mx.float16, (2,), calls.append) == "cuda" and calls == ["cuda"]  # no second self-test
    assert dispatch.paths_used() == {"k/cuda/float16": "reference"}  # as before: a reference call stays recorded
    dispatch.forget_verdicts()
    dispatch.select("k", mx.float16, (2,), calls.append)
    assert calls == ["cuda", "cuda"]
