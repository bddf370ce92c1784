"""Every CUDA kernel of kvcompress/kernels/ on the CPU (tests/cuda_on_cpu.py: g++, one OS thread
per GPU thread, shuffles and barriers emulated), through its own Python wrapper with
`mx.fast.cuda_kernel` replaced by the emulator: the launch plans and kernel bodies run as written
and give the MLX references' numbers (bit for bit where the kernels promise it). A GPU still
decides speed, and the GPU math library's rounding (the `test_*_gpu` / GPU cases there). Also: the
bodies compile as C++ for the fp16 instantiations the emulator does not run. Skipped without g++."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import numpy as np
import pytest

import cuda_on_cpu
from kvcompress.kernels import dispatch, evict, kivi_attention, kivi_attention_mma, kivi_quant, turboquant_attention
from kvcompress.kernels import prompt_scores as prompt_kernels
from kvcompress.kernels import scored_attention as kernel
from kvcompress.methods.quantization.turboquant import random_case, selftest_case
from kvcompress.kernels.kivi_attention import CUDA_HEADER

pytestmark = pytest.mark.skipif(cuda_on_cpu.GXX is None, reason="needs g++")


@pytest.fixture
def emulated_cuda(monkeypatch, tmp_path):
    """mx.fast.cuda_kernel runs kernels on the CPU; the kernel modules build theirs anew."""
    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_on_cpu.emulated(tmp_path))
    dispatch.clear_kernel_caches()
    yield
    dispatch.clear_kernel_caches()


def assert_close(got, want, what, atol=1e-6):
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=atol, err_msg=what)


def assert_equal(got, want, what):
    assert all(a.shape == b.shape and mx.array_equal(a, b).item() for a, b in zip(got, want)), what


# -- scored_attention -------------------------------------------------------------------------------

# the signatures MLX generates for these kernels (for the compile-only check of fp16 instantiations)
ATTEND = """
template <typename T, int D, int G, int NT, bool VEC, int MAX_UN, bool NOISY>
__global__ void attend(const T* q, const T* keys, const T* values, const int32_t* dims, const float* params,
                       const uint32_t* streams, const int32_t* positions, const int32_t* slot_dims,
                       float* logits, float* part, float* stats) {
%s
}
"""
FINISH = """
template <typename T, int D, int G, int NT, bool ACCUMULATE, bool EVICT, bool NOISY>
__global__ void finish(const float* part, const float* stats, const float* logits, const float* scores,
                       const int32_t* dims, const float* params, const uint32_t* streams, const int32_t* positions,
                       const int32_t* slot_dims, T* out, float* sums, int32_t* slot_out) {
%s
}
"""


def test_scored_attention_source_compiles_as_cpp(tmp_path):
    header = CUDA_HEADER + kernel._EXTRA_HEADER["cuda"] + kernel._CHANNELS
    source = header + f"#define SLOTS_PER_BLOCK {kernel.SLOTS_PER_FINISH_BLOCK}\n"
    source += ATTEND % kernel.kernel_source("attend", "cuda") + FINISH % kernel.kernel_source("finish", "cuda")
    for T, D, G, vec, noisy in (("__half", 128, 4, "true", "true"), ("float", 64, 3, "false", "false"),
                                ("float", 256, 8, "true", "true"), ("__half", 32, 1, "false", "false")):
        source += f"template void attend<{T}, {D}, {G}, {kernel.THREADS}, {vec}, 8, {noisy}>(const {T}*, const {T}*, " \
                  "const {T}*, const int32_t*, const float*, const uint32_t*, const int32_t*, const int32_t*, float*, " \
                  "float*, float*);\n".replace("{T}", T)
        for accumulate, evicts, threads in (("true", "false", kernel.FINISH_THREADS),
                                            ("false", "false", kernel.FINISH_THREADS),
                                            ("true", "true", kernel.EVICT_THREADS)):
            source += f"template void finish<{T}, {D}, {G}, {threads}, {accumulate}, {evicts}, {noisy}>(const float*, " \
                      "const float*, const float*, const float*, const int32_t*, const float*, const uint32_t*, " \
                      f"const int32_t*, const int32_t*, {T}*, float*, int32_t*);\n"
    result = cuda_on_cpu.compile_only(source, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_compile_check_catches_a_broken_source(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel, "_FINISH_BODY", kernel._FINISH_BODY.replace("noisy_inv_sum[g] = 1.0f / total;",
                                                                            "noisy_inv_sum[g] = 1.0f / totl;"))
    with pytest.raises(AssertionError, match="totl"):
        test_scored_attention_source_compiles_as_cpp(tmp_path)


@pytest.mark.parametrize("G, D, accumulate, noise, evicts, vec, unroll", [
    (4, 64, True, None, False, False, 8),  # H2O
    (3, 32, False, None, False, False, 8),  # TOVA; heads padded to 4
    (1, 32, False, None, False, True, 4),  # one head, vector loads, 4 slots a warp step
    (2, 64, True, None, False, False, 2),  # 2 slots a warp step
    (4, 64, True, "redraw", False, False, 8),  # Keyformer
    (3, 32, True, "frozen", False, False, 8),
    (8, 64, True, "redraw", True, False, 8),  # Keyformer choosing the slot
    (4, 128, True, None, True, True, 8),  # H2O choosing the slot, vector loads
])
def test_scored_attention_runs_as_the_reference(emulated_cuda, G, D, accumulate, noise, evicts, vec, unroll):
    # slots past n hold garbage the kernels must not read; choosing a slot: more slots than the
    # block's threads, and protected positions (a quarter of them: sinks and recent) among the lowest
    R, n, allocated = (2, 1200, 1300) if evicts else (2, 150, 170)
    n_sink, recent_start = 325, allocated + 3 - 325
    q, keys, values, scores = kernel.random_case(R, G, D, n, allocated, mx.float32, seed=G + D)
    given = scores if accumulate else None
    positions = kernel.random_noise(R, G, allocated + 3, noise == "redraw", seed=G)
    gumbel = None if noise is None else positions
    choose = kernel.EvictAt(positions.positions, n_sink, recent_start) if evicts else None
    got = kernel.scored_attention_fused(q, keys, values, n, D**-0.5, given, gumbel, choose, "cuda", blocks=3,
                                        vec_loads=vec, max_unroll=unroll)
    want = kernel.scored_attention_reference(q, keys, values, n, D**-0.5, given, gumbel)
    if evicts:  # exactly the slot evict_slot picks by the kernel's own scores; that slot's score then 0
        want = (*want[:2], kernel.checked_slot(got[2], got[3], want[2], choose))
    # float32 sums in another order: logits of size ~10 and outputs of ~1000 slots round at ~1e-6
    for what, a, b, atol in zip(("output", "logits", "sums"), got, want, (1e-5, 1e-5, 1e-6)):
        assert_close(a, b, what, atol)


def test_the_run_check_catches_a_wrong_kernel(emulated_cuda, monkeypatch):
    """A wrong normalization of the noisy probabilities (the plain softmax's max instead) fails."""
    monkeypatch.setattr(kernel, "_FINISH_BODY", kernel._FINISH_BODY.replace("/ tau - noisy_max[g]", "/ tau - final_max[g]"))
    with pytest.raises(AssertionError, match="sums"):
        test_scored_attention_runs_as_the_reference(None, 4, 64, True, "redraw", False, False, 8)


# -- the other kernels --------------------------------------------------------------------------------

# D 32 and 256: the combine's fewest and most channels a partial (32 and 4 partials read at once)
@pytest.mark.parametrize("key_bits, value_bits, L, causal, D", [(2, 4, 1, False, 64), (4, 2, 2, True, 64),
                                                                (8, 8, 1, False, 32), (4, 4, 1, False, 256)])
def test_kivi_decode_attention_runs_as_the_reference(emulated_cuda, key_bits, value_bits, L, causal, D):
    M = 4 * L
    q, keys, values = kivi_attention.random_case(key_bits, value_bits, 32, D, M, L, mx.float32, seed=key_bits)
    got = kivi_attention.decode_attention_fused(q, keys, values, D**-0.5, causal, key_bits, value_bits, 32, "cuda",
                                                tiles_per_block=2)
    want = kivi_attention.decode_attention_reference(q, keys, values, D**-0.5, "causal" if causal else None,
                                                     key_bits, value_bits, 32)
    assert_close(got, want, "output", atol=1e-5)


# TurboQuant: 3-bit key codes (4 bits with QJL: codes straddle words) and 3-bit values at D 64, 4 rows;
# 1-bit key codes at D 128, 8 rows; keys without QJL at D 32, one row. 300 tokens: two tiles and part of a third
@pytest.mark.parametrize("key_bits, value_bits, D, M, qjl", [(4, 3, 64, 4, True), (2, 4, 128, 8, True),
                                                             (3, 2, 32, 1, False)])
def test_turboquant_decode_attention_runs_as_the_reference(emulated_cuda, key_bits, value_bits, D, M, qjl):
    q, keys, values, n = random_case(key_bits, value_bits, D, M, qjl, seed=key_bits + D)
    got = turboquant_attention.attention_on_codes_fused(q, keys, values, n, D**-0.5, "cuda", tiles_per_block=2)
    want = turboquant_attention.attention_on_codes_reference(q, keys, values, n, D**-0.5)
    assert_close(got[0], want[0], "output", atol=1e-5)
    assert_close(got[1], want[1], "log-sum-exp", atol=1e-5)


def relative_l2(got, want) -> float:
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# the tensor-core kernel (fp16 fragments: the emulator's mma, movmatrix and half2 arithmetic) with the
# scalar kernel taking the rest of the tokens, against dequantize-then-attend in float32
@pytest.mark.parametrize("key_bits, value_bits, G, D, M, L, causal, steps_per_warp, n_k, n_v", [
    (2, 2, 32, 64, 4, 1, False, 1, 832, 780),
    (4, 4, 32, 64, 4, 1, False, 3, 832, 780),  # warps without steps
    (2, 4, 64, 128, 4, 2, True, 1, 896, 781),  # an odd number of value rows
    (4, 2, 32, 64, 3, 1, False, 2, 832, 780),  # rows that fill part of the fragments
    (4, 4, 64, 64, 2, 1, False, 2, 832, 780),  # an odd number of key groups a row (13)
    (2, 2, 32, 128, 4, 1, False, 2, 832, 780),  # the default's shape: four value groups a token
])
def test_kivi_decode_attention_tensor_cores_run_as_the_reference(emulated_cuda, key_bits, value_bits, G, D, M, L,
                                                                  causal, steps_per_warp, n_k, n_v):
    q, keys, values = kivi_attention.random_case(key_bits, value_bits, G, D, M, L, mx.float16, seed=key_bits + D,
                                                 T=900, n_k=n_k, n_v=n_v)
    assert kivi_attention_mma.tokens_covered(keys.n_packed, values.n_packed, 900, L, causal) == 768
    got = kivi_attention.decode_attention_fused(q, keys, values, D**-0.5, causal, key_bits, value_bits, G, "cuda",
                                                tiles_per_block=1, tensor_cores=True, steps_per_warp=steps_per_warp,
                                                one_launch=steps_per_warp % 2 == 0,
                                                l2_prefetch=64 * (steps_per_warp - 1))  # a hint: same numbers
    want = kivi_attention.decode_attention_reference(q.astype(mx.float32), kivi_attention._as_f32(keys),
                                                     kivi_attention._as_f32(values), D**-0.5,
                                                     "causal" if causal else None, key_bits, value_bits, G)
    assert relative_l2(got, want) < 1e-3


def test_tensor_cores_are_the_default_for_long_2_bit_caches(emulated_cuda, monkeypatch):
    launches = []
    real = kivi_attention_mma.partials
    monkeypatch.setattr(kivi_attention_mma, "partials", lambda *a, **k: launches.append(a[1]) or real(*a, **k))
    # the tensor-core kernel could take the 768 tokens below the residuals: it does from the threshold on
    for bits, threshold, expected in ((2, 768, 1), (2, 769, 0), (4, 768, 0)):
        monkeypatch.setattr(kivi_attention, "TENSOR_CORE_MIN_TOKENS", threshold)
        launches.clear()
        q, keys, values = kivi_attention.random_case(bits, bits, 32, 64, 4, 1, mx.float16, seed=bits, T=900, n_k=832,
                                                     n_v=780)
        got = kivi_attention.decode_attention_fused(q, keys, values, 64**-0.5, False, bits, bits, 32, "cuda")
        assert len(launches) == expected
        if expected:  # dims: the tensor-core kernel took the 768 tokens, the default steps a warp
            assert launches[0][9] == 768 and launches[0][11] == kivi_attention_mma.STEPS_PER_WARP
        want = kivi_attention.decode_attention_reference(q.astype(mx.float32), kivi_attention._as_f32(keys),
                                                         kivi_attention._as_f32(values), 64**-0.5, None, bits, bits, 32)
        assert relative_l2(got, want) < 1e-3


def test_the_tensor_core_threshold_lies_between_the_measured_lengths():
    # measured on the H200 (kivi_attention.TENSOR_CORE_MIN_TOKENS): at a 16k context the scalar kernel was
    # faster, at 32k the tensor cores; the paper's policy keeps R = 128 values below the codes
    def bulk(context):
        cache_keys, cache_values = context - context % 128, context - 128
        return kivi_attention_mma.tokens_covered(cache_keys, cache_values, context, 1, False)

    assert bulk(16384) < kivi_attention.TENSOR_CORE_MIN_TOKENS <= bulk(32768)


def test_the_self_test_checks_the_tensor_core_kernel_too(emulated_cuda, monkeypatch):
    # the dispatch self-tests a variant on a short case, below the default's threshold: it must run the
    # kernel that long caches of 2-bit codes will take, and catch it being wrong
    launches = []
    real = kivi_attention_mma.partials
    monkeypatch.setattr(kivi_attention_mma, "partials", lambda *a, **k: launches.append(a[1]) or real(*a, **k))
    kivi_attention.selftest("cuda", mx.float16, (2, 2, 32, 64, 4, 1, False))
    assert len(launches) == 1

    def wrong(*a, **k):  # the tensor-core kernel's partial outputs (the last but one array) twice too large
        out = list(real(*a, **k))
        out[-2] = out[-2] * 2
        return out

    monkeypatch.setattr(kivi_attention_mma, "partials", wrong)
    with pytest.raises(AssertionError, match="tensor cores"):
        kivi_attention.selftest("cuda", mx.float16, (2, 2, 32, 64, 4, 1, False))


def test_tensor_cores_alone_where_no_token_is_left(emulated_cuda):
    # whole steps of codes on both sides and no residual: no scalar blocks in the launch, none to combine
    q, keys, values = kivi_attention.random_case(2, 2, 32, 64, 4, 1, mx.float16, seed=7, T=768, n_k=768, n_v=768)
    got = kivi_attention.decode_attention_fused(q, keys, values, 64**-0.5, False, 2, 2, 32, "cuda", tensor_cores=True)
    want = kivi_attention.decode_attention_reference(q.astype(mx.float32), kivi_attention._as_f32(keys),
                                                     kivi_attention._as_f32(values), 64**-0.5, None, 2, 2, 32)
    assert relative_l2(got, want) < 1e-3


def test_tensor_cores_cover_only_what_fits():
    def covers(D, M, bits, dtype=mx.float16):
        return kivi_attention_mma.supported(dtype, D, bits, bits, 32, M, kivi_attention.scalar_shared_bytes(D, M))

    assert covers(128, 4, 2) and covers(128, 5, 4) and covers(64, 7, 2)
    assert not covers(128, 5, 2) and not covers(128, 8, 4) and not covers(256, 1, 2)  # 48 KiB of shared memory
    assert not covers(128, 4, 2, mx.bfloat16) and not covers(128, 4, 8)
    for D, M, bits in ((128, 4, 2), (128, 5, 4), (64, 8, 4)):
        scalar = kivi_attention.scalar_shared_bytes(D, M)
        assert kivi_attention_mma.shared_bytes(D, M, bits, bits, 32, scalar) <= kivi_attention_mma.SHARED_LIMIT
    # rows that allow the copies: whole 16-byte key rows; two key groups a step need an even count
    # (G 32 < 64-token steps); one value group a token needs an even number of value rows
    assert kivi_attention_mma.aligned(8, 13, 781, 4, 64, 32)
    assert not kivi_attention_mma.aligned(8, 13, 780, 4, 32, 64) and not kivi_attention_mma.aligned(6, 12, 780, 4, 32, 64)
    assert not kivi_attention_mma.aligned(8, 12, 781, 1, 128, 64) and kivi_attention_mma.aligned(8, 12, 782, 1, 128, 64)
    q, keys, values = kivi_attention.random_case(2, 2, 32, 64, 4, 1, mx.float16)
    with pytest.raises(ValueError, match="l2_prefetch: expected 0, 64, 128 or 256, got 32"):
        kivi_attention.decode_attention_fused(q, keys, values, 0.125, False, 2, 2, 32, "cuda", l2_prefetch=32)


@pytest.mark.parametrize("bits, G, per_channel, groups", [
    (2, 32, False, 3), (4, 64, False, 3), (8, 128, False, 3), (2, 32, True, 2), (4, 32, True, 2), (8, 64, True, 2),
    (2, 128, True, 2), (2, 32, True, 5), (4, 64, True, 3)])
def test_kivi_quantize_pack_is_bit_exact(emulated_cuda, bits, G, per_channel, groups):
    # shapes that leave part of the last warp idle; per channel, 44 channels (11 loads of 4 floats: an
    # odd chunk count, and a warp takes chunk pairs) and group counts that do not fill a warp's 128 / G
    # groups (5 at G 32: one whole block of groups and one with a group in use)
    shape = (3, groups * G, 44) if per_channel else (3, 7, groups * G)
    x = mx.random.normal(shape, key=mx.random.key(bits)) * 3
    x = mx.where(mx.arange(shape[-1]) % 7 == 0, mx.round(x * 2) / 2, x)  # quotients exactly on half-integers
    x = mx.concatenate([x[:1] * 0 + 1.5, x[1:]])  # constant groups: scale 0, codes 0
    got = kivi_quant.quantize_pack_kernel(x, bits, G, per_channel, "cuda", init_value=3.0)
    assert_equal(got, kivi_quant.quantize_pack_reference(x, bits, G, per_channel), "codes, scales, zeros")


@pytest.mark.parametrize("compact, traditional", [(False, False), (True, False), (True, True)])
def test_evict_one_is_bit_exact(emulated_cuda, compact, traditional):
    R, n, D = 3, 77, 36
    k1, k2, k3 = mx.random.split(mx.random.key(5), 3)
    keys, values = mx.random.normal((R, n, D), key=k1), mx.random.normal((R, n, D), key=k2)
    scores = mx.floor(mx.random.uniform(shape=(R, n), key=k3) * 16)  # ties: the lowest index wins
    positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (R, n))
    theta = 100000.0 ** (-mx.arange(0, D, 2, dtype=mx.float32) / D)
    rotation = (mx.cos(theta), mx.sin(theta)) if compact else None
    got = evict.evict_one_fused(keys, values, scores, positions, scores, 2, 5, rotation, traditional, "cuda")
    want = evict.evict_one_reference(keys, values, scores, positions, scores, 2, 5, rotation, traditional)
    assert_equal(got, want, "keys, values, scores, positions, slot")


def test_evict_slot_is_bit_exact(emulated_cuda):
    """Rows with many score ties and true positions shuffled over the slots (ties go by position)."""
    R, n, n_sink, recent_start = 3, 5000, 7, 9000
    k1, k2 = mx.random.split(mx.random.key(11), 2)
    evict_by = mx.floor(mx.random.uniform(shape=(R, n), key=k1) * 6)
    positions = (mx.argsort(mx.random.uniform(shape=(R, n), key=k2), axis=1) * 2).astype(mx.int32)
    got = evict.evict_slot_fused(evict_by, positions, n_sink, recent_start, "cuda")
    assert_equal([got], [evict.evict_slot_reference(evict_by, positions, n_sink, recent_start)], "slot")


# -- prompt_scores (tensor cores: the emulator's product gives each lane its fragment's elements) -------

@pytest.mark.parametrize("R, G, L, n, D, noise", [
    (2, 3, 40, 70, 32, None),  # one ragged tile of rows, two of keys
    (1, 4, 100, 100, 64, None),  # a whole prompt: 400 rows, every tile
    (1, 2, 200, 250, 16, None),  # a later chunk: the last key tiles skip the row tiles before their queries
    (2, 1, 5, 130, 16, None),  # five queries late in a long prompt
    (2, 3, 40, 70, 32, "redraw"),  # Keyformer: its noise drawn per query
    (1, 2, 200, 250, 16, "frozen"),  # its frozen noise, a later chunk
])
def test_prompt_scores_run_as_the_reference(emulated_cuda, R, G, L, n, D, noise):
    q, k = prompt_kernels.random_case(R, G, L, n, D, mx.float32, seed=n)
    gumbel = None if noise is None else prompt_kernels.random_noise(R, G, L, n, noise == "redraw", seed=L)
    got = prompt_kernels.accumulated_attention_fused(q, k, D**-0.5, gumbel)
    assert_close(got, prompt_kernels.accumulated_attention_reference(q, k, D**-0.5, gumbel), "scores", atol=1e-5)
    np.testing.assert_allclose(np.array(got.sum(axis=1)), G * L, rtol=1e-5)  # each query's probabilities sum to 1


@pytest.mark.parametrize("source, wrong", [
    ("_HEADER", ("if (MASKED && key > position[h])", "if (MASKED && key >= position[h])")),  # the diagonal left out of a row's softmax
    ("_HEADER", ("(x + gumbel_fast(row_hash[i], (unsigned int)key[h])) * scale[i]", "x * scale[i]")),  # no noise in pass 2
    ("_HEADER", ("const float x = s[j][2 * h + c];", "const float x = s[j][2 * (1 - h) + c];")),  # a logit from the wrong register
    ("_COLUMN_SUMS_BODY", ("if (m0 + 63 < M && first", "if (first")),  # padding rows counted
    ("_HEADER", ("8 * ((lane / 8) % 2)", "8 * ((lane / 16) % 2)")),  # ldmatrix: the wrong head-dim half
    ("_HEADER", ("a[k][2] = *reinterpret_cast<const P*>(lo + k * 16 + 8);",  # an A fragment from the wrong row
                 "a[k][2] = *reinterpret_cast<const P*>(hi + k * 16 + 8);")),
])
def test_the_prompt_scores_check_catches_a_wrong_kernel(emulated_cuda, monkeypatch, source, wrong):
    assert wrong[0] in getattr(prompt_kernels, source)
    monkeypatch.setattr(prompt_kernels, source, getattr(prompt_kernels, source).replace(*wrong))
    with pytest.raises(AssertionError, match="scores"):  # noisy ragged tiles; then few queries late in a prompt
        for case in ((2, 3, 40, 70, 32, "redraw"), (2, 1, 5, 130, 16, None)):
            test_prompt_scores_run_as_the_reference(None, *case)


def test_prompt_kernels_draw_keyformers_noise(emulated_cuda):
    """`gumbel_fast` (the prompt kernels' draw: log2, and a series for -log(u) near u = 1) against
    the counter hash's exact draw, frozen noise of 8 streams x 4096 key positions. The emulator's
    log2 is exact, so this checks everything but the hardware's lg2 error (~1e-7, the GPU tests'):
    the hash, u, the branch and the series, which ~0.2% of draws take (g > 6.2 here)."""
    from kvcompress.kernels.counter_hash import gumbel_noise_from_streams, noise_streams

    streams = noise_streams(0, 3, mx.arange(8, dtype=mx.uint32).reshape(8, 1))
    draw = mx.fast.cuda_kernel(name="draw", input_names=["streams"], output_names=["out"], header=prompt_kernels._HEADER,
                               source="""
        const unsigned int row_hash = mix32(streams[blockIdx.y]);  // frozen: the kernels' hash at redraw = 0
        for (int j = threadIdx.x; j < 4096; j += blockDim.x) out[blockIdx.y * 4096 + j] = gumbel_fast(row_hash, j);
    """)
    (got,) = draw(inputs=[streams], grid=(64, 8, 1), threadgroup=(64, 1, 1), output_shapes=[(8, 4096)],
                  output_dtypes=[mx.float32])
    want = np.array(gumbel_noise_from_streams(streams, None, mx.arange(4096, dtype=mx.int32)[None], fused=False))[:, 0, 0]
    assert (want > 6.2).sum() >= 20  # the series branch ran (v < 2^-9: -log(v) > 6.24)
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=2e-6)


# -- the dispatch's self-tests, and a cache taking the kernels ------------------------------------------

def test_every_self_test_passes_its_kernel(emulated_cuda):
    """The self-tests the dispatch runs on a GPU's first call: their own code (arguments, the
    comparison) runs here against the emulated kernels, so a broken self-test would not silently
    turn a GPU to the reference."""
    evict.slot_selftest("cuda")
    evict.selftest("cuda", mx.float32, True, False)
    kivi_quant.selftest("cuda", mx.float32, 2, 32, True)
    kivi_attention.selftest("cuda", mx.float32, (4, 2, 32, 64, 4, 1, False))
    turboquant_attention.selftest("cuda", *selftest_case((3, 3, 64, 4, True)))
    kernel.selftest("cuda", mx.float32, (4, 64, True, True, True))  # every option (the others: fewer branches)
    prompt_kernels.selftest("cuda", mx.float32, (32, True))


def test_a_self_test_rejects_a_wrong_kernel(emulated_cuda, monkeypatch):
    monkeypatch.setattr(kernel, "_FINISH_BODY", kernel._FINISH_BODY.replace("slot_out[row] = best_slot[0]",
                                                                            "slot_out[row] = best_slot[1]"))
    with pytest.raises(AssertionError, match="slot"):
        kernel.selftest("cuda", mx.float32, (4, 64, True, False, True))


def test_the_turboquant_self_test_rejects_a_kernel_without_the_qjl_term(emulated_cuda, monkeypatch):
    monkeypatch.setattr(turboquant_attention, "CUDA_ATTN_SOURCE", turboquant_attention.CUDA_ATTN_SOURCE.replace(
        "(dot[m][i] + rn[i] * qj[m][i])", "dot[m][i]"))
    with pytest.raises(AssertionError, match="turboquant_decode_attention self-test"):
        turboquant_attention.selftest("cuda", *selftest_case((3, 3, 64, 4, True)))


def test_turboquant_cache_decodes_through_the_kernel(emulated_cuda, monkeypatch):
    """A TurboQuant cache whose dispatch sees a CUDA GPU runs its decode steps through the (emulated)
    kernel, the step's own token merged by log-sum-exp, and gives the reference path's outputs."""
    from kvcompress.kernels import dispatch
    from test_turboquant_kernel import decode_steps

    plain = decode_steps(4, 3, 64, 4, steps=2)
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: "cuda")
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    try:
        fused = decode_steps(4, 3, 64, 4, steps=2)
        assert dispatch.paths_used() == {"turboquant_decode_attention/cuda/float32": "fused"}
    finally:
        dispatch.forget_verdicts()
        dispatch.reset_paths()
    for a, b in zip(fused, plain):
        assert_close(a, b, "output", atol=1e-5)


@pytest.mark.parametrize("method", ["h2o", "keyformer"])
def test_cache_step_through_the_kernels(emulated_cuda, monkeypatch, method):
    """An H2O / Keyformer cache whose dispatch sees a CUDA GPU runs its decode steps through the
    (emulated) kernels, noise and slot choice included, and keeps what the plain step keeps."""
    from kvcompress.kernels import dispatch
    from test_scored_attention import Layer

    monkeypatch.setattr(dispatch, "gpu_backend", lambda: "cuda")
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    try:
        layer = Layer(method, budget=40, H=2, G=4, D=64, seed=8)
        layer.feed(79)
        layer.feed()
        for _ in range(3):
            plain, scored = layer.feed()
            assert_close(scored, plain, "output", atol=1e-5)
            assert_close(layer.scored.scores, layer.plain.scores, "scores", atol=1e-6)
            assert np.array_equal(np.array(layer.scored.kept_positions()), np.array(layer.plain.kept_positions()))
        assert dispatch.paths_used()["scored_attention/cuda/float32"] == "fused"  # (the plain cache: evict_slot)
    finally:
        dispatch.forget_verdicts()
        dispatch.reset_paths()


@pytest.mark.parametrize("method", ["h2o", "keyformer"])
def test_cache_prompt_through_the_kernels(emulated_cuda, monkeypatch, method):
    """An H2O / Keyformer cache whose dispatch sees a CUDA GPU scores its prompt through the
    (emulated) tensor-core kernels, Keyformer's noise drawn there, and keeps what the MLX tiles keep."""
    from kvcompress.kernels import dispatch
    from kvcompress.methods import method_config
    from kvcompress.methods.eviction.base import EvictionCache

    cfg = method_config(method, budget=40)
    k1, k2, k3 = mx.random.split(mx.random.key(5), 3)
    keys, values = mx.random.normal((1, 2, 150, 32), key=k1), mx.random.normal((1, 2, 150, 32), key=k2)
    queries = mx.random.normal((1, 6, 150, 32), key=k3)

    def prefill():
        cache = EvictionCache(cfg, 1, 4, 2, 32, None, 32**-0.5)
        cache.from_prefill(keys, values, queries)
        return cache

    tiles = prefill()
    monkeypatch.setattr(dispatch, "gpu_backend", lambda: "cuda")
    # float32 here (the emulator's); a GPU's tensor cores take fp16 / bf16 only
    monkeypatch.setattr(prompt_kernels, "shape_supported", lambda head_dim, dtype: head_dim % 16 == 0)
    dispatch.forget_verdicts()
    dispatch.reset_paths()
    try:
        with_kernels = prefill()
        assert dispatch.paths_used()["prompt_scores/cuda/float32"] == "fused"
    finally:
        dispatch.forget_verdicts()
        dispatch.reset_paths()
    assert_close(with_kernels.scores, tiles.scores, "scores", atol=1e-5)
    assert np.array_equal(np.array(with_kernels.kept_positions()), np.array(tiles.kept_positions()))

