#!/usr/bin/env bash
# The runs behind `raysb report`'s figures, then the report itself:
#   Traditional and SB (s = 0.33) at 0, 1%, 10% and 20% flipped labels (Figure 12),
#   SB at selectivities 0.5, 0.25 and 0.2 (Figure 13), and Stale-SB (n = 3).
# Usage: scripts/paper_report.sh OUT_DIR [extra raysb train flags, e.g. --subset 20000 --epochs 8]
set -euo pipefail
out=${1:?usage: scripts/paper_report.sh OUT_DIR [raysb train flags]}
shift
raysb=${RAYSB:-raysb}
# --record-analysis: the trace files and final model the figures are drawn from (off by default).
common=(--dataset fashion-mnist --seed 0 --record-analysis "$@")

run() {
  local name=$1
  shift
  if [ -f "$out/runs/$name/summary.json" ]; then
    echo "paper_report: $name already done"
    return
  fi
  rm -rf "$out/runs/$name"
  "$raysb" train "${common[@]}" "$@" --out "$out/runs/$name"
}

for noise in 0 0.01 0.1 0.2; do
  run "traditional-noise$noise" --strategy traditional --label-noise "$noise"
  run "sb-noise$noise" --strategy sb --selectivity 0.33 --label-noise "$noise"
done
for selectivity in 0.5 0.25 0.2; do
  run "sb-s$selectivity" --strategy sb --selectivity "$selectivity"
done
run stale-sb --strategy stale-sb --selectivity 0.33 --staleness 3
"$raysb" report "$out"/runs/* --out "$out/report"
