"""Every Metal kernel of kvcompress/kernels/ on the CPU (tests/metal_on_cpu.py: the kernel text MLX
generates, its address spaces checked by clang where installed, run by g++ with one OS thread per GPU
thread, SIMD-group collectives and barriers emulated), through its own Python wrapper with
`mx.fast.metal_kernel` replaced by the emulator, against the MLX references: bit for bit where the
CUDA variant is (tests/test_kernel_sources.py). No Apple GPU has run these kernels; what the
emulator cannot check is in its module docstring. Skipped without g++."""

import warnings

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import numpy as np
import pytest

import metal_on_cpu
from kvcompress.kernels import dispatch, evict, kivi_attention, kivi_quant, turboquant_attention
from kvcompress.kernels import scored_attention as kernel
from kvcompress.methods.quantization.turboquant import random_case, selftest_case

pytestmark = pytest.mark.skipif(metal_on_cpu.GXX is None, reason="needs g++")
needs_clang = pytest.mark.skipif(metal_on_cpu.CLANG is None, reason="needs clang++ (the address-space check)")


@pytest.fixture
def emulated_metal(monkeypatch, tmp_path):
    """mx.fast.metal_kernel runs kernels on the CPU; the kernel modules build theirs anew."""
    monkeypatch.setattr(mx.fast, "metal_kernel", metal_on_cpu.emulated(tmp_path))
    dispatch.clear_kernel_caches()
    yield
    dispatch.clear_kernel_caches()


def test_every_metal_kernel_module_is_emulated_here():
    """A new module with a Metal kernel needs its cases here (and its cache in `emulated_metal`)."""
    from pathlib import Path

    import kvcompress.kernels

    def builds_metal(text: str) -> bool:  # directly, or through dispatch.fast_kernel for a backend not fixed to CUDA
        return "mx.fast.metal_kernel" in text or "fast_kernel(backend" in text

    kernels = Path(kvcompress.kernels.__path__[0])
    modules = {p.stem for p in kernels.glob("*.py") if p.stem != "dispatch" and builds_metal(p.read_text())}
    assert modules == {"evict", "kivi_attention", "kivi_quant", "scored_attention", "turboquant_attention"}


def assert_equal(got, want, what):
    assert all(a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item() for a, b in zip(got, want)), what


def assert_close(got, want, what, atol=1e-6):
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=atol, err_msg=what)


# -- the kernel text: MLX's signature generation --------------------------------------------------------

def test_the_kernel_text_is_mlx_s(tmp_path):
    """A call with a small input, a 0-d one, a shape the body reads and a template: the parameters and
    names metal_kernel.cpp writes (constant below 8 elements, `&` for 0-d, bools as 1 / 0)."""
    source = "out[thread_position_in_grid.x] = x[0] * s + (float)dims[0] + x_shape[0];"
    name, text, params = metal_on_cpu.kernel_text(
        "k", ["x", "dims", "s"], ["out"], source, "// header\n",
        [("float32", (4, 16)), ("int32", (3,)), ("float32", ())], ["float16"], [("T", mx.float16), ("N", 7), ("B", True)])
    assert name == "custom_kernel_k__float16_t_7_1_float_int32_tc_floats_float16_t"
    assert text == """// header
template <typename T, int N, bool B>
[[kernel]] void custom_kernel_k__float16_t_7_1_float_int32_tc_floats_float16_t(
  const device float* x [[buffer(0)]],
  const constant int* x_shape [[buffer(1)]],
  const constant int32_t* dims [[buffer(2)]],
  const constant float& s [[buffer(3)]],
  device float16_t* out [[buffer(4)]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {
out[thread_position_in_grid.x] = x[0] * s + (float)dims[0] + x_shape[0];
}

template [[host_name("custom_kernel_k__float16_t_7_1_float_int32_tc_floats_float16_t")]] [[kernel]] \
decltype(custom_kernel_k__float16_t_7_1_float_int32_tc_floats_float16_t<float16_t, 7, 1>) \
custom_kernel_k__float16_t_7_1_float_int32_tc_floats_float16_t<float16_t, 7, 1>;
"""
    assert [kind for kind, _ in params] == ["input", "shape", "input", "scalar", "output", "attribute"]
    # the installed MLX writes the same (as every emulated call checks)
    made = dict(name="k", input_names=["x", "dims", "s"], output_names=["out"], source=source, header="// header\n")
    inputs = [mx.zeros((4, 16)), mx.zeros((3,), mx.int32), mx.array(1.0)]
    call = dict(output_shapes=[(1,)], output_dtypes=[mx.float16], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                template=[("T", mx.float16), ("N", 7), ("B", True)])
    assert metal_on_cpu.mlx_kernel_text(mx.fast.metal_kernel, made, inputs, call, tmp_path) == text


def test_simd_collectives_and_partial_threadgroups(emulated_metal):
    """simd_* over 32-lane groups (the last one short), the attributes a threadgroup reads, and a grid
    that leaves a partial threadgroup at its edge (MLX dispatches threads, not threadgroups)."""
    source = """
        const uint i = thread_position_in_grid.x;
        const float v = x[i];
        out[i * 8 + 0] = simd_sum(v);
        out[i * 8 + 1] = simd_max(v);
        out[i * 8 + 2] = simd_shuffle_xor(v, (ushort)1);
        out[i * 8 + 3] = simd_shuffle_down(v, (ushort)3);
        out[i * 8 + 4] = simd_prefix_exclusive_sum(v);
        out[i * 8 + 5] = (float)simdgroup_index_in_threadgroup;
        out[i * 8 + 6] = (float)threads_per_threadgroup.x;
        threadgroup float seen[64];
        seen[thread_index_in_threadgroup] = v;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[i * 8 + 7] = seen[threads_per_threadgroup.x - 1 - thread_index_in_threadgroup];
    """
    k = mx.fast.metal_kernel(name="simd", input_names=["x"], output_names=["out"], source=source)
    n = 100  # threadgroups of 64: 64 threads (two SIMD groups), then 36 (32 and 4)
    x = mx.arange(n, dtype=mx.float32) + 1
    (out,) = k(inputs=[x], grid=(n, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(n, 8)], output_dtypes=[mx.float32])
    assert k.same_as_mlx == 1  # the text compiled is the one the installed MLX writes
    out, x = np.array(out), np.array(x)
    for i in range(n):
        group, lane = i // 64, i % 64 % 32
        start = i - lane  # the SIMD group's first thread
        size = min(32, n - start, 64 * (group + 1) - start)
        lanes = x[start:start + size]
        down = x[i + 3] if lane + 3 < size else x[i]  # from outside the group: its own value
        xor = x[start + (lane ^ 1)] if (lane ^ 1) < size else x[i]
        tg = min(64, n - 64 * group)
        mirror = x[64 * group + tg - 1 - i % 64]
        want = [lanes.sum(), lanes.max(), xor, down, lanes[:lane].sum(), i % 64 // 32, tg, mirror]
        np.testing.assert_array_equal(out[i], np.array(want, np.float32), err_msg=f"thread {i}")


@needs_clang
def test_the_address_space_check_catches_a_mixed_pointer(emulated_metal):
    """A pointer into the constant address space (an input of fewer than 8 elements) where a device
    one is expected: Metal's compiler refuses it, and so does the check."""
    source = "const device float* p = thread_position_in_grid.x ? big : small; out[0] = p[0];"
    k = mx.fast.metal_kernel(name="mixed", input_names=["big", "small"], output_names=["out"], source=source)
    args = dict(grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])
    with pytest.raises(RuntimeError, match="incompatible operand types"):
        k(inputs=[mx.zeros((8,)), mx.zeros((7,))], **args)
    k(inputs=[mx.zeros((8,)), mx.zeros((8,))], **args)  # both device pointers: fine


def test_threadgroup_memory_beyond_32_kib_is_refused(emulated_metal):
    source = """threadgroup float big[N]; big[thread_position_in_grid.x] = 1.0f;
                threadgroup_barrier(mem_flags::mem_threadgroup); out[0] = big[N - 1 - thread_position_in_grid.x];"""
    k = mx.fast.metal_kernel(name="big", input_names=["x"], output_names=["out"], source=source)
    args = dict(inputs=[mx.zeros((8,))], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                output_dtypes=[mx.float32])
    k(**args, template=[("N", 8192)])  # 32 KiB: the limit
    with pytest.raises(metal_on_cpu.MetalLimitError, match="32772 bytes"):
        k(**args, template=[("N", 8193)])


# -- kivi_quant ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits, G, per_channel, groups", [
    (2, 32, False, 3), (4, 64, False, 3), (8, 128, False, 3), (2, 32, True, 2), (8, 64, True, 2), (2, 32, True, 5)])
def test_kivi_quantize_pack_is_bit_exact(emulated_metal, bits, G, per_channel, groups):
    # the CUDA test's shapes: part of the last SIMD group idle, an odd chunk count, partial group blocks
    shape = (3, groups * G, 44) if per_channel else (3, 7, groups * G)
    x = mx.random.normal(shape, key=mx.random.key(bits)) * 3
    x = mx.where(mx.arange(shape[-1]) % 7 == 0, mx.round(x * 2) / 2, x)  # quotients exactly on half-integers
    x = mx.concatenate([x[:1] * 0 + 1.5, x[1:]])  # constant groups: scale 0, codes 0
    got = kivi_quant.quantize_pack_kernel(x, bits, G, per_channel, "metal", init_value=3.0)
    assert_equal(got, kivi_quant.quantize_pack_reference(x, bits, G, per_channel), "codes, scales, zeros")


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_kivi_quantize_pack_half_types_are_bit_exact(emulated_metal, dtype):
    for per_channel in (False, True):
        x = (mx.random.normal((2, 64, 32), key=mx.random.key(3)) * 3).astype(dtype)
        got = kivi_quant.quantize_pack_kernel(x, 4, 32, per_channel, "metal", init_value=3.0)
        assert_equal(got, kivi_quant.quantize_pack_reference(x, 4, 32, per_channel), f"{dtype} {per_channel}")


# -- evict ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("compact, traditional", [(False, False), (True, False), (True, True)])
def test_evict_one_is_bit_exact(emulated_metal, compact, traditional):
    R, n, D = 3, 77, 36
    k1, k2, k3 = mx.random.split(mx.random.key(5), 3)
    keys, values = mx.random.normal((R, n, D), key=k1), mx.random.normal((R, n, D), key=k2)
    scores = mx.floor(mx.random.uniform(shape=(R, n), key=k3) * 16)  # ties: the lowest index wins
    positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (R, n))
    theta = 100000.0 ** (-mx.arange(0, D, 2, dtype=mx.float32) / D)
    rotation = (mx.cos(theta), mx.sin(theta)) if compact else None
    got = evict.evict_one_fused(keys, values, scores, positions, scores, 2, 5, rotation, traditional, "metal")
    want = evict.evict_one_reference(keys, values, scores, positions, scores, 2, 5, rotation, traditional)
    assert_equal(got, want, "keys, values, scores, positions, slot")


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_evict_one_half_types_are_bit_exact(emulated_metal, dtype):
    """Rows of 16-byte copies and keys rotated back in float32, rounded to the 16-bit type once."""
    R, n, D = 2, 40, 64
    k1, k2, k3 = mx.random.split(mx.random.key(6), 3)
    keys, values = (mx.random.normal((R, n, D), key=k).astype(dtype) for k in (k1, k2))
    scores = mx.floor(mx.random.uniform(shape=(R, n), key=k3) * 16)
    positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (R, n))
    theta = 10000.0 ** (-mx.arange(0, D, 2, dtype=mx.float32) / D)
    args = (keys, values, scores, positions, scores, 2, 5, (mx.cos(theta), mx.sin(theta)), False)
    assert_equal(evict.evict_one_fused(*args, "metal"), evict.evict_one_reference(*args), f"{dtype}")


def test_evict_slot_is_bit_exact(emulated_metal):
    """Rows with many score ties and true positions shuffled over the slots (ties go by position)."""
    R, n, n_sink, recent_start = 3, 5000, 7, 9000
    k1, k2 = mx.random.split(mx.random.key(11), 2)
    evict_by = mx.floor(mx.random.uniform(shape=(R, n), key=k1) * 6)
    positions = (mx.argsort(mx.random.uniform(shape=(R, n), key=k2), axis=1) * 2).astype(mx.int32)
    got = evict.evict_slot_fused(evict_by, positions, n_sink, recent_start, "metal")
    assert_equal([got], [evict.evict_slot_reference(evict_by, positions, n_sink, recent_start)], "slot")


# -- kivi_attention ---------------------------------------------------------------------------------------

# Before the fix (stand-ins of one element, stats unpadded) every case failed the address-space check: the
# combine's `c < nb ? o_part : o_mma` took a device and a constant pointer (o_mma, never read, had one
# element), and without key codes `const device uint* ... = kc + ...` a constant one
@pytest.mark.parametrize("key_bits, value_bits, L, causal, D, n_k, n_v, heads, rep", [
    (2, 4, 1, False, 64, 640, 572, 2, 4), (4, 2, 2, True, 64, 640, 572, 2, 2), (8, 8, 1, False, 32, 640, 572, 2, 4),
    (4, 4, 1, False, 256, 640, 572, 2, 4), (2, 2, 1, False, 128, 640, 572, 2, 7),  # 7 rows at D 128: 32340 bytes
    (2, 2, 1, False, 64, 0, 572, 2, 4),  # no key codes: their arrays are stand-ins
    (2, 2, 1, False, 64, 640, 572, 1, 1),  # one row of one query: 4 statistics (2 partials), padded
])
def test_kivi_decode_attention_runs_as_the_reference(emulated_metal, key_bits, value_bits, L, causal, D, n_k, n_v,
                                                     heads, rep):
    M = rep * L
    q, keys, values = kivi_attention.random_case(key_bits, value_bits, 32, D, M, L, mx.float32, seed=key_bits,
                                                 n_k=n_k, n_v=n_v, heads=heads)
    got = kivi_attention.decode_attention_fused(q, keys, values, D**-0.5, causal, key_bits, value_bits, 32, "metal",
                                                tiles_per_block=2)
    want = kivi_attention.decode_attention_reference(q, keys, values, D**-0.5, "causal" if causal else None,
                                                     key_bits, value_bits, 32)
    assert_close(got, want, "output", atol=1e-5)


# TurboQuant: the largest threadgroup arrays (D 128, 8 rows: 24.6 KiB), and 3-bit codes straddling words
# with keys without QJL (their unread inputs are stand-ins)
@pytest.mark.parametrize("key_bits, value_bits, D, M, qjl", [(2, 4, 128, 8, True), (3, 3, 64, 4, False)])
def test_turboquant_decode_attention_runs_as_the_reference(emulated_metal, key_bits, value_bits, D, M, qjl):
    assert turboquant_attention.shared_bytes(128, 8, True, 3, 4) <= metal_on_cpu.THREADGROUP_MEMORY_LIMIT
    q, keys, values, n = random_case(key_bits, value_bits, D, M, qjl, seed=key_bits + D)
    got = turboquant_attention.attention_on_codes_fused(q, keys, values, n, D**-0.5, "metal", tiles_per_block=2)
    want = turboquant_attention.attention_on_codes_reference(q, keys, values, n, D**-0.5)
    assert_close(got[0], want[0], "output", atol=1e-5)
    assert_close(got[1], want[1], "log-sum-exp", atol=1e-5)


@needs_clang
def test_one_element_stand_ins_do_not_compile_on_metal(emulated_metal, monkeypatch):
    """The bug the cases above catch: with the stand-ins of one element they had before the fix, MLX
    passes them as constant pointers and the combine does not compile."""
    from kvcompress.kernels import dispatch

    monkeypatch.setattr(dispatch, "METAL_CONSTANT_BELOW", 1)  # the library's stand-ins and padding only
    monkeypatch.setattr(kivi_attention, "_stand_ins", {})
    q, keys, values = kivi_attention.random_case(2, 4, 32, 64, 4, 1, mx.float32, seed=2)
    with pytest.raises(RuntimeError, match="kivi_decode_combine(.|\n)*incompatible operand types"):
        kivi_attention.decode_attention_fused(q, keys, values, 0.125, False, 2, 4, 32, "metal")


def test_kivi_decode_attention_refuses_rows_beyond_metal_s_threadgroup_memory(emulated_metal, monkeypatch):
    """8 query rows a KV head need 34912 bytes of threadgroup memory at D 64: a Mac cannot build the
    pipeline (the emulator refuses it as MetalLimitError). The kernel's wrapper says so, and the
    dispatch takes the reference there without a self-test (no warning)."""
    from kvcompress.kernels import dispatch

    q, keys, values = kivi_attention.random_case(4, 2, 32, 64, 8, 2, mx.float32, seed=4)
    assert not kivi_attention.metal_fits(64, 8) and kivi_attention.metal_fits(128, 7)
    with pytest.raises(ValueError, match="34912"):
        kivi_attention.decode_attention_fused(q, keys, values, 0.125, True, 4, 2, 32, "metal")
    monkeypatch.setattr(kivi_attention, "metal_fits", lambda D, M: True)  # as before the fix
    with pytest.raises(metal_on_cpu.MetalLimitError, match="34912 bytes"):
        kivi_attention.decode_attention_fused(q, keys, values, 0.125, True, 4, 2, 32, "metal")
    monkeypatch.undo()
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: "metal")
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = kivi_attention.decode_attention(q, keys, values, 0.125, "causal", 4, 2, 32)
        assert dispatch.paths_used() == {"kivi_decode_attention/metal/float32": "reference"}
    finally:
        dispatch.forget_verdicts()
        dispatch.reset_paths()
    want = kivi_attention.decode_attention_reference(q, keys, values, 0.125, "causal", 4, 2, 32)
    assert_equal([got], [want], "the reference")


# -- scored_attention ------------------------------------------------------------------------------------

@pytest.mark.parametrize("G, D, accumulate, noise, evicts, vec, unroll", [
    (4, 64, True, None, False, False, 8),  # H2O
    (3, 32, False, None, False, False, 8),  # TOVA; heads padded to 4
    (1, 32, False, None, False, True, 4),  # one head, vector loads, 4 slots a SIMD-group step
    (4, 64, True, "redraw", False, False, 8),  # Keyformer
    (8, 64, True, "frozen", True, False, 8),  # Keyformer choosing the slot
    (4, 128, True, None, True, True, 8),  # H2O choosing the slot, vector loads
])
def test_scored_attention_runs_as_the_reference(emulated_metal, G, D, accumulate, noise, evicts, vec, unroll):
    R, n, allocated = (2, 1200, 1300) if evicts else (2, 150, 170)
    n_sink, recent_start = 325, allocated + 3 - 325
    q, keys, values, scores = kernel.random_case(R, G, D, n, allocated, mx.float32, seed=G + D)
    given = scores if accumulate else None
    positions = kernel.random_noise(R, G, allocated + 3, noise == "redraw", seed=G)
    gumbel = None if noise is None else positions
    choose = kernel.EvictAt(positions.positions, n_sink, recent_start) if evicts else None
    got = kernel.scored_attention_fused(q, keys, values, n, D**-0.5, given, gumbel, choose, "metal", blocks=3,
                                        vec_loads=vec, max_unroll=unroll)
    want = kernel.scored_attention_reference(q, keys, values, n, D**-0.5, given, gumbel)
    if evicts:
        want = (*want[:2], kernel.checked_slot(got[2], got[3], want[2], choose))
    for what, a, b, atol in zip(("output", "logits", "sums"), got, want, (1e-5, 1e-5, 1e-6)):
        assert_close(a, b, what, atol)


def test_scored_attention_refuses_heads_beyond_metal_s_threadgroup_memory(emulated_metal, monkeypatch):
    """8 heads at D 256: `attend` holds 33920 bytes of threadgroup arrays, over a Mac's 32 KiB."""
    from kvcompress.kernels import dispatch

    q, keys, values, scores = kernel.random_case(1, 8, 256, 40, 40, mx.float32)
    assert kernel.attend_threadgroup_bytes(8, 256) == 33920 and kernel.metal_fits(8, 224)
    with pytest.raises(ValueError, match="33920"):
        kernel.scored_attention_fused(q, keys, values, 40, 0.0625, scores, backend="metal")
    monkeypatch.setattr(kernel, "metal_fits", lambda G, D, max_unroll: True)  # as before the fix
    with pytest.raises(metal_on_cpu.MetalLimitError, match="33920 bytes"):
        kernel.scored_attention_fused(q, keys, values, 40, 0.0625, scores, backend="metal")
    monkeypatch.undo()
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: "metal")
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = kernel.scored_attention(q, keys, values, 40, 0.0625, scores)
        assert dispatch.paths_used() == {"scored_attention/metal/float32": "reference"}
    finally:
        dispatch.forget_verdicts()
        dispatch.reset_paths()
    assert_equal(got[:3], kernel.scored_attention_reference(q, keys, values, 40, 0.0625, scores)[:3], "the reference")


# -- the dispatch's self-tests --------------------------------------------------------------------------------

def test_every_self_test_passes_its_kernel(emulated_metal):
    """The self-tests a Mac's first call runs, on the emulated Metal kernels."""
    evict.slot_selftest("metal")
    evict.selftest("metal", mx.float32, True, False)
    kivi_quant.selftest("metal", mx.float32, 2, 32, True)
    kivi_attention.selftest("metal", mx.float32, (4, 2, 32, 64, 4, 1, False))
    turboquant_attention.selftest("metal", *selftest_case((3, 3, 64, 4, False)))
    kernel.selftest("metal", mx.float32, (4, 64, True, True, True))
