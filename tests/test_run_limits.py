"""A budget is what it says (issue 59): under a time or work budget the run ends at the budget, its
lr schedule decayed to 0 there; epochs given beside a budget end the run where they come first,
with the schedule keyed to whichever ends first; the summary's status says which limit ended it."""

import json

import pyarrow.parquet as pq
import pytest

from raysb.api import train
from raysb.cli import main
from raysb.config import ConfigError, TrainConfig
from raysb.core.schedules import learning_rate, schedule_progress

from conftest import needs_fashion_mnist
from run_rows import untimed
from test_budget_baselines import StepClock, killed_after_epoch_2

SMALL = ["--subset", "1000", "--test-subset", "200", "--set", "model_options.width=8", "--progress-seconds", "0"]


def budget_config(tmp_path, name="run", **overrides) -> TrainConfig:
    """1,000 Fashion-MNIST examples, and no epochs given: a budget alone ends the run."""
    values = dict(dataset="fashion-mnist", subset=1000, test_subset=200, batch_size=50, seed=3,
                  model_options={"width": 8}, progress_seconds=0, collapse_patience=0, out=str(tmp_path / name))
    return TrainConfig.from_dict({**values, **overrides})


def test_a_budget_alone_sets_no_epochs_and_a_run_without_one_trains_ten():
    assert TrainConfig().epochs == 10
    assert TrainConfig(work_budget=5).epochs is None and TrainConfig(time_budget=60).epochs is None
    assert TrainConfig(work_budget=5, epochs=3).epochs == 3
    # What counts in the run's epochs needs them given.
    with pytest.raises(ConfigError, match="lr_schedule_key epoch decays the lr over the run's epochs, and a budget "
                                          "without epochs ends the run with none fixed: give epochs"):
        TrainConfig(work_budget=5, lr_schedule_key="epoch")
    with pytest.raises(ConfigError, match="anneal_epochs counts back from the run's last epoch"):
        TrainConfig(time_budget=60, anneal_epochs=1)
    assert TrainConfig(work_budget=5, epochs=4, anneal_epochs=1).anneal_epochs == 1


@pytest.mark.parametrize("key", ["time", "work"])
def test_beside_epochs_a_budget_keyed_schedule_follows_whichever_share_is_larger(key):
    def lr(spent: float, epochs_done: float) -> float:
        clock = {"time": dict(training_seconds=spent, time_budget=10.0),
                 "work": dict(work_done=spent, work_budget=10.0)}
        progress = schedule_progress(key, epochs_done, 0, 1, total_epochs=4, epochs_end_run=True, **clock[key])
        return learning_rate("cosine", 0.1, progress, 4)

    assert lr(5, 1) == pytest.approx(0.05)  # half the budget, a quarter of the epochs: half way
    assert lr(2.5, 2) == pytest.approx(0.05)  # a quarter of the budget, half the epochs: half way
    assert lr(10, 1) == 0.0 and lr(1, 4) == 0.0  # at whichever ends first, the schedule's end


@needs_fashion_mnist
@pytest.mark.parametrize("strategy", ["free-sb", "uniform", "traditional"])
def test_free_sb_uniform_and_traditional_train_the_work_budgets_examples_and_end_at_lr_zero(tmp_path, strategy):
    result = train(budget_config(tmp_path, strategy=strategy, work_budget=5.0), log=lambda _: None)
    summary, rows = result.summary, result.metrics
    assert summary["status"] == "work_budget_reached" and summary["config"]["epochs"] is None
    # None scores: its work is its trained examples, the budget's 5,000, stopped within a step of them.
    assert 5000 <= summary["backprop_examples"] <= 5000 + 50
    assert rows[-1]["lr"] == 0.0 and rows[-2]["lr"] > 0
    assert all(row["epoch_steps"] > 0 for row in rows)  # no epoch past the budget with no step in it
    if strategy != "traditional":
        # A third of the data an epoch: more epochs than the 10 a run without a budget trains.
        assert summary["epochs_completed"] > 10


@needs_fashion_mnist
def test_epochs_given_beside_a_work_budget_end_the_run_first_say_so_and_end_the_schedule(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--strategy", "free-sb", "--work-budget", "15", "--epochs", "3", *SMALL,
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2].startswith("raysb: epochs=3 ended the run before its work budget of 15 epochs (")
    assert printed[-2].endswith(" done); the lr schedule ended with them")
    assert printed[-1].startswith("raysb: epochs reached after 3 epoch(s)")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "epochs_reached" and summary["work_epochs"] < 15
    rows = pq.read_table(out / "metrics.parquet").to_pylist()
    assert rows[-1]["lr"] == 0.0 and rows[-2]["lr"] > 0


@needs_fashion_mnist
def test_a_time_budget_ends_the_run_at_it_and_epochs_given_beside_it_where_they_come_first(tmp_path, monkeypatch):
    StepClock(monkeypatch)  # 10 ms of training a step: the budget of 0.995 s is spent by the 100th
    by_budget = train(budget_config(tmp_path, "budget", strategy="uniform", time_budget=0.995), log=lambda _: None)
    summary = by_budget.summary
    assert summary["status"] == "time_budget_reached" and summary["optimizer_steps"] == 100
    assert summary["epochs_completed"] > 10 and by_budget.metrics[-1]["lr"] == 0.0

    by_epochs = train(budget_config(tmp_path, "epochs", strategy="uniform", time_budget=0.995, epochs=4),
                      log=lambda _: None)
    assert by_epochs.summary["status"] == "epochs_reached" and by_epochs.summary["optimizer_steps"] < 100
    assert by_epochs.metrics[-1]["lr"] == 0.0 and by_epochs.metrics[-2]["lr"] > 0


@needs_fashion_mnist
def test_a_budget_run_resumed_from_the_command_line_continues_to_the_same_budget(tmp_path, monkeypatch, capsys):
    run = dict(strategy="free-sb", work_budget=5.0)
    whole = train(budget_config(tmp_path, "whole", **run), log=lambda _: None)
    killed_after_epoch_2(budget_config(tmp_path, "killed", **run), monkeypatch)
    # As its config.yaml says: no epochs, the same budget.
    out = tmp_path / "killed"
    assert main(["train", "--out", str(out), "--resume"]) == 0
    assert untimed(pq.read_table(out / "metrics.parquet").to_pylist()) == untimed(whole.metrics)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "work_budget_reached" and summary["epochs_completed"] > 10
    parts = ("startup_s", "training_wall_s", "evaluation_s", "probes_s", "checkpointing_s")
    assert sum(summary[part] for part in parts) == pytest.approx(summary["wall_s"])
    # Its budget spent, it has nothing left to train until given more.
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume"]) == 2
    assert capsys.readouterr().err.strip() == (f"raysb: error: --resume: --out {out} has spent its work budget of 5 "
                                               "epochs; give a larger --work-budget to train on")


@needs_fashion_mnist
@pytest.mark.parametrize("analysis", [True, False])
def test_the_closing_line_and_summary_split_the_wall_time_into_parts_that_add_up(tmp_path, capsys, analysis):
    out = tmp_path / "run"
    flags = ["--record-analysis"] if analysis else []
    assert main(["train", "--strategy", "free-sb", "--epochs", "2", *SMALL, *flags, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    parts = ("startup_s", "training_wall_s", "evaluation_s", "probes_s", "checkpointing_s")
    assert sum(summary[part] for part in parts) == pytest.approx(summary["wall_s"])
    assert all(summary[part] > 0 for part in parts if part != "probes_s")
    # The probes are timed apart from evaluation, and only where the run records them.
    assert (summary["probes_s"] > 0) == analysis and (out / "model.pt").is_file() == analysis
    closing = capsys.readouterr().out.splitlines()[-1]
    split = (f"{summary['wall_s']:.1f}s wall: training {summary['training_wall_s']:.1f}, evaluation "
             f"{summary['evaluation_s']:.1f}, probes {summary['probes_s']:.1f}, checkpoints "
             f"{summary['checkpointing_s']:.1f}, start-up {summary['startup_s']:.1f}. {out}: ")
    assert split in closing
