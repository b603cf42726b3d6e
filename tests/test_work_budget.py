"""Budgets counted in work: the same seed and budget end at the same error on a busy machine and
an idle one, scored examples count at their measured cost, and a resumed run counts as it did."""

import subprocess
import sys

import pytest
import torch

from raysb.api import train
from raysb.config import ConfigError, TrainConfig
from raysb.core.schedules import learning_rate, schedule_progress
from raysb.core.work_units import work_epochs
from raysb.data.shards import MemoryShard
from raysb.training.builders import build_engine
from raysb.training.scoring_cost import measure_scoring_cost

from conftest import needs_fashion_mnist
from run_rows import untimed
from test_budget_baselines import config, killed_after_epoch_2_and_resumed
from test_data import make_dataset


def test_work_counts_trained_examples_and_scored_ones_at_their_cost():
    # By hand: 2 ranks, each trained 300 and scored 500 at 0.25 of a trained example: 2 * 425 / 1000.
    assert work_epochs(300, 500, 0.25, 2, 1000) == pytest.approx(0.85)
    assert work_epochs(1000, 0, 0.0, 1, 1000) == 1.0


def test_a_work_keyed_schedule_reaches_its_end_exactly_at_the_budget():
    lr = lambda done: learning_rate(  # noqa: E731
        "cosine", 0.1, schedule_progress("work", 0, 0, 1, total_epochs=40, work_done=done, work_budget=2.5), 40
    )
    assert lr(0) == pytest.approx(0.1) and lr(1.25) == pytest.approx(0.05) and lr(2.5) == 0.0


def test_a_work_budget_keys_the_schedule_and_is_checked():
    assert TrainConfig(work_budget=2.0).lr_schedule_key == "work"
    with pytest.raises(ConfigError, match="work_budget must be a finite number > 0"):
        TrainConfig(work_budget=0)
    with pytest.raises(ConfigError, match="lr_schedule_key work keys the schedule to the work budget"):
        TrainConfig(lr_schedule_key="work")
    with pytest.raises(ConfigError, match="scoring_cost must be a finite number >= 0"):
        TrainConfig(scoring_cost=-1)


def _busy_cores() -> list[subprocess.Popen]:
    """Load every core with a spinning process for as long as they live."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]


@needs_fashion_mnist
@pytest.mark.slow
def test_the_same_seed_and_work_budget_end_the_same_on_a_busy_machine_and_an_idle_one(tmp_path):
    run = dict(strategy="free-sb", work_budget=2.0, collapse_patience=0)
    idle = train(config(tmp_path, "idle", **run), log=lambda _: None)
    spinners = _busy_cores()
    try:
        busy = train(config(tmp_path, "busy", **run), log=lambda _: None)
    finally:
        for spinner in spinners:
            spinner.kill()
    assert untimed(busy.metrics) == untimed(idle.metrics)
    assert busy.summary["final_test_error"] == idle.summary["final_test_error"]
    summary = idle.summary
    assert summary["status"] == "work_budget_reached" and summary["config"]["lr_schedule_key"] == "work"
    # free-sb scores nothing: its work is its trained examples, stopped within a round of the budget.
    assert summary["scoring_cost"] == 0.0 and summary["selection_forward_examples"] == 0
    assert 2.0 <= summary["work_epochs"] <= 2.0 + 50 / 1000
    assert idle.metrics[-1]["lr"] == 0.0 and 0 < idle.metrics[-2]["lr"] < idle.metrics[0]["lr"]


@needs_fashion_mnist
def test_a_budget_spent_before_an_epochs_first_step_ends_the_run_with_the_epoch_before(tmp_path):
    # SB's scoring forwards count as work: here an epoch of work is the scored 1,000 examples at cost 1
    # and the third of them trained, so 1.4 is spent by epoch 2's first scored chunks, before its first
    # step. The run once wrote an evaluation of that untrained epoch, and README says a budget does not.
    lines = []
    run = train(config(tmp_path, "sb", strategy="sb", work_budget=1.4, scoring_cost=1.0, collapse_patience=0),
                log=lines.append)
    assert [row["epoch"] for row in run.metrics] == [1] and run.metrics[0]["epoch_steps"] > 0
    assert run.summary["status"] == "work_budget_reached" and run.summary["epochs_completed"] == 1
    assert "work budget of 1.4 epochs reached as epoch 2 began, before its first step; stopping after epoch 1" in lines
    assert not any("warning" in line for line in lines)
    # A budget spent before the run's first step: one warning, and no model written as if trained.
    lines.clear()
    nothing = train(config(tmp_path, "tiny", strategy="sb", time_budget=0.001), log=lines.append)
    assert nothing.metrics == [] and nothing.summary["optimizer_steps"] == 0
    assert ("raysb: warning: the time budget of 0.001s ended the run before its first optimizer step: nothing "
            "was trained, and no model was written") in lines
    assert not (tmp_path / "tiny" / "best_model.pt").exists() and not (tmp_path / "tiny" / "model.json").exists()


@needs_fashion_mnist
@pytest.mark.slow
def test_scored_examples_count_at_the_cost_measured_at_the_start_and_a_resume_keeps_it(tmp_path, monkeypatch):
    measured = []

    def measure(engine):
        measured.append(measure_scoring_cost(engine))
        return 0.4  # pinned, so the killed and the whole run count alike

    monkeypatch.setattr("raysb.training.loop.measure_scoring_cost", measure)
    # collapse_patience 0: a model this small may sit at chance for a few evaluations, and the
    # collapse guard would end the run (at 2.05 epochs of work once, in a loaded suite) before its budget.
    run = dict(strategy="sb", work_budget=4.0, collapse_patience=0)
    whole = train(config(tmp_path, "whole", **run), log=lambda _: None)
    summary = whole.summary
    assert len(measured) == 1 and measured[0] > 0
    assert summary["scoring_cost"] == 0.4
    work = 1 * (summary["backprop_examples"] + 0.4 * summary["selection_forward_examples"]) / 1000
    # Stopped at the first round past the budget: past it by at most a step and a scored chunk.
    assert summary["work_epochs"] == pytest.approx(work) and 4.0 <= work <= 4.0 + (50 + 0.4 * 50) / 1000
    # SB trains on about a third of what it scores: its 4 epochs of work score more than 4 epochs' examples.
    assert summary["selection_forward_examples"] > 4 * 1000

    measured.clear()
    resumed = killed_after_epoch_2_and_resumed(tmp_path, monkeypatch, **run)
    assert len(measured) == 1  # the killed run measured; the resumed one took its cost from the checkpoint
    assert untimed(resumed.metrics) == untimed(whole.metrics)


def test_the_measurement_finds_a_scoring_forward_cheaper_than_training_and_leaves_the_run_as_it_was():
    engine = build_engine(
        TrainConfig(strategy="sb", batch_size=128, record_analysis=False, device="cpu").settings(),
        MemoryShard(make_dataset(n=512, num_classes=10)), torch.device("cpu"),
    )
    engine.train_epoch(0)  # momentum buffers and moved BatchNorm statistics to leave alone
    before = {name: value.clone() for name, value in engine.model.state_dict().items()}
    generators = engine.feed.order_generator.get_state(), engine.feed.augment_generator.get_state()
    rng = torch.get_rng_state()
    # No autograd and no backward: on this CPU about 0.3 of a training example.
    assert 0 < measure_scoring_cost(engine) < 1
    after = engine.model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert torch.equal(engine.feed.order_generator.get_state(), generators[0])
    assert torch.equal(engine.feed.augment_generator.get_state(), generators[1])
    assert torch.equal(torch.get_rng_state(), rng)


# Two ranks stopping at rank 0's work with one lr: tests/test_label_doubt.py, whose two-rank run
# (free-sb under a work budget) checks it beside the ranks' one table of doubts, one Ray Train fit for both.
