"""`raysb tune` end to end on CPU: a tiny sweep through Ray Tune, its files, a failing trial,
a collapsed trial, resume."""

import json

import pyarrow.parquet as pq
import pytest

from raysb.cli import main
from raysb.distributed.cluster import ClusterError
from raysb.tune.sweep import load_sweep
from raysb.tune.tuner import run_sweep

from conftest import needs_fashion_mnist

pytestmark = needs_fashion_mnist

SWEEP = """\
name: tiny
train:
  dataset: fashion-mnist
  subset: 1000
  test_subset: 500
  model_options: {width: 8}
  epochs: 3
  batch_size: 32
variants:
  - strategy: traditional
  - strategy: sb
    selectivity: [0.5, 0.33]
  - strategy: stale-sb
    subset: 10          # fewer examples than a batch: this trial fails at run time
  - strategy: kath18
    lr: 3               # without warmup this kills the model: the collapse guard stops it
    lr_warmup_epochs: 0
    collapse_patience: 2
budget_s: 30
resources: {workers: null, cpus_per_worker: 1}
max_concurrent_trials: 2
"""
DIVERGED = "kath18_collapse_patience=2_lr=3_lr_warmup_epochs=0"


@pytest.mark.slow  # a whole Tune sweep (60-240 s): the quick tier stays under 5 minutes without it
def test_tiny_sweep_end_to_end_with_a_failing_trial_and_resume(ray_session, tmp_path, capsys):
    sweep_file = tmp_path / "tiny.yaml"
    sweep_file.write_text(SWEEP)
    out = tmp_path / "sweep"
    assert main(["tune", str(sweep_file), "--out", str(out)]) == 0
    for name in ("trials.parquet", "pareto.csv", "pareto.png", "speedups.csv", "speedups.md", "curves.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name

    statuses = json.loads((out / "sweep_summary.json").read_text())["trials"]
    assert {n: s["status"] for n, s in statuses.items()} == {
        "traditional": "completed",
        "sb_selectivity=0.5": "completed",
        "sb_selectivity=0.33": "completed",
        "stale-sb_subset=10": "failed",
        DIVERGED: "diverged",
    }
    assert "batch_size 32 is larger than the 10 training examples" in statuses["stale-sb_subset=10"]["error"]

    rows = pq.read_table(out / "trials.parquet").to_pylist()
    by_trial = {}
    for row in rows:
        by_trial.setdefault(row["trial_id"], []).append(row)
    assert sorted(by_trial) == [DIVERGED, "sb_selectivity=0.33", "sb_selectivity=0.5", "traditional"]
    # The guard stopped the dead trial at its second evaluation at chance, not after its budget.
    assert [(r["epoch"], r["trial_status"]) for r in by_trial.pop(DIVERGED)] == [(1, "diverged"), (2, "diverged")]
    for trial, trial_rows in by_trial.items():
        assert [r["epoch"] for r in trial_rows] == [1, 2, 3], trial
        assert all(r["trial_status"] == "completed" and r["time_budget"] == 30 for r in trial_rows)
    assert {r["selectivity"] for r in by_trial["sb_selectivity=0.5"]} == {0.5}
    assert by_trial["traditional"][-1]["kept_fraction"] == 1.0
    assert "| traditional |" in (out / "speedups.md").read_text()
    printed = capsys.readouterr().out
    assert "failed" in printed and f"trial {DIVERGED} diverged: the model collapsed" in printed
    # Ray's output stays hidden, as README says: Tune once printed its table, folder and TensorBoard command.
    assert "TensorBoard" not in printed and "View detailed results" not in printed
    # Every trial's lines come before the sweep's closing ones, as raysb prints them: no colour codes.
    lines = printed.splitlines()
    closing = next(i for i, line in enumerate(lines) if "epoch rows from" in line)
    assert any(line.startswith("[traditional] epoch   3/3") for line in lines[:closing])
    assert not any(line.startswith("[") for line in lines[closing:]) and "\x1b[" not in printed

    # Running the same command again resumes the finished sweep: nothing reruns or doubles.
    trained_at = (out / "trials" / "traditional" / "metrics.parquet").stat().st_mtime_ns
    assert main(["tune", str(sweep_file), "--out", str(out)]) == 0
    assert (out / "trials" / "traditional" / "metrics.parquet").stat().st_mtime_ns == trained_at
    assert pq.read_table(out / "trials.parquet").num_rows == len(rows)


def test_a_trial_that_can_never_be_scheduled_is_refused(ray_session, tmp_path):
    sweep_file = tmp_path / "big.yaml"
    sweep_file.write_text(SWEEP.replace("{workers: null, cpus_per_worker: 1}", "{workers: 8, cpus_per_worker: 1}"))
    with pytest.raises(ClusterError, match=r"one trial needs 8.01 CPU .* no trial could ever start"):
        run_sweep(load_sweep(sweep_file), tmp_path / "out")
    assert main(["tune", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "o")]) == 2
