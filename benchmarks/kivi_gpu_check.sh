#!/usr/bin/env bash
# One device call on the lent H200: the GPU tests, then the KIVI kernel benchmarks, then the
# end-to-end decode benchmark; every log also goes to $OUT (default ./gpu-logs).
# Usage (device, after the mlx CUDA install of ../shared/gpu/README.md):
#   bash benchmarks/kivi_gpu_check.sh [tests] [attn] [decode] [bandwidth] [step] [e2e | e2e-kivi]
# (default: tests attn decode bandwidth e2e)
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
parts=${*:-tests attn decode bandwidth e2e}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
for part in $parts; do
  start=$(date +%s)
  case $part in
    tests)
      # true float32 matmuls (conftest.py says why; --noconftest skips it)
      MLX_ENABLE_TF32=0 python3 -m pytest -q -p no:cacheprovider --noconftest -rs tests/test_kivi_attention.py tests/test_kivi_quant.py \
        tests/test_evict_gpu.py tests/test_evict.py tests/test_eviction.py tests/test_prompt_scores.py tests/test_keyformer.py \
        tests/test_dispatch.py -k "not run_config" --durations=12 2>&1 | tee "$out/tests.log" ;;
    attn|decode|bandwidth|step)
      python3 benchmarks/kivi_gpu.py "$part" 2>&1 | tee "$out/kivi_gpu_$part.log" ;;
    e2e)
      python3 benchmarks/kivi_e2e.py --contexts 8192 32768 \
        --skip "h2o budget=0.5@32768" "keyformer budget=0.5@32768" 2>&1 | tee "$out/e2e.log" ;;
    e2e-kivi)  # the KIVI rows with full and streaming beside them (h2o/keyformer take longer)
      python3 benchmarks/kivi_e2e.py --contexts 8192 32768 \
        --caches full "kivi bits=2" "kivi bits=4" "kivi bits=2 grouped" "streaming budget=0.5" 2>&1 | tee "$out/e2e.log" ;;
  esac
  echo "[$part: $(( $(date +%s) - start )) s]"
done
