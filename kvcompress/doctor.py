"""`kvcompress doctor`: what this machine runs, in one report a user can paste into a bug report.

The back-end and device, MLX and mlx-lm versions, the BLAS MLX's CPU matmuls use, each fused
kernel's dispatch decision (fused or reference, and why: no GPU back-end, a forced mode, the
self-test's error), a short speed check of each fused kernel that runs here against its MLX
reference, and the embedded model's answer to one question. A kernel that failed its self-test
makes `failed()` true (the command's exit code).
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import mlx.core as mx

from . import _blas
from .kernels import dispatch, evict, kivi_attention, kivi_quant, prompt_scores, scored_attention, turboquant_attention
from .methods.quantization.turboquant import random_case, selftest_case

QUESTION = "What is the capital of France?"


@dataclass(frozen=True)
class Probe:
    """One kernel's dispatch, as a typical call of the embedded model (head dim 64, 3 query heads
    per KV head) asks it: `dispatch.select`'s arguments."""

    kernel: str
    variant: tuple
    selftest: Callable[[str, object], None]  # (backend, dtype)
    cpu: bool = False  # the kernel has a CPU implementation for this call (float32)
    dtype: object = None  # None: the model's dtype here (float16 on a GPU, float32 on the CPU)


KIVI_VARIANT = (2, 2, 32, 64, 3, 1, False)  # key/value bits, group size, head dim, rows, queries, causal
TURBOQUANT_VARIANT = (3, 4, 64, 3, True)  # turboquant bits=4: key code bits, value bits, head dim, rows, QJL

PROBES = (
    Probe("evict_one", (False, False), lambda b, dt: evict.selftest(b, dt, False, False)),
    Probe("evict_slot", (), lambda b, dt: evict.slot_selftest(b), dtype=mx.float32),
    Probe("kivi_decode_attention", KIVI_VARIANT, lambda b, dt: kivi_attention.selftest(b, dt, KIVI_VARIANT), cpu=True),
    Probe("kivi_quantize_pack", (2, 32, True), lambda b, dt: kivi_quant.selftest(b, dt, 2, 32, True)),
    Probe("prompt_scores", (64, False), lambda b, dt: prompt_scores.selftest(b, dt, (64, False))),
    Probe("scored_attention", (3, 64, True, False, False),
          lambda b, dt: scored_attention.selftest(b, dt, (3, 64, True, False, False))),
    Probe("turboquant_decode_attention", TURBOQUANT_VARIANT,
          lambda b, dt: turboquant_attention.selftest(b, *selftest_case(TURBOQUANT_VARIANT))),
)


@dataclass
class KernelReport:
    kernel: str
    dtype: str
    path: str  # "fused" | "reference" | "error"
    reason: str
    backend: str | None = None
    fused_ms: float | None = None  # the speed check, where the fused path runs
    reference_ms: float | None = None

    @property
    def failed(self) -> bool:
        return self.path == "error" or self.reason.startswith("self-test failed")


@dataclass
class Report:
    system: dict[str, str] = field(default_factory=dict)
    kernels: list[KernelReport] = field(default_factory=list)
    model: dict[str, object] | None = None

    def failed(self) -> bool:
        return any(k.failed for k in self.kernels) or bool(self.model and self.model.get("error"))

    def to_dict(self) -> dict:
        return {"system": self.system, "kernels": [asdict(k) for k in self.kernels], "model": self.model,
                "failed": self.failed()}


def _version(*names: str) -> str:
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(found) or "not installed"


def system() -> dict[str, str]:
    device = mx.default_device()
    try:
        info = mx.device_info()
        name = str(info.get("device_name") or info.get("architecture") or "")
    except Exception:  # older MLX, or no such information for this device
        name = ""
    blas = _blas.loaded or ("Accelerate (MLX's own)" if sys.platform == "darwin"
                            else "the MLX wheel's own (reference BLAS: slow; see README, KVCOMPRESS_BLAS)")
    return {
        "platform": f"{platform.platform()} ({platform.machine()}), Python {platform.python_version()}",
        "backend": dispatch.gpu_backend() or "cpu",
        "device": f"{device}" + (f" {name}" if name else ""),
        "cuda": "available" if mx.cuda.is_available() else "absent",
        "metal": "available" if mx.metal.is_available() else "absent",
        "mlx": _version("mlx", "mlx-cpu", "mlx-cuda", "mlx-metal"),
        "mlx_lm": _version("mlx-lm"),
        "blas": blas,
        f"{dispatch.ENV}": dispatch.mode(),
    }


def _ms(fn: Callable[[], object], repeats: int = 5) -> float:
    mx.eval(fn())  # warm: compile, caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _speed(kernel: str, backend: str, dtype) -> tuple[Callable, Callable] | None:
    """(fused, reference) on one decode-sized problem, for the kernels with a speed check."""
    if kernel == "kivi_decode_attention":
        key_bits, value_bits, group_size, D, M, L, _ = KIVI_VARIANT
        q, keys, values = kivi_attention.random_case(key_bits, value_bits, group_size, D, M, L, dtype, seed=3,
                                                     T=4096 + 64, n_k=4096, n_v=4096, heads=3)
        args = (q, keys, values, D**-0.5)
        if backend == "cpu":
            fused = lambda: kivi_attention.decode_attention_cpu(*args, False, key_bits, value_bits, group_size)  # noqa: E731
        else:
            fused = lambda: kivi_attention.decode_attention_fused(*args, False, key_bits, value_bits, group_size,  # noqa: E731
                                                                  backend)
        return fused, lambda: kivi_attention.decode_attention_reference(*args, None, key_bits, value_bits, group_size)
    if kernel == "turboquant_decode_attention":
        code_bits, value_bits, D, M, qjl = TURBOQUANT_VARIANT
        q, keys, values, n = random_case(code_bits + qjl, value_bits, D, M, qjl, seed=3,
                                         T=4096, heads=3)
        return (lambda: turboquant_attention.attention_on_codes_fused(q, keys, values, n, D**-0.5, backend),
                lambda: turboquant_attention.attention_on_codes_reference(q, keys, values, n, D**-0.5))
    if kernel == "kivi_quantize_pack":
        x = mx.random.normal((1, 3, 4096, 64), key=mx.random.key(3)).astype(dtype)
        return (lambda: kivi_quant.quantize_pack_kernel(x, 2, 32, True, backend),
                lambda: kivi_quant.quantize_pack_reference(x, 2, 32, True))
    return None


def check_kernel(probe: Probe, speed: bool = True) -> KernelReport:
    dtype = probe.dtype or (mx.float16 if dispatch.gpu_backend() else mx.float32)
    dtype_name = str(dtype).split(".")[-1]
    try:
        path, reason = dispatch.explain(probe.kernel, dtype, probe.variant, lambda b: probe.selftest(b, dtype),
                                        probe.cpu)
    except Exception as exc:  # KVCOMPRESS_KERNELS=fused where no fused kernel runs, a bad mode
        return KernelReport(probe.kernel, dtype_name, "error", f"{type(exc).__name__}: {exc}")
    report = KernelReport(probe.kernel, dtype_name, path, reason)
    if path == "fused":
        report.backend = dispatch.gpu_backend() or "cpu"
        if report.backend == "cpu":
            report.reason += " (the C++ kernel, kernels/kivi_attention_cpu.py)"
        pair = _speed(probe.kernel, report.backend, dtype) if speed else None
        if pair is not None:
            report.fused_ms, report.reference_ms = _ms(pair[0]), _ms(pair[1])
    return report


def smoke_answer(max_tokens: int = 12) -> dict[str, object]:
    """The embedded model's greedy answer to QUESTION (it says Paris where everything works)."""
    import mlx_lm

    from .model import load_model

    start = time.perf_counter()
    try:
        model, tokenizer = load_model("smollm2-135m")
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                               tokenize=False)
        answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens)
    except Exception as exc:
        return {"question": QUESTION, "error": f"{type(exc).__name__}: {exc}"}
    return {"question": QUESTION, "answer": answer.strip(), "paris": "Paris" in answer,
            "seconds": round(time.perf_counter() - start, 2)}


def run(quick: bool = False) -> Report:
    """The whole check; quick: no speed check and no model."""
    report = Report(system=system())
    report.kernels = [check_kernel(p, speed=not quick) for p in PROBES]
    if not quick:
        report.model = smoke_answer()
    return report


def to_text(report: Report) -> str:
    lines = [f"{key:<18} {value}" for key, value in report.system.items()]
    lines.append("kernels (path: why)")
    for k in report.kernels:
        lines.append(f"  {k.kernel + '/' + k.dtype:<32} {k.path}: {k.reason}")
        if k.fused_ms is not None:
            lines.append(f"  {'':<32} speed: fused {k.fused_ms:.3f} ms, reference {k.reference_ms:.3f} ms "
                         f"({k.reference_ms / k.fused_ms:.1f}x)")
    if report.model is not None:
        m = report.model
        lines.append(f"model smoke test   {m['question']} -> " + (f"error: {m['error']}" if "error" in m else
                     f"{m['answer']!r} ({'ok' if m['paris'] else 'NO Paris'}, {m['seconds']} s)"))
    failed = [k.kernel for k in report.kernels if k.failed]
    lines.append(f"FAILED: {', '.join(failed)} (their results come from the reference; please report this output)"
                 if failed else "ok: no kernel failed its self-test")
    return "\n".join(lines)
