#!/usr/bin/env bash
# The GPU tests on a lent H200 (they skip on a CPU): the groups at once, every log also in $OUT
# (default ./gpu-logs). The GPU benchmarks are `python -m benchmarks SUITE --gpu`.
# Usage (device, after the mlx CUDA install of ../shared/gpu/README.md): bash scripts/gpu_tests.sh
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
start=$(date +%s)
# true float32 matmuls (conftest.py says why; --noconftest skips it); the groups at once (one group
# after another takes over ten minutes on the H200, past a device call's limit); the embedded model's
# test is left out: the device has no network to fetch its wheel. conftest.py needs the installed
# project: the model fixtures come alone (tests/model_fixtures.py)
pytest="python3 -m pytest -q -p no:cacheprovider --noconftest -p model_fixtures -rfEs --tb=short"
export PYTHONPATH="$PWD/tests:$PYTHONPATH"
export MLX_ENABLE_TF32=0
timeout 500 $pytest tests/test_kivi_attention.py tests/test_turboquant_kernel.py tests/test_kivi_quant.py tests/test_evict_gpu.py tests/test_evict.py \
  tests/test_dispatch.py -k "not run_config" > "$out/tests_kernels.log" 2>&1 &
timeout 500 $pytest tests/test_eviction.py tests/test_streaming_ring.py > "$out/tests_eviction.log" 2>&1 &
timeout 500 $pytest tests/test_prompt_scores.py tests/test_keyformer.py \
  --deselect tests/test_keyformer.py::test_embedded_model_stream_generate_drop_in > "$out/tests_scoring.log" 2>&1 &
timeout 500 $pytest tests/test_scored_attention.py > "$out/tests_scored.log" 2>&1 &
wait
for log in "$out"/tests_*.log; do echo "== $log"; grep -v "^SKIPPED" "$log" | tail -8; done
echo "[tests: $(( $(date +%s) - start )) s]"
