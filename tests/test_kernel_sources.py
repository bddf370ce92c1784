"""The CUDA kernel bodies of kvcompress/kernels/scored_attention.py and evict.py's slot choice on the CPU (tests/cuda_on_cpu.py:
g++, one OS thread per GPU thread, shuffles and barriers emulated): they compile as C++, and run
as written they give the MLX reference's numbers. A GPU still decides speed and the GPU math
library's rounding (tests/test_scored_attention.py there). Skipped without g++."""

import kvcompress  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
import numpy as np
import pytest

import cuda_on_cpu
from kvcompress.kernels import scored_attention as kernel
from kvcompress.kernels.evict import evict_slot_reference
from kvcompress.kernels.kivi_attention import CUDA_HEADER

pytestmark = pytest.mark.skipif(cuda_on_cpu.GXX is None, reason="needs g++")

# the signatures MLX generates for these kernels: inputs const, then outputs, template parameters
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


def kernels() -> str:
    header = CUDA_HEADER + kernel._EXTRA_HEADER["cuda"] + kernel._CHANNELS + f"#define SLOTS_PER_BLOCK {kernel.SLOTS_PER_FINISH_BLOCK}\n"
    return (header + ATTEND % (kernel._INDEX["cuda"] + kernel._ATTEND_BODY)
            + FINISH % (kernel._INDEX["cuda"] + kernel._FINISH_BODY))


def test_cuda_source_compiles_as_cpp(tmp_path):
    source = kernels()
    for T, D, G, vec, noisy in (("__half", 128, 4, "true", "true"), ("float", 64, 3, "false", "false"),
                                ("float", 256, 8, "true", "true"), ("__half", 32, 1, "false", "false")):
        source += f"template void attend<{T}, {D}, {G}, {kernel.THREADS}, {vec}, 8, {noisy}>(const {T}*, const {T}*, const {T}*, " \
                  "const int32_t*, const float*, const uint32_t*, const int32_t*, const int32_t*, float*, float*, float*);\n"
        for accumulate, evict, threads in (("true", "false", kernel.FINISH_THREADS), ("false", "false", kernel.FINISH_THREADS),
                                           ("true", "true", kernel.EVICT_THREADS)):
            source += f"template void finish<{T}, {D}, {G}, {threads}, {accumulate}, {evict}, {noisy}>(const float*, " \
                      "const float*, const float*, const float*, const int32_t*, const float*, const uint32_t*, " \
                      f"const int32_t*, const int32_t*, {T}*, float*, int32_t*);\n"
    result = cuda_on_cpu.compile_only(source, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_compile_check_catches_a_broken_source(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel, "_FINISH_BODY", kernel._FINISH_BODY.replace("noisy_inv_sum[g] = 1.0f / total;",
                                                                            "noisy_inv_sum[g] = 1.0f / totl;"))
    with pytest.raises(AssertionError, match="totl"):
        test_cuda_source_compiles_as_cpp(tmp_path)


def run_on_cpu(q, keys, values, n, scale, scores, noise, evict, blocks, workdir, vec=False, unroll=8):
    """The two launches as scored_attention_fused makes them, float32, through cuda_on_cpu."""
    R, G, D = q.shape
    plan = kernel.launch_plan(n, R, G, D, keys.shape[1], scale, noise, evict, blocks)
    noisy, accumulate = str(noise is not None).lower(), str(scores is not None).lower()
    positions = noise.positions if noise else evict.positions if evict else mx.zeros((1,), mx.int32)
    inputs = {
        "q": np.array(q), "keys": np.array(keys), "values": np.array(values),
        "dims": np.array(plan.dims, np.int32), "params": np.array(plan.params, np.float32),
        "streams": np.array(noise.streams) if noise else np.zeros(1, np.uint32),
        "positions": np.array(positions), "slot_dims": np.array(plan.slot_dims, np.int32),
        "scores": np.array(scores) if scores is not None else np.zeros(1, np.float32),
    }
    nb = plan.chunks
    outputs = {"logits": (R * G * n, np.float32), "part": (R * nb * G * D, np.float32), "stats": (R * nb * G * 4, np.float32),
               "out": (R * G * D, np.float32), "sums": (R * n, np.float32), "slot_out": (R, np.int32)}
    launches = [
        (f"attend<float, {D}, {G}, {kernel.THREADS}, {str(vec).lower()}, {unroll}, {noisy}>", nb, R, kernel.THREADS,
         ["q", "keys", "values", "dims", "params", "streams", "positions", "slot_dims", "logits", "part", "stats"]),
        (f"finish<float, {D}, {G}, {plan.finish_threads}, {accumulate}, {str(evict is not None).lower()}, {noisy}>",
         plan.finish_blocks, R, plan.finish_threads, ["part", "stats", "logits", "scores", "dims", "params", "streams",
                                                      "positions", "slot_dims", "out", "sums", "slot_out"]),
    ]
    got = cuda_on_cpu.run(kernels(), launches, inputs, outputs, workdir)
    return got["out"].reshape(R, G, D), got["logits"].reshape(R, G, n), got["sums"].reshape(R, n), got["slot_out"]


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
def test_cuda_source_run_on_cpu_matches_reference(tmp_path, G, D, accumulate, noise, evicts, vec, unroll):
    # slots past n hold garbage the kernels must not read; choosing a slot: more slots than the
    # block's threads, and protected positions (a quarter of them: sinks and recent) among the lowest
    R, n, allocated = (2, 1200, 1300) if evicts else (2, 150, 170)
    n_sink, recent_start = 325, allocated + 3 - 325
    q, keys, values, scores = kernel.random_case(R, G, D, n, allocated, mx.float32, seed=G + D)
    given = scores if accumulate else None
    positions = kernel.random_noise(R, G, allocated + 3, noise == "redraw", seed=G)
    gumbel = None if noise is None else positions
    evict = kernel.EvictAt(positions.positions, n_sink, recent_start) if evicts else None
    got = run_on_cpu(q, keys, values, n, D**-0.5, given, gumbel, evict, 3, tmp_path, vec, unroll)
    want = kernel.scored_attention_reference(q, keys, values, n, D**-0.5, given, gumbel)
    # float32 sums in another order: logits of size ~10 and outputs of ~1000 slots round at ~1e-6 absolute
    for what, a, b, atol in zip(("output", "logits", "sums"), got, want, (1e-5, 1e-5, 1e-6)):
        np.testing.assert_allclose(a, np.array(b), rtol=2e-5, atol=atol, err_msg=what)
    if evicts:  # exactly the slot evict_slot picks by the kernel's own scores
        want_slot = evict_slot_reference(mx.array(got[2]), positions.positions[:, :n], n_sink, recent_start)
        np.testing.assert_array_equal(got[3], np.array(want_slot))


def test_the_run_check_catches_a_wrong_kernel(tmp_path, monkeypatch):
    """A wrong normalization of the noisy probabilities (the plain softmax's max instead) fails."""
    monkeypatch.setattr(kernel, "_FINISH_BODY", kernel._FINISH_BODY.replace("/ tau - noisy_max[g]", "/ tau - final_max[g]"))
    with pytest.raises(AssertionError, match="sums"):
        test_cuda_source_run_on_cpu_matches_reference(tmp_path, 4, 64, True, "redraw", False, False, 8)


def test_evict_slot_cuda_source_is_bit_exact_on_cpu(tmp_path):
    """kernels/evict.py's slot choice, run as written: exactly the reference's slot, on rows with
    many score ties and true positions shuffled over the slots (the tie rule is by position)."""
    from kvcompress.kernels import evict

    R, n, n_sink, recent_start = 3, 5000, 7, 9000
    k1, k2 = mx.random.split(mx.random.key(11), 2)
    evict_by = mx.floor(mx.random.uniform(shape=(R, n), key=k1) * 6)
    positions = (mx.argsort(mx.random.uniform(shape=(R, n), key=k2), axis=1) * 2).astype(mx.int32)
    source = evict.CUDA_HEADER + f"#define SLOT_THREADS {evict.SLOT_THREADS}\n#define SLOT_UNROLL {evict.SLOT_UNROLL}\n"
    source += ("__global__ void evict_slot(const float* evict_by, const int32_t* evict_by_shape, const int32_t* positions, "
               "const int32_t* bounds, int32_t* slot_out) {\n" + evict._SLOT_INDEX["cuda"] + evict._SLOT_BODY + "}\n")
    inputs = {"evict_by": np.array(evict_by), "evict_by_shape": np.array([R, n], np.int32),
              "positions": np.array(positions), "bounds": np.array([n_sink, recent_start], np.int32)}
    got = cuda_on_cpu.run(source, [("evict_slot", 1, R, evict.SLOT_THREADS,
                                    ["evict_by", "evict_by_shape", "positions", "bounds", "slot_out"])],
                          inputs, {"slot_out": (R, np.int32)}, tmp_path)["slot_out"]
    want = evict.evict_slot_reference(evict_by, positions, n_sink, recent_start)
    np.testing.assert_array_equal(got, np.array(want))
