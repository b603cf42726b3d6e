"""The selection schedules that follow the lr: a kept fraction that rises to 1, and a keep rule
that fades to a uniform draw of the same fraction. Each set at each epoch's start, the same on every
rank (tests/test_free_scores.py's two-rank run), exactly on resume, and in a user's own loop."""

import math
import re

import pyarrow.parquet as pq
import pytest
import torch

from raysb.api import train
from raysb.config import ConfigError, TrainConfig
from raysb.core.keep_rule import Selector, keep_probabilities
from raysb.core.selectivity import scheduled_selectivity, scheduled_strength
from raysb.core.strategy_table import strategies_reading
from raysb.training.selection.strategies import UniformStrategy

from conftest import needs_fashion_mnist
from run_rows import untimed
from test_budget_baselines import config, killed_after_epoch_2_and_resumed


def cosine_share(epoch: int, epochs: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * epoch / epochs))


def test_the_kept_fraction_rises_from_s_to_one_as_the_lr_decays():
    assert scheduled_selectivity("lr", 0.25, 1.0) == 0.25
    assert scheduled_selectivity("lr", 0.25, 0.5) == pytest.approx(0.625)  # s0 + (1 - s0)(1 - 1/2)
    assert scheduled_selectivity("lr", 0.25, 0.0) == 1.0
    assert scheduled_selectivity("constant", 0.25, 0.0) == 0.25
    with pytest.raises(ConfigError, match="kept_fraction_schedule lr applies to the strategies that keep a fraction"):
        TrainConfig(strategy="infobatch", kept_fraction_schedule="lr")
    with pytest.raises(ConfigError, match="unknown kept_fraction_schedule 'rising'"):
        TrainConfig(strategy="free-sb", kept_fraction_schedule="rising")


def test_a_weaker_keep_rule_mixes_in_a_uniform_draw_of_the_same_kept_fraction():
    percentiles = torch.tensor([0.0, 0.5, 1.0])
    # By hand, beta 2 (s = 1/3): P = w p^2 + (1 - w) / 3.
    assert keep_probabilities(percentiles, 2.0, strength=0.25).tolist() == pytest.approx([0.25, 0.3125, 0.5])
    assert keep_probabilities(percentiles, 2.0, strength=1.0).tolist() == [0.0, 0.25, 1.0]  # the paper's rule
    assert keep_probabilities(percentiles, 2.0, strength=0.0).tolist() == pytest.approx([1 / 3] * 3)
    # Over uniform percentiles every strength keeps s = 1 / (beta + 1): it moves which, not how many.
    grid = (torch.arange(100_000, dtype=torch.float64) + 0.5) / 100_000
    for strength in (0.0, 0.3, 1.0):
        assert float(keep_probabilities(grid, 3.0, strength=strength).mean()) == pytest.approx(0.25, abs=1e-6)
    assert scheduled_strength("lr", 0.4) == 0.4 and scheduled_strength("lr", 1.5) == 1.0
    assert scheduled_strength("constant", 0.0) == 1.0
    # Named from the table: every strategy with SB's keep rule, however many there are.
    weakened = " or ".join(strategies_reading("selection_strength_schedule"))
    with pytest.raises(ConfigError, match=re.escape(f"selection_strength_schedule lr only applies to strategy "
                                                    f"{weakened}, not uniform")):
        TrainConfig(strategy="uniform", selection_strength_schedule="lr")
    with pytest.raises(ConfigError, match="unknown selection_strength_schedule 'fading'"):
        TrainConfig(strategy="free-sb", selection_strength_schedule="fading")


def test_a_selector_at_strength_0_keeps_easy_and_hard_examples_alike():
    losses = torch.arange(3000, dtype=torch.float32)  # ranked against themselves: percentiles 0 to 1

    def kept_by_third(strength):
        selector = Selector(selectivity=0.25, history_size=3000, seed=0)
        selector.strength = strength
        keep = selector.keep_mask(losses)
        return [float(third.float().mean()) for third in keep.chunk(3)]

    easy, _, hard = kept_by_third(1.0)
    assert easy < 0.02 and hard > 0.55  # the paper's rule: p^3
    easy, middle, hard = kept_by_third(0.0)
    assert all(abs(share - 0.25) < 0.04 for share in (easy, middle, hard))


def test_uniform_under_a_schedule_takes_k_distinct_examples_an_epoch_and_each_once_a_cycle():
    ids = torch.arange(100, 110)
    strategy = UniformStrategy(ids, selectivity=0.3, seed=0)
    counts = [4, 8, 5, 3]  # the second epoch spans the first cycle's end, the fourth the second's
    for epoch, count in enumerate(counts):
        strategy.set_selectivity(epoch, count / 10)
    epochs = [strategy.epoch_subset(e).tolist() for e in range(4)]
    assert [len(chosen) for chosen in epochs] == counts
    assert all(len(set(chosen)) == len(chosen) for chosen in epochs)  # no example twice in an epoch
    stream = sum(epochs, [])
    assert sorted(stream[:10]) == sorted(stream[10:20]) == list(range(100, 110))  # each once a cycle
    # A function of (seed, the epochs' counts): a fresh strategy told the same counts draws the same.
    again = UniformStrategy(ids, selectivity=0.3, seed=0)
    again.load_state_dict(strategy.state_dict())
    assert again.epoch_subset(3).tolist() == epochs[3]


@needs_fashion_mnist
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["free-sb", "uniform"])
def test_each_epoch_keeps_the_schedules_fraction_and_a_resume_goes_on_exactly(tmp_path, monkeypatch, strategy):
    # collapse_patience 0: a model this small may sit at chance for a few evaluations (the guard would end the run).
    run = dict(strategy=strategy, epochs=5, kept_fraction_schedule="lr", selectivity=0.25, collapse_patience=0)
    if strategy == "free-sb":  # both schedules at once, and the tracked decisions to check them by
        run |= dict(selection_strength_schedule="lr", record_analysis=True)
    whole = train(config(tmp_path, "whole", **run), log=lambda _: None)
    kept = [row["kept_fraction"] for row in whole.metrics]
    # Set as each epoch starts, from the epoch-keyed cosine's share of its peak then.
    expected = [scheduled_selectivity("lr", 0.25, cosine_share(epoch, 5)) for epoch in range(5)]
    if strategy == "free-sb":
        decisions = pq.read_table(whole.out_dir / "tracked_examples.parquet").to_pylist()
        assert {row["epoch"] for row in decisions} == {1, 2, 3, 4, 5}  # numbered from 1, as the metrics are
        for row in decisions:  # by hand: P = w p^beta + (1 - w) s, w the lr's share, s and beta the epoch's
            share = cosine_share(row["epoch"] - 1, 5)
            s = scheduled_selectivity("lr", 0.25, share)
            assert row["probability"] == pytest.approx(
                share * row["percentile"] ** (1 / s - 1) + (1 - share) * s, rel=1e-5, abs=1e-6), row
    if strategy == "uniform":
        assert kept == [round(s * 1000) / 1000 for s in expected]
    else:
        # free-sb trains on everything in its first epoch (nothing scored yet), then keeps each
        # example by its own draw: within a few of the draws' spread of the schedule's fraction.
        assert kept[0] == 1.0 and all(abs(k - s) < 0.05 for k, s in zip(kept[1:], expected[1:])), (kept, expected)
    assert kept[1] < kept[2] < kept[3] < kept[4]
    resumed = killed_after_epoch_2_and_resumed(tmp_path, monkeypatch, **run)
    assert untimed(resumed.metrics) == untimed(whole.metrics)


