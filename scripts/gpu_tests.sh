#!/usr/bin/env bash
# The GPU tests on a lent H200 (they skip on a CPU): the groups at once, every log also in $OUT
# (default ./gpu-logs). The GPU benchmarks are `python -m benchmarks SUITE --gpu`.
# Usage (device, after the mlx CUDA install of ../shared/gpu/README.md): bash scripts/gpu_tests.sh [GROUP ...]
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
start=$(date +%s)
# true float32 matmuls (conftest.py says why; --noconftest skips it); the embedded model's
# test is left out: the device has no network to fetch its wheel. conftest.py needs the installed
# project: the model fixtures come alone (tests/model_fixtures.py)
pytest="python3 -m pytest -q -p no:cacheprovider --noconftest -p model_fixtures -rfEs --tb=short"
export PYTHONPATH="$PWD/tests:$PYTHONPATH"
export MLX_ENABLE_TF32=0
# The groups, each alone measured on an H100 (2026-12-07): kernels ~260 s (TurboQuant 59 s + KIVI/evict/
# dispatch 201 s); four at once did not finish in 500 s; two at once on an H100 (2026-12-08): kernels +
# eviction 369 s, scoring + scored 364 s. A device call is at most 10 minutes, so the groups named on
# the command line run at once, and the default is two calls' worth:
#   call 1: bash scripts/gpu_tests.sh kernels eviction      call 2: bash scripts/gpu_tests.sh scoring scored
groups=${*:-kernels eviction}
limit=${GPU_TESTS_TIMEOUT:-540}
run_group() {
  case $1 in
    kernels) $pytest tests/test_kivi_attention.py tests/test_turboquant_kernel.py tests/test_kivi_quant.py \
               tests/test_evict_gpu.py tests/test_evict.py tests/test_dispatch.py -k "not run_config" ;;
    eviction) $pytest tests/test_eviction.py tests/test_streaming_ring.py ;;
    scoring) $pytest tests/test_prompt_scores.py tests/test_keyformer.py tests/test_qjl.py \
               --deselect tests/test_keyformer.py::test_embedded_model_stream_generate_drop_in \
               --deselect tests/test_qjl.py::test_qjl_on_the_embedded_model_more_sketch_bits_track_the_full_cache_closer ;;
    scored) $pytest tests/test_scored_attention.py ;;
    *) echo "gpu_tests.sh: unknown group $1 (kernels, eviction, scoring, scored)"; return 2 ;;
  esac
}
for group in $groups; do
  timeout "$limit" bash -c "$(declare -f run_group); pytest='$pytest'; run_group $group" > "$out/tests_$group.log" 2>&1 &
done
wait
for group in $groups; do
  log=$out/tests_$group.log
  summary=$(grep -E "passed|failed|error" "$log" | tail -1)
  echo "== $group: ${summary:-no pytest summary (timed out after $limit s?): $(tail -1 "$log")}"
  grep -E "^(FAILED|ERROR)" "$log" | head -20
done
echo "[tests: $(( $(date +%s) - start )) s]"
