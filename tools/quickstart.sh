#!/usr/bin/env bash
# Sets up a virtual environment (CPU build of torch where there is no NVIDIA GPU) and then either runs
# the demo or installs the test and ray extras and runs the test suite.   usage: bash tools/quickstart.sh demo|test
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-demo}
venv=${LORAPIPE_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
pip() { "$py" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip torch
  elif pip --no-index --no-deps torch 2>/dev/null; then
    pip torch  # a local CPU wheel was found; this adds its dependencies from the index
  else
    # A bare `torch` from PyPI is the CUDA build with gigabytes of CUDA libraries: take PyTorch's CPU index.
    pip torch --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
  fi
fi

case "$what" in
  demo)
    pip -e .
    "$venv/bin/lorapipe" demo
    echo
    echo "lorapipe is installed in $venv, not on your PATH: run \`source $venv/bin/activate\` in each new shell."
    ;;
  test)
    pip -e ".[test,ray]"  # the ray extra: tests/integration/test_ray_serve.py runs a local Ray cluster
    "$venv/bin/ruff" check .
    "$venv/bin/ruff" format --check .
    set +e
    "$py" -m pytest -q "${@:2}"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
    exit "$rc"
    ;;
  *)
    echo "usage: bash tools/quickstart.sh demo|test [pytest args]" >&2
    exit 2
    ;;
esac
