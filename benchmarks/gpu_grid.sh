#!/usr/bin/env bash
# Run sweep grids on one GPU (MLX CUDA) with several processes, resumably, until a deadline; pack the
# results into $OUT (the device tool brings them back). Used for the quality tables (many CPU hours
# on 2 cores, minutes on an H200: the embedded model is small, so N processes keep the GPU busy).
#
#   bash benchmarks/gpu_grid.sh SECONDS WORKERS GRID [GRID ...]
#
# Expects MLX CUDA on PYTHONPATH (../shared/gpu: `source /tmp/mlx-cuda-env.sh`) and the embedded model
# and essays unpacked under $KVCOMPRESS_CACHE/wheels (kvcompress.embedded's fallback location).
# The device image lacks `datasets` and `pydantic` (kvcompress.sweep's grid spec): carry their wheels
# (datasets, dill, multiprocess; pydantic, pydantic_core, annotated_types, typing_inspection) as the
# device tool's README says, installed into /tmp/site.
# Results accumulate in $KV_RESULTS (default /tmp/kv-results): a later call resumes where this one stopped.
set -u
seconds=$1; workers=$2; shift 2
results=${KV_RESULTS:-/tmp/kv-results}
logs=$results-logs  # worker logs travel in the same archive ($OUT takes at most 8 files)
end=$(( $(date +%s) + seconds ))
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p "$results" "$logs" "${OUT:-/tmp/out}"
# what the published tables cite beside the numbers (benchmarks/leaderboard.py reads it): the commit is
# passed in (KV_COMMIT), the device has no git history
python3 - "$results/manifest.json" "$workers" <<'PY'
import datetime, json, os, subprocess, sys
import mlx.core as mx
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout
json.dump({"commit": os.environ.get("KV_COMMIT", "unknown"), "date": datetime.date.today().isoformat(),
           "device": gpu.strip() or str(mx.default_device()), "mlx": mx.__version__, "workers": int(sys.argv[2])},
          open(sys.argv[1], "w"))
PY
for ((i = 0; i < workers; i++)); do
  (
    for grid in "$@"; do
      left=$(( end - $(date +%s) ))
      [ "$left" -gt 0 ] || break
      python3 benchmarks/run_grid.py "$grid" --interleave --results "$results" \
        --workers "$workers" --worker "$i" --deadline "$left"
    done
  ) >> "$logs/worker-$i.log" 2>&1 &
done
wait
tail -q -n 1 "$logs"/worker-*.log | tail -n 40
echo "runs files: $(find "$results/runs" -name '*.parquet' | wc -l)"
tar -C "$(dirname "$results")" -cJf - "$(basename "$results")" "$(basename "$logs")" | split -b 15m - "${OUT:-/tmp/out}/results.tar.xz."
