"""`kvcompress doctor`: every kernel's path and why, the model's answer, exit 1 on a failed self-test."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvcompress import doctor
from kvcompress.kernels import dispatch, kivi_attention
from kvcompress_flows.cli import main
from tests.test_cli import kvcompress

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kvcompress" / "kernels"


def dispatched_kernels() -> set[str]:
    """Every kernel name a kernel module hands `dispatch.select`."""
    return {name for path in KERNELS_DIR.glob("*.py")
            for name in re.findall(r'dispatch\.select\(\s*"(\w+)"', path.read_text())}


@pytest.fixture
def fresh_verdicts(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    dispatch.forget_verdicts()
    yield
    dispatch.forget_verdicts()


def test_doctor_lists_every_kernel_with_path_and_reason():
    done = kvcompress("doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    kernels = dispatched_kernels()
    assert len(kernels) == 7 and {p.kernel for p in doctor.PROBES} == kernels
    for name in kernels:
        line, = [ln for ln in done.stdout.splitlines() if ln.strip().startswith(f"{name}/")]
        assert re.search(r" (fused|reference): \S", line), line
    # no GPU here: the GPU kernels say so; the C++ KIVI kernel runs and is timed against the reference
    assert "evict_one/float32                reference: no GPU back-end" in done.stdout
    assert "kivi_decode_attention/float32    fused: self-test passed on cpu" in done.stdout
    assert re.search(r"speed: fused [\d.]+ ms, reference [\d.]+ ms \([\d.]+x\)", done.stdout)
    assert "'The capital of France is Paris.' (ok" in done.stdout
    assert done.stdout.rstrip().endswith("ok: no kernel failed its self-test")


def test_failed_selftest_exits_nonzero_with_the_error(fresh_verdicts, monkeypatch, capsys):
    def broken(*args):
        raise AssertionError("kivi_decode_attention self-test: relative L2 error 0.5 > 1e-05")

    monkeypatch.setattr(kivi_attention, "selftest", broken)
    assert main(["doctor", "--quick"]) == 1
    out = capsys.readouterr().out
    assert ("kivi_decode_attention/float32    reference: self-test failed on cpu: AssertionError: "
            "kivi_decode_attention self-test: relative L2 error 0.5 > 1e-05") in out
    assert out.rstrip().splitlines()[-1].startswith("FAILED: kivi_decode_attention ")
    assert main(["doctor", "--quick", "--format", "json"]) == 1  # the verdict is kept: same answer
    report = json.loads(capsys.readouterr().out)
    assert report["failed"] is True and report["model"] is None
    failed = {k["kernel"]: k["reason"] for k in report["kernels"] if k["reason"].startswith("self-test failed")}
    assert list(failed) == ["kivi_decode_attention"] and "relative L2 error 0.5" in failed["kivi_decode_attention"]
    assert report["system"]["backend"] == "cpu" and report["system"]["mlx"].startswith("mlx ")


def test_forced_reference_is_the_reason(fresh_verdicts, monkeypatch, capsys):
    monkeypatch.setenv(dispatch.ENV, "reference")
    assert main(["doctor", "--quick", "--format", "json"]) == 0
    kernels = json.loads(capsys.readouterr().out)["kernels"]
    assert {(k["path"], k["reason"]) for k in kernels} == {("reference", "KVCOMPRESS_KERNELS=reference")}
