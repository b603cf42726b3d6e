#!/usr/bin/env bash
# The GPU measurements raysb waits for, in one call of a lent GPU machine, most wanted first;
# each stage has its own time limit, so one that hangs cannot spend the lease. On that
# machine, from the checkout:
#
#   export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; bash scripts/gpu_session.sh FASHION_MNIST_DIR [STAGE...]
#
# FASHION_MNIST_DIR holds the four Fashion-MNIST IDX files (the machine has no data: carry
# them, e.g. .device/fmnist, 31 MB). STAGEs, most wanted first (issue 68's order): captured-table (issue 57's table,
# about 8.5 minutes, the default), keep-rule (issue 57 item 3, about 4), scoring-table (issue 68 items 1-3,
# about 8), ray-gpu (issue 57 item 5, about 5), long-budgets (issue 45's table: about 7 minutes a
# seed), label-noise (issue 67's: about 8 minutes a seed), then capture-check (issue 57's first look), budgets, selection, scoring, compile, step, syncs, table,
# bisect: one call each. Every stage but ray-gpu runs without Ray. ray-gpu needs
# Ray and trains on synthetic images: carry .device/site.tgz and .device/env.sh (made by
# ../shared/tools/device-bundle.sh) instead of the IDX files, whose 31 MB beside the bundle's
# 44 MB pass the 64 MiB a call may carry, start with `source .device/env.sh` and pass - as
# FASHION_MNIST_DIR. Logs and reports go to $OUT (the device tool's folder) or runs/gpu-session.
set -u
data=${1:?usage: gpu_session.sh FASHION_MNIST_DIR|- [captured-table keep-rule scoring-table ray-gpu capture-check long-budgets label-noise budgets selection scoring compile step syncs table bisect]}
shift
stages=${*:-captured-table}
out=${OUT:-runs/gpu-session}
work=/tmp/raysb-gpu-session
images=$work/fashion-mnist-32
mkdir -p "$out" "$work"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,memory.used --format=csv

fashion_mnist_32() {  # the CIFAR-shaped Fashion-MNIST every stage but ray-gpu trains on
  [ -f "$images/test.parquet" ] && return
  [ "$data" != - ] || { echo "this stage needs FASHION_MNIST_DIR"; exit 2; }
  python3 -c "
from pathlib import Path
from raysb.bench.gpu import cifar_shaped_fashion_mnist
cifar_shaped_fashion_mnist('$data', Path('$images'))" || exit 1
}

# The budget tables' recipe: ResNet-18 at b512 on the CIFAR-shaped set, evaluated once, at the end.
budget_recipe=(--set model=resnet18 --set batch_size=512 --set dataset=parquet --set data_dir="$images"
               --set crop_padding=4 --set horizontal_flip=true --set selectivity=0.33 --set record_analysis=false
               --set eval_every=1000 --set checkpoint_every=1000 --set progress_seconds=0)

# The GPU bench's recipe, for the runs made outside it.
recipe=(--dataset parquet --model resnet18 --lr 0.05 --lr-warmup-epochs 1
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

budget_table() {  # name, then settings for every run: ResNet-18 time budgets of 0.5, 1, 2 and 4 x a 5-epoch
  # Traditional reference (about 75 s of training a row and seed on an H100) for STRATEGIES and VARIANTS
  # (LABEL:strategy=...,KEY=VALUE each), one seed a call (SEEDS="0 1" on the same warm machine reuses seed 0)
  local name=$1
  shift
  fashion_mnist_32
  local variants=()
  for variant in $VARIANTS; do
    variants+=(--variant "$variant")
  done
  local table=(python3 -m raysb.bench --budgets 0.5 1 2 4 --epochs 5 --budget-unit time --seeds ${SEEDS:-0}
               --strategies ${STRATEGIES:-traditional uniform free-sb infobatch} "${variants[@]}" "${budget_recipe[@]}"
               "$@" --out "$work/$name")
  rm -f "$work/$name/report.md"  # an earlier call's, on a machine still warm
  run_stage "$name" "${BUDGETS_SECONDS:-500}" "${table[@]}"
  # A lease that ends mid-table still reports what finished, and brings every finished run home
  # in one archive (the device tool leaves out folders as deep as a run's).
  if [ ! -f "$work/$name/report.md" ]; then
    "${table[@]}" --from-runs 2>&1 | tail -3
    cp "$work/$name/report.md" "$out/$name-report.md" 2>/dev/null  # --from-runs writes it
  else
    cp "$work/$name/report.md" "$out/$name-report.md"
    cp "$work/$name/budget_runs.csv" "$out/$name-runs.csv"
  fi
  (cd "$work" && find "$name" \( -name "*.json" -o -name "*.yaml" -o -name "*.parquet" \) -print0 \
    | tar czf "$out/$name-runs.tgz" --null -T -)
}

for stage in $stages; do
  case $stage in
    bisect)  # SB's spike at its lr peak, b512 (BENCHMARKS.md, "raysb on one H100")
      fashion_mnist_32
      variants=(selection_batch_size=512 selection_batch_size=512,staleness_correction=always
                selection_batch_size=1024 selection_batch_size=1024,staleness_correction=never)
      run_stage bisect 200 python3 -m raysb.bench --config-variants "${variants[@]}" --epochs 10 \
        --set model=resnet18 --set dataset=parquet --set data_dir="$images" --set batch_size=512 \
        --set strategy=sb --set crop_padding=4 --set horizontal_flip=true --out "$work/bisect"
      grep "^|" "$out/bisect.log"
      errors_by_epoch "$work"/bisect/selection_batch_size-*
      ;;
    compile)  # does compile_training pay at b128, where the step is launch-bound?
      fashion_mnist_32
      for compiled in false true; do
        run_stage "compile-$compiled" 150 python3 -m raysb train "${recipe[@]}" --data-dir "$images" --strategy traditional \
          --batch-size 128 --epochs 4 --set compile_training=$compiled --out "$work/compile-$compiled" --overwrite
      done
      python3 -c "import json; print('graphs dynamo compiled:', json.load(open('$work/compile-true/summary.json')).get('compiled_graphs'))"
      ;;
    step)  # issue 46 item 2: ResNet-18's training step against the device's ceiling, eager and compiled
      # (no data: random CIFAR-shaped inputs); each row prints as it finishes, max-autotune's compile last
      run_stage step 420 python3 -m raysb.bench.step_speed --model resnet18 --batch-sizes 512 128 \
        --modes eager default reduce-overhead max-autotune --out "$work/step"
      cp "$work/step/report.md" "$out/step-report.md" 2>/dev/null
      ;;
    syncs)  # issue 46 item 3: an epoch of each strategy under CUDA's sync debug mode against raysb's counter
      run_stage syncs 180 python3 -m raysb.bench.sync_count --out "$work/syncs"
      cp "$work/syncs/report.md" "$out/syncs-report.md" 2>/dev/null
      ;;
    long-budgets)  # issue 45: does selection lose to Traditional anywhere up to convergence? Traditional,
      # uniform, free-sb, InfoBatch, and VARIANTS (default the keep rule that fades, free-sb with a rising
      # kept fraction having run on 2 seeds, BENCHMARKS.md). About 7 minutes a seed. STRATEGIES picks the
      # plain rows, e.g. the augmentation check BENCHMARKS.md names next:
      # STRATEGIES="traditional free-sb" VARIANTS="traditional-plain:strategy=traditional,crop_padding=0,horizontal_flip=false
      # free-sb-plain:strategy=free-sb,crop_padding=0,horizontal_flip=false".
      VARIANTS=${VARIANTS:-free-sb-fading:strategy=free-sb,selection_strength_schedule=lr} budget_table long-budgets
      ;;
    label-noise)  # issue 67: the keep rule that doubts wrong labels on a GPU: ResNet-18, crop and flip, 20%
      # of labels flipped; Traditional, uniform, InfoBatch and free-sb doubting its labels with the auto
      # rule (the recommended configuration: tiered where the labels look noisy, off where they look
      # clean), 2 seeds, one a call (about 7 minutes).
      STRATEGIES=${STRATEGIES:-traditional uniform infobatch} \
        VARIANTS=${VARIANTS:-free-sb-auto:strategy=free-sb,label_doubt=auto} budget_table label-noise \
        --set label_noise=0.2
      ;;
    budgets)  # issue 39's table on ResNet-18: every strategy at 0.5, 1 and 2 x a 3-epoch Traditional run;
      # SEEDS (default 0 1 2) picks seeds, and runs already in the folder are reused, so a second
      # call on the same warm machine can add a seed. About 150 s a seed on an H100.
      fashion_mnist_32
      run_stage budgets "${BUDGETS_SECONDS:-560}" python3 -m raysb.bench --budgets 0.5 1 2 --epochs 3 --seeds ${SEEDS:-0 1 2} \
        --budget-unit time \
        --strategies traditional uniform sb stale-sb free-sb infobatch \
        --variant "sb-cheap:strategy=sb,selection_scale=0.5,selection_batchnorm=running-after-warmup" \
        "${budget_recipe[@]}" --out "$work/budgets"
      cp "$work/budgets/report.md" "$out/budgets-report.md" 2>/dev/null
      cp "$work/budgets/budget_runs.csv" "$out/budgets-runs.csv" 2>/dev/null
      cp "$work/budgets/pareto.png" "$out/budgets-pareto.png" 2>/dev/null
      ;;
    selection)  # issue 39 item 3: cheaper selection forwards on ResNet-18 at b512, against the configured one
      fashion_mnist_32
      run_stage selection 300 python3 -m raysb.bench --selection-variants running-bn scale-0.75 scale-0.5 \
        running-bn+scale-0.5 compile-graphs running-bn+compile-graphs --epochs 1 --set model=resnet18 \
        --set batch_size=512 --set dataset=parquet --set data_dir="$images" --set crop_padding=4 \
        --set horizontal_flip=true --set record_analysis=false --out "$work/selection"
      cp "$work/selection/report.md" "$out/selection-report.md" 2>/dev/null
      ;;
    scoring)  # which part of sb-cheap lost (issue 39 item 3): downsampled inputs, or eval-mode BatchNorm after
      # warmup, or neither when compiled with CUDA graphs; the budgets stage's recipe, about 400 s
      fashion_mnist_32
      run_stage scoring 480 python3 -m raysb.bench --budgets 0.5 1 2 --epochs 3 --seeds 0 1 2 --budget-unit time \
        --strategies traditional uniform sb \
        --variant "sb-scale0.5:strategy=sb,selection_scale=0.5" \
        --variant "sb-running-bn:strategy=sb,selection_batchnorm=running-after-warmup" \
        --variant "sb-graphs:strategy=sb,compile_selection=true,selection_compile_mode=reduce-overhead" \
        "${budget_recipe[@]}" --out "$work/scoring"
      cp "$work/scoring/report.md" "$out/scoring-report.md" 2>/dev/null
      ;;
    table)  # issue 46's table: ResNet-18, every strategy eager at b512 and b128 (epochs decided as they
            # start), Traditional and free-sb compiled (each run compiles afresh, ~1 min), and Traditional,
            # uniform and free-sb chunk by chunk (plan_epochs=false); about 9 minutes in all
      [ "$data" != - ] || { echo "table needs FASHION_MNIST_DIR"; exit 2; }
      table=(python3 -m raysb.bench.gpu --dataset fashion-mnist --data-dir "$data" --models resnet18)
      run_stage table 150 "${table[@]}" --batch-sizes 512 --epochs 6 --out "$work/table"
      run_stage table-compiled 150 "${table[@]}" --batch-sizes 512 --epochs 6 --strategies traditional free-sb \
        --set compile_training=true --out "$work/table-compiled"
      run_stage table-chunked 70 "${table[@]}" --batch-sizes 512 --epochs 6 --strategies traditional uniform free-sb \
        --set plan_epochs=false --out "$work/table-chunked"
      run_stage table-b128 70 "${table[@]}" --batch-sizes 128 --epochs 3 --out "$work/table-b128"
      run_stage table-b128-compiled 90 "${table[@]}" --batch-sizes 128 --epochs 3 --strategies traditional free-sb \
        --set compile_training=true --out "$work/table-b128-compiled"
      for part in table table-compiled table-chunked table-b128 table-b128-compiled; do
        cp "$work/$part/report.md" "$out/$part-report.md" 2>/dev/null
        grep "^|" "$out/$part.log"
      done
      ;;
    capture-check)  # issue 57, first look: the CUDA cases of tests/test_cuda_graphs.py; ResNet-18's step eager, as
      # raysb's captured step (graph) and with inductor's kernels inside it (default+graph), at b512 and b128, and
      # the selection forward eager and captured; raysb Traditional, SB and free-sb at b128 for 2 epochs, captured
      # and eager, beside both plain loops. About 5 minutes.
      run_stage capture-tests 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_graphs.py
      run_stage capture-step 200 python3 -m raysb.bench.step_speed --model resnet18 --batch-sizes 512 128 \
        --modes eager graph default+graph --scoring 512 1024 --steps 20 --out "$work/capture-step"
      cp "$work/capture-step/report.md" "$out/capture-step-report.md" 2>/dev/null
      [ "$data" != - ] || { echo "capture-check's table needs FASHION_MNIST_DIR"; exit 2; }
      run_stage capture-b128 160 python3 -m raysb.bench.gpu --dataset fashion-mnist --data-dir "$data" \
        --models resnet18 --batch-sizes 128 --epochs 2 --strategies traditional sb free-sb --eager-too \
        --out "$work/capture-b128"
      cp "$work/capture-b128/report.md" "$out/capture-b128-report.md" 2>/dev/null
      grep "^|" "$out/capture-step.log" "$out/capture-b128.log"
      ;;
    captured-table)  # issue 57 item 6: every ratio against both plain loops, same call. Each strategy at b512 (4
      # epochs) and b128 (3), raysb's default on CUDA (captured, compiled) and eager; the step's modes and the
      # selection forward's; free-sb and free-sb uncompiled at time budgets of 0.5x-2x the captured plain loop's
      # 5 epochs, against it at 1x and 2x (crop and flip, one seed). About 8.5 minutes.
      [ "$data" != - ] || { echo "captured-table needs FASHION_MNIST_DIR"; exit 2; }
      run_stage captured-tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py
      run_stage captured-step 100 python3 -m raysb.bench.step_speed --model resnet18 --batch-sizes 512 128 \
        --modes eager graph default+graph reduce-overhead --steps 20 --out "$work/captured-step"
      cp "$work/captured-step/report.md" "$out/captured-step-report.md" 2>/dev/null
      table=(python3 -m raysb.bench.gpu --dataset fashion-mnist --data-dir "$data" --models resnet18 --eager-too)
      run_stage captured-b512 170 "${table[@]}" --batch-sizes 512 --epochs 4 \
        --strategies traditional uniform sb sb-random free-sb infobatch --out "$work/captured-b512"
      run_stage captured-b128 110 "${table[@]}" --batch-sizes 128 --epochs 3 \
        --strategies traditional uniform sb free-sb --out "$work/captured-b128"
      run_stage captured-budgets 100 python3 -m raysb.bench.gpu --dataset fashion-mnist --data-dir "$data" \
        --models resnet18 --batch-sizes 512 --epochs 5 --strategies traditional --budgets 0.5 1 2 \
        --budget-runs free-sb "free-sb uncompiled" --out "$work/captured-budgets"
      for part in captured-b512 captured-b128 captured-budgets; do
        cp "$work/$part/report.md" "$out/$part-report.md" 2>/dev/null
      done
      grep -h "^|" "$out"/captured-*.log
      ;;
    scoring-table)  # issue 68 items 1-2: the selection forward eager, captured, and compiled inside its graph (the
      # CUDA default), an example over the compiled, captured step's at b512 and b128 (target at 512: at most 0.40);
      # then SB, its round one graph, with the fixed count (the CUDA default) and the paper's per-example draw
      # (item 3: its count learned two rounds late), against Traditional at b512 and b128 (targets: SB's epoch
      # at most 0.75 of Traditional's at s = 1/3; bookkeeping at most 2% of an epoch). About 8 minutes.
      [ "$data" != - ] || { echo "scoring-table needs FASHION_MNIST_DIR"; exit 2; }
      run_stage round-graph-tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_round_graph.py -k cuda
      run_stage scoring-step 150 python3 -m raysb.bench.step_speed --model resnet18 --batch-sizes 512 128 \
        --modes default+graph --scoring 512 128 --steps 20 --out "$work/scoring-step"
      table=(python3 -m raysb.bench.gpu --dataset fashion-mnist --data-dir "$data" --models resnet18)
      run_stage scoring-b512 140 "${table[@]}" --batch-sizes 512 --epochs 3 --strategies traditional sb sb-random \
        --out "$work/scoring-b512"
      run_stage scoring-b128 125 "${table[@]}" --batch-sizes 128 --epochs 3 --strategies traditional sb sb-random \
        --out "$work/scoring-b128"
      for part in scoring-step scoring-b512 scoring-b128; do
        cp "$work/$part/report.md" "$out/$part-report.md" 2>/dev/null
      done
      grep -h "^|" "$out"/scoring-*.log
      ;;
    keep-rule)  # issue 57 item 3, issue 68 item 3: does SB's fixed kept count a chunk (the GPU default) change its
      # final error against the paper's per-example draw (kept_per_chunk=random, its round one graph too, its count
      # learned two rounds late)? Its errors and seconds decide the GPU default.
      # The budget tables' recipe at 1x and 2x a 5-epoch Traditional, seeds 0 and 1. About 4 minutes. First the
      # fixed count's decision, and SB's whole round, as CUDA graphs against the eager rule and round
      # (the CUDA cases of tests/test_keep_rule_graph.py and tests/test_round_graph.py).
      run_stage keep-rule-graph 60 python3 -m pytest -q -p no:cacheprovider tests/test_keep_rule_graph.py \
        tests/test_round_graph.py -k cuda
      fashion_mnist_32
      run_stage keep-rule 280 python3 -m raysb.bench --budgets 1 2 --epochs 5 --budget-unit time --seeds 0 1 \
        --strategies traditional sb --variant "sb-random:strategy=sb,kept_per_chunk=random" \
        "${budget_recipe[@]}" --out "$work/keep-rule"
      cp "$work/keep-rule/report.md" "$out/keep-rule-report.md" 2>/dev/null
      ;;
    ray-gpu)  # issue 57 item 5: the captured step in one Ray Train GPU worker against one process, the Ray
      # layer's cost (synthetic images: carry .device/site.tgz and .device/env.sh, source env.sh, pass -), and a
      # raysb tune sweep over beta and n, 4 trials at 0.25 GPU each on the one GPU, its Pareto report. About 5 min.
      python3 -c "import ray" 2>/dev/null || { echo "ray-gpu needs Ray: source .device/env.sh"; exit 2; }
      synthetic=$work/synthetic-32
      python3 -c "
from pathlib import Path
from raysb.bench.gpu import synthetic_cifar
from raysb.data import write_parquet
folder = Path('$synthetic'); folder.mkdir(parents=True, exist_ok=True)
for split, data in zip(('train', 'test'), synthetic_cifar(50000, 10000, 32, 0)):
    write_parquet(data, folder / f'{split}.parquet', encoding='raw')" || exit 1
      for workers in none 1; do
        extra=()
        [ "$workers" = 1 ] && extra=(--workers 1 --gpus-per-worker 1 --cpus-per-worker 4)
        run_stage "ray-workers-$workers" 90 python3 -m raysb train "${recipe[@]}" --data-dir "$synthetic" \
          --strategy sb --batch-size 512 --epochs 3 --out "$work/ray-workers-$workers" --overwrite "${extra[@]}"
        python3 -c "import json; s = json.load(open('$work/ray-workers-$workers/summary.json'));
print('$workers worker(s):', {k: s.get(k) for k in ('captured_training', 'compiled_training', 'training_capture_s',
      'training_wall_s', 'final_test_error')})"
      done
      cat > "$work/sweep.yaml" <<SWEEP
name: gpu-fractional
train: {dataset: parquet, data_dir: $synthetic, model: resnet18, batch_size: 512, epochs: 3, crop_padding: 4,
        horizontal_flip: true, lr: 0.05, record_analysis: false, progress_seconds: 0}
variants:
  - strategy: stale-sb
    selectivity: [0.5, 0.25]
    staleness: [1, 3]
budget_s: 60
resources: {workers: null, cpus_per_worker: 3, gpus_per_worker: 0.25}
max_concurrent_trials: 4
SWEEP
      run_stage ray-tune 200 python3 -m raysb tune "$work/sweep.yaml" --out "$work/sweep"
      cp "$work/sweep/speedups.md" "$out/ray-tune-speedups.md" 2>/dev/null
      cp "$work/sweep/pareto.csv" "$out/ray-tune-pareto.csv" 2>/dev/null
      cp "$work/sweep/sweep_summary.json" "$out/ray-tune-summary.json" 2>/dev/null
      ;;
    *) echo "unknown stage $stage (captured-table, keep-rule, scoring-table, ray-gpu, capture-check, long-budgets, budgets, selection, scoring, compile, step, syncs, table, bisect)"; exit 2 ;;
  esac
done
