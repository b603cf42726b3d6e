"""Frontiers a skeptic accepts: lr schedules that end exactly at the time budget, the uniform
random-subset baseline (RS2), and a default schedule that decays."""

import json
from pathlib import Path

import pytest
import torch

import raysb.api
from raysb.api import train
from raysb.config import ConfigError, TrainConfig
from raysb.core.schedules import learning_rate, schedule_progress
from raysb.training import engine as engine_module
from raysb.training import timing
from raysb.training.selection.strategies import UniformStrategy

from conftest import needs_fashion_mnist
from run_rows import untimed
from test_distributed import assert_lockstep



def config(tmp_path, name="run", **overrides) -> TrainConfig:
    values = dict(
        dataset="fashion-mnist", subset=1000, test_subset=300, epochs=50, batch_size=50, seed=3,
        model_options={"width": 4}, progress_seconds=0, record_analysis=False, out=str(tmp_path / name),
    )
    values.update(overrides)
    return TrainConfig.from_dict(values)


# -- the schedules, as functions -----------------------------------------------------------
@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_time_keyed_schedules_reach_their_end_exactly_at_the_budget(schedule):
    lr = lambda seconds: learning_rate(  # noqa: E731
        schedule, 0.1, schedule_progress("time", 0, 0, 1, training_seconds=seconds, time_budget=60, total_epochs=10), 10
    )
    assert lr(0) == pytest.approx(0.1)
    assert lr(30) == pytest.approx(0.05)  # half the budget: half way, for both
    assert lr(59.9) > 0 and lr(60) == 0 and lr(75) == 0
    assert all(lr(t) >= lr(t + 1) for t in range(60))


def test_step_milestones_scale_with_the_budget():
    # Milestones in epochs of a 10-epoch run land at the same share of the budget.
    lr = lambda seconds: learning_rate(  # noqa: E731
        "step", 0.1, schedule_progress("time", 0, 0, 1, training_seconds=seconds, time_budget=100, total_epochs=10),
        10, milestones=[5], factor=0.1,
    )
    assert lr(49.9) == pytest.approx(0.1) and lr(50) == pytest.approx(0.01)


def test_the_default_schedule_decays_over_the_epochs_or_over_the_budget():
    plain = TrainConfig()
    assert (plain.lr_schedule, plain.lr_schedule_key) == ("cosine", "epoch")
    assert TrainConfig(time_budget=60).lr_schedule_key == "time"
    assert TrainConfig(time_budget=60, epochs=10, lr_schedule_key="backprop").lr_schedule_key == "backprop"
    with pytest.raises(ConfigError, match="lr_schedule_key time keys the schedule to the time budget"):
        TrainConfig(lr_schedule_key="time")


@needs_fashion_mnist
@pytest.mark.parametrize("strategy", ["traditional", "sb"])
def test_an_epoch_keyed_schedule_moves_every_step_and_ends_at_the_runs_last(tmp_path, monkeypatch, strategy):
    """Not a staircase: a 1-epoch run decays too, and the last step trains at the schedule's end."""
    lrs = []
    step = engine_module.Engine.train_step

    def recorded_step(engine, batch):
        lrs.append(engine.schedule.lr())
        step(engine, batch)

    monkeypatch.setattr(engine_module.Engine, "train_step", recorded_step)
    result = train(config(tmp_path, strategy=strategy, epochs=2, lr_warmup_epochs=0, lr=0.1), log=lambda _: None)
    assert len(set(lrs)) == len(lrs)  # a new lr every step, in every epoch
    # Each epoch's row reports the lr at its end: half way down the cosine, then at 0.
    assert [row["lr"] for row in result.metrics] == pytest.approx([0.05, 0.0], abs=1e-12)
    assert lrs == sorted(lrs, reverse=True) and lrs[0] < 0.1
    if strategy == "traditional":
        # Its last step takes up the last examples: cosine at its end.
        assert lrs[-1] == pytest.approx(0.0, abs=1e-12)
    else:
        # SB's last step comes within a few rounds of the end (a remainder of kept examples waits).
        assert lrs[-1] < 0.001


# -- time-keyed runs -------------------------------------------------------------------------
class StepClock:
    """A training clock that advances 10 ms per optimizer step and at no other time, so a
    time-keyed run is as reproducible as an epoch-keyed one."""

    def __init__(self, monkeypatch):
        self.now = 1000.0
        monkeypatch.setattr(timing.time, "perf_counter", lambda: self.now)
        step = engine_module.Engine.train_step

        def timed_step(engine, batch):
            step(engine, batch)
            self.now += 0.01

        monkeypatch.setattr(engine_module.Engine, "train_step", timed_step)


class Killed(Exception):
    pass


def killed_after_epoch_2(run_config: TrainConfig, monkeypatch) -> None:
    """`run_config`'s run, stopped dead right after its epoch-2 checkpoint."""
    save = raysb.api.save_checkpoint_file

    def save_then_die(engine, out, epoch, rows, config):
        save(engine, out, epoch, rows, config)
        if epoch == 2:
            raise Killed

    monkeypatch.setattr(raysb.api, "save_checkpoint_file", save_then_die)
    with pytest.raises(Killed):
        train(run_config, log=lambda _: None)
    monkeypatch.setattr(raysb.api, "save_checkpoint_file", save)


def killed_after_epoch_2_and_resumed(tmp_path, monkeypatch, **overrides):
    """The run `overrides` configure, stopped dead right after its epoch-2 checkpoint, then resumed."""
    killed_after_epoch_2(config(tmp_path, "killed", **overrides), monkeypatch)
    return train(config(tmp_path, "killed", resume=True, **overrides), log=lambda _: None)


@pytest.mark.slow
@needs_fashion_mnist
def test_a_time_keyed_run_ends_at_lr_zero_and_resumes_on_the_same_lr(tmp_path, monkeypatch):
    StepClock(monkeypatch)
    budget = dict(time_budget=0.445)  # 45 steps of the step clock: about 5 epochs of SB
    whole = train(config(tmp_path, "whole", **budget), log=lambda _: None)
    assert whole.summary["status"] == "time_budget_reached" and whole.summary["config"]["lr_schedule_key"] == "time"
    lrs = [row["lr"] for row in whole.metrics]
    assert lrs[-1] == 0.0 and 0 < lrs[-2] < lrs[1]  # decayed over the budget, to its end at it
    assert whole.summary["optimizer_steps"] == 45

    resumed = killed_after_epoch_2_and_resumed(tmp_path, monkeypatch, **budget)
    assert untimed(resumed.metrics) == untimed(whole.metrics)



@needs_fashion_mnist
def test_the_last_share_of_a_run_trains_on_everything_under_epochs_or_a_budget(tmp_path, monkeypatch):
    by_epochs = train(config(tmp_path, "epochs", strategy="free-sb", selectivity=0.25, epochs=4, anneal_share=0.25),
                      log=lambda _: None)
    kept = [row["kept_fraction"] for row in by_epochs.metrics]
    # The first epoch has no scores yet; the last quarter of 4 epochs is the last epoch.
    assert kept[0] == 1.0 and kept[1] < 0.3 and kept[2] < 0.3 and kept[3] == 1.0
    StepClock(monkeypatch)
    # 5 steps an epoch at s = 1/4 (50 ms), 20 on everything: the last 45% of 0.5 s begins at
    # 0.275 s, inside the 6th selective epoch, so the 7th epoch on trains on everything.
    by_time = train(config(tmp_path, "time", strategy="uniform", selectivity=0.25, time_budget=0.5,
                           anneal_share=0.45), log=lambda _: None)
    kept = [row["kept_fraction"] for row in by_time.metrics]
    assert kept[:6] == [0.25] * 6 and kept[6:] == [1.0] * (len(kept) - 6) and len(kept) > 6, kept
    assert by_time.summary["status"] == "time_budget_reached"

# -- uniform (RS2) ---------------------------------------------------------------------------
def test_uniform_covers_every_example_before_repeating_one():
    ids = torch.arange(100, 110)  # 10 examples, 3 an epoch
    strategy = UniformStrategy(ids, selectivity=0.3, seed=0)
    epochs = [strategy.epoch_subset(e) for e in range(7)]
    assert all(len(chosen) == 3 for chosen in epochs)
    stream = torch.cat(epochs).tolist()
    assert sorted(stream[:10]) == list(range(100, 110))  # the first 10 draws: every example once
    assert sorted(stream[10:20]) == list(range(100, 110))  # then a new permutation
    assert stream[:10] != stream[10:20]
    assert torch.equal(UniformStrategy(ids, 0.3, seed=0).epoch_subset(5), epochs[5])  # a function of (seed, epoch)


@needs_fashion_mnist
def test_uniform_keeps_s_n_an_epoch_scores_nothing_and_resumes_exactly(tmp_path, monkeypatch):
    uniform = dict(strategy="uniform", selectivity=0.25, epochs=4)
    whole = train(config(tmp_path, "whole", **uniform), log=lambda _: None)
    assert [row["kept_fraction"] for row in whole.metrics] == [0.25] * 4
    assert whole.summary["selection_forward_examples"] == 0
    assert whole.summary["examples_kept"] == 4 * 250

    resumed = killed_after_epoch_2_and_resumed(tmp_path, monkeypatch, **uniform)
    assert untimed(resumed.metrics) == untimed(whole.metrics)


@needs_fashion_mnist
@pytest.mark.slow
def test_two_workers_share_rank_zeros_clock_and_one_uniform_subset(ray_session, tmp_path):
    """A time-keyed lr read from each rank's own clock would differ between ranks; read from
    rank 0's clock (carried in the exchange) it is the same at every step, and the budget stops
    every rank on the same step. And the ranks' uniform picks add up to s * N an epoch, with no
    scoring forward."""
    result = train(
        config(tmp_path, workers=2, cpus_per_worker=1, strategy="uniform", selectivity=0.5, batch_size=25,
               time_budget=4.0),
        log=lambda _: None,
    )
    summary = json.loads((Path(result.out_dir) / "summary.json").read_text())
    assert summary["status"] == "time_budget_reached"
    assert summary["epochs_completed"] < 50
    # The schedule ran to the budget. Not to exactly 0 as in one process on a step clock (above): a
    # budget that runs out between two epochs (the host work after one epoch's last check) stops the
    # run before the next epoch's first step, and the last row is the epoch that trained, whose lr was
    # read a few milliseconds short of the budget (once 5.5e-8). So: within the last two epochs' share.
    lrs = [row["lr"] for row in result.metrics]
    schedule_end = learning_rate("cosine", summary["config"]["lr"], 50 * (1 - 2 / len(lrs)), 50)
    assert lrs[-1] <= schedule_end and lrs[1:] == sorted(lrs[1:], reverse=True), lrs
    assert_lockstep(summary)
    first, second = summary["per_rank_lr_checksum"]
    assert first == second and summary["per_rank_optimizer_steps"][0] == summary["per_rank_optimizer_steps"][1]
    assert all(row["kept_fraction"] == 0.5 for row in result.metrics[:-1])
    assert summary["selection_forward_examples"] == 0
