#!/usr/bin/env bash
# Fresh-machine setup: Debian's Fashion-MNIST (the offline default data), a venv, raysb.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist
  else
    echo "setup: Fashion-MNIST is not installed; run 'sudo apt-get install dataset-fashion-mnist'" \
         "or pass --data-dir/--download to raysb train" >&2
  fi
fi

python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# torch and torchvision first, pinned together: a lone 'torchvision' would pull a
# torch that does not match it. TorchCodec (Parquet images) is built against torch too.
.venv/bin/pip install -q --no-compile "torch==2.14.1" "torchvision==0.29.1" "torchcodec==0.17.0"
.venv/bin/pip install -q --no-compile -e ".[dev]"
# Bytecode for every installed module and raysb's own, compiled here once on every core (pip compiles
# on one). Left to Python, a module is compiled as a process imports it and cached only where Python may
# write its cache: with PYTHONDONTWRITEBYTECODE set (as on this project's machines) every process
# compiled torch and Ray again, each Ray worker spent 15.4 CPU-seconds on its imports instead of 5.7, a
# 2-worker fit took 90 s instead of 22, and a fresh clone's test suite ran 26 of its 33 minutes so
# (BENCHMARKS.md, "Bytecode compiled at set-up"). A file that does not compile (torch ships a Python 3.12
# test file) stays source.
.venv/bin/python -c "import compileall, sys; [compileall.compile_dir(d, quiet=2, workers=0) for d in sys.argv[1:]]" \
    .venv/lib raysb
.venv/bin/raysb --help >/dev/null && echo "setup: raysb installed in .venv"
