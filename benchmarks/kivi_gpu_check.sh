#!/usr/bin/env bash
# One device call on the lent H200: the GPU tests, then the KIVI kernel benchmarks, then the
# end-to-end decode benchmark; every log also goes to $OUT (default ./gpu-logs).
# Usage (device, after the mlx CUDA install of ../shared/gpu/README.md):
#   bash benchmarks/kivi_gpu_check.sh [tests] [attn] [decode] [bandwidth] [step] [scored] [prompt] [passes] [host] [buffers] [scaling] [e2e | e2e-batch | e2e-kivi]
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
      # true float32 matmuls (conftest.py says why; --noconftest skips it); three groups at once
      # (one group after another takes over ten minutes on the H200, past a device call's limit);
      # the embedded model's test is left out: the device has no network to fetch its wheel
      # conftest.py needs the installed project: the model fixtures come alone (tests/model_fixtures.py)
      pytest="python3 -m pytest -q -p no:cacheprovider --noconftest -p model_fixtures -rfEs --tb=short"
      export PYTHONPATH="$PWD/tests:$PYTHONPATH"
      export MLX_ENABLE_TF32=0
      timeout 500 $pytest tests/test_kivi_attention.py tests/test_kivi_quant.py tests/test_evict_gpu.py tests/test_evict.py \
        tests/test_dispatch.py -k "not run_config" > "$out/tests_kernels.log" 2>&1 &
      timeout 500 $pytest tests/test_eviction.py tests/test_streaming_ring.py > "$out/tests_eviction.log" 2>&1 &
      timeout 500 $pytest tests/test_prompt_scores.py tests/test_keyformer.py \
        --deselect tests/test_keyformer.py::test_embedded_model_stream_generate_drop_in > "$out/tests_scoring.log" 2>&1 &
      timeout 500 $pytest tests/test_scored_attention.py > "$out/tests_scored.log" 2>&1 &
      wait
      for log in "$out"/tests_*.log; do echo "== $log"; grep -v "^SKIPPED" "$log" | tail -8; done ;;
    attn|decode|bandwidth|step)
      python3 benchmarks/kivi_gpu.py "$part" 2>&1 | tee "$out/kivi_gpu_$part.log" ;;
    scored)  # the scoring methods' decode kernels, every variant, against SDPA and the MLX ops
      python3 benchmarks/scored_attention_speed.py 2>&1 | tee "$out/scored_attention.log" ;;
    prompt)  # H2O's and Keyformer's prompt scoring: the tensor-core kernels against the MLX tiles
      python3 benchmarks/prompt_scores_speed.py --tokens 8192 32768 --dtype float16 --cache --against tiles \
        2>&1 | tee "$out/prompt_scores.log" ;;
    passes)  # the prompt kernels' two passes apart, plain and with Keyformer's noise
      python3 benchmarks/prompt_passes_speed.py 2>&1 | tee "$out/prompt_passes.log" ;;
    host)  # a decode step's host phases (build, submit, wait) per cache, 32k
      python3 benchmarks/host_time.py 2>&1 | tee "$out/host_time.log" ;;
    buffers)  # do the caches' key buffers stay in place, sync and pipelined?
      python3 benchmarks/buffers_in_place.py 2>&1 | tee "$out/buffers.log" ;;
    scaling)  # KIVI decode attention per layer, layers chained as in a model: the defaults' choices
      python3 benchmarks/kernel_scaling.py attn --steps 2 4 --contexts 8192 16384 32768 131072 \
        2>&1 | tee "$out/kernel_scaling.log" ;;
    e2e)
      python3 benchmarks/kivi_e2e.py --contexts 32768 8192 --steps 8 --rounds 3 --warmup 2 \
        --caches full "kivi bits=2" "kivi bits=4" "streaming budget=0.5" "snapkv budget=0.5" "tova budget=0.5" \
        "h2o budget=0.5" "keyformer budget=0.5" 2>&1 | tee "$out/e2e.log" ;;
    e2e-batch)  # four 32k sequences decoded together: the GPU's work outweighs the host's
      python3 benchmarks/kivi_e2e.py --batch 4 --contexts 32768 --steps 8 --rounds 3 --warmup 2 --prefill-rounds 2 \
        --caches full "kivi bits=2" "kivi bits=4" "streaming budget=0.5" "snapkv budget=0.5" "tova budget=0.5" \
        "h2o budget=0.5" "keyformer budget=0.5" 2>&1 | tee "$out/e2e_batch.log" ;;
    e2e-kivi)  # the KIVI rows with full and streaming beside them (h2o/keyformer take longer)
      python3 benchmarks/kivi_e2e.py --contexts 8192 32768 \
        --caches full "kivi bits=2" "kivi bits=4" "kivi bits=2 grouped" "streaming budget=0.5" 2>&1 | tee "$out/e2e.log" ;;
  esac
  echo "[$part: $(( $(date +%s) - start )) s]"
done
