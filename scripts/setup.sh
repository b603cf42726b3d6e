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
# No bytecode compiled at install: of the ~19,000 modules torch, Ray and the rest bring, a run imports a
# fraction, and Python compiles those as it first imports them (compiling all of them, as pip does by
# default, took 89 CPU-seconds on a 2-core machine).
# torch and torchvision first, pinned together: a lone 'torchvision' would pull a
# torch that does not match it. TorchCodec (Parquet images) is built against torch too.
.venv/bin/pip install -q --no-compile "torch==2.14.1" "torchvision==0.29.1" "torchcodec==0.17.0"
.venv/bin/pip install -q --no-compile -e ".[dev]"
.venv/bin/raysb --help >/dev/null && echo "setup: raysb installed in .venv"
