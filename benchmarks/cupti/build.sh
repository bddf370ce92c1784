#!/usr/bin/env bash
# Builds build/libktrace.so (and puts CUPTI's libcupti.so.13 beside it) for benchmarks/kernel_trace.py.
# Run here, where PyPI is reachable: NVIDIA's wheels bring CUPTI and the CUDA headers (CUDA 13.0, the
# H200 image's major version). Then carry benchmarks/cupti/build to the device (it is git-ignored).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
for wheel in nvidia-cuda-cupti==13.0.85 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$wheels" "$wheel"
done
for w in "$wheels"/*.whl; do python3 -m zipfile -e "$w" "$wheels/x"; done
cu="$wheels/x/nvidia/cu13"
mkdir -p "$here/build"
gcc -O2 -shared -fPIC -I "$cu/include" "$here/ktrace.c" -L "$cu/lib" -l:libcupti.so.13 -Wl,-rpath,'$ORIGIN' \
  -o "$here/build/libktrace.so"
cp "$cu/lib/libcupti.so.13" "$here/build/"
echo "built $here/build/libktrace.so"
