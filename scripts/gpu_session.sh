#!/usr/bin/env bash
# Every GPU measurement raysb still waits for, in one call of a lent GPU machine (about 9
# minutes on an H100), most wanted first; each stage has its own time limit, so one that
# hangs cannot spend the lease. On that machine, from the checkout:
#
#   source .device/env.sh && bash scripts/gpu_session.sh FASHION_MNIST_DIR [STAGE...]
#
# FASHION_MNIST_DIR holds the four Fashion-MNIST IDX files (carry them, e.g. in .device/fmnist:
# the machine has no data). STAGEs: bisect compile one-worker table (default: all four).
# Logs and reports go to $OUT (the device tool's folder) or runs/gpu-session.
set -u
data=${1:?usage: gpu_session.sh FASHION_MNIST_DIR [bisect compile one-worker table]}
shift
stages=${*:-bisect compile one-worker table}
out=${OUT:-runs/gpu-session}
work=/tmp/raysb-gpu-session
images=$work/fashion-mnist-32
mkdir -p "$out" "$work"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,memory.used --format=csv
python3 -c "
from pathlib import Path
from raysb.bench.gpu import cifar_shaped_fashion_mnist
cifar_shaped_fashion_mnist('$data', Path('$images'))" || exit 1
# The GPU bench's recipe, for the runs made outside it.
recipe=(--dataset parquet --data-dir "$images" --model resnet18 --lr 0.05 --lr-warmup-epochs 1
        --set crop_padding=4 --set horizontal_flip=true --progress-seconds 0)

run_stage() {  # name, seconds, command...: its output to $out/name.log and, tables aside, here
  local name=$1 seconds=$2
  shift 2
  echo "== $name"
  timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log" | grep -v "^|"
}

errors_by_epoch() {  # run folders: each one's test error after every epoch
  python3 -c "
import sys, pyarrow.parquet as pq
for folder in sys.argv[1:]:
    rows = pq.read_table(folder + '/metrics.parquet').to_pylist()
    print(folder.rsplit('/', 1)[-1], ' '.join(f'{r[\"test_error\"]:.3f}' for r in rows))" "$@"
}

for stage in $stages; do
  case $stage in
    bisect)  # SB's spike at its lr peak, b512 (BENCHMARKS.md, "raysb on one H100")
      variants=(selection_batch_size=512 selection_batch_size=512,staleness_correction=always
                selection_batch_size=1024 selection_batch_size=1024,staleness_correction=never)
      run_stage bisect 200 python3 -m raysb.bench --config-variants "${variants[@]}" --epochs 10 \
        --set model=resnet18 --set dataset=parquet --set data_dir="$images" --set batch_size=512 \
        --set strategy=sb --set crop_padding=4 --set horizontal_flip=true --out "$work/bisect"
      grep "^|" "$out/bisect.log"
      errors_by_epoch "$work"/bisect/selection_batch_size-*
      ;;
    compile)  # does compile_training pay at b128, where the step is launch-bound?
      for compiled in false true; do
        run_stage "compile-$compiled" 150 python3 -m raysb train "${recipe[@]}" --strategy traditional \
          --batch-size 128 --epochs 4 --set compile_training=$compiled --out "$work/compile-$compiled" --overwrite
      done
      python3 -c "import json; print('graphs dynamo compiled:', json.load(open('$work/compile-true/summary.json')).get('compiled_graphs'))"
      ;;
    one-worker)  # 1 Ray Train GPU worker against one process: the Ray layer's cost
      for workers in none 1; do
        extra=()
        [ "$workers" = 1 ] && extra=(--workers 1 --gpus-per-worker 1 --cpus-per-worker 4)
        run_stage "workers-$workers" 100 python3 -m raysb train "${recipe[@]}" --strategy sb --batch-size 512 \
          --epochs 4 --out "$work/workers-$workers" --overwrite "${extra[@]}"
      done
      ;;
    table)  # the table: ResNet18 at b512 and b128 against the plain loop
      run_stage table 330 python3 -m raysb.bench.gpu --dataset fashion-mnist --data-dir "$data" \
        --models resnet18 --batch-sizes 512 128 --epochs 10 --out "$work/table"
      cp "$work/table/report.md" "$out/table-report.md" 2>/dev/null
      grep "^|" "$out/table.log"
      ;;
    *) echo "unknown stage $stage (bisect, compile, one-worker, table)"; exit 2 ;;
  esac
done
