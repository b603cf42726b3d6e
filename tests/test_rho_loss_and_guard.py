"""What acts on selection's over-fitting (issue 60): RHO-LOSS's reducible losses, against a hand
computation of its authors' rule and end to end under label noise; a cap on how often one example is
kept within a window of epochs; and the guard that moves selection toward a uniform draw or a larger
kept fraction when a held-out loss rises while the trained examples' collapses."""

import json

import pandas as pd
import pytest
import torch

from raysb.api import train
from raysb.config import ConfigError, TrainConfig
from raysb.core.overfit_guard import OverfitGuard, overfitting
from raysb.core.selectivity import beta_from_selectivity, trained_at_most
from raysb.core.train_cap import TrainCap
from raysb.data.prepare import prepare_data, split_holdout
from raysb.training.selection.loss_table import LossTable
from raysb.training.selection.strategies import FreeSBStrategy, RhoLossStrategy, Scores
from raysb.training.selection.strategies.rho_loss import selected_count, top_reducible

from conftest import needs_fashion_mnist
from run_rows import untimed
from test_budget_baselines import config, killed_after_epoch_2_and_resumed


# -- RHO-LOSS: the authors' rule ----------------------------------------------------------------------
def authors_selection(model_loss: torch.Tensor, irreducible_loss: torch.Tensor, percent_train: float) -> list[int]:
    """OATML/RHO-Loss, by hand: MultiModels.training_step's selected_batch_size and
    reducible_loss_selection's top_x_indices(model_loss - irreducible_loss, largest=True), as a set."""
    selected_batch_size = max(1, int(len(model_loss) * percent_train))
    reducible_loss = model_loss - irreducible_loss
    return sorted(torch.argsort(reducible_loss, descending=True)[:selected_batch_size].tolist())


def test_reducible_loss_keeps_what_its_authors_rule_keeps_not_the_highest_losses():
    losses = torch.tensor([2.0, 0.5, 3.0, 1.0, 2.5, 0.1])
    irreducible = torch.tensor([1.9, 0.1, 0.5, 0.2, 2.4, 0.0])
    # By hand: reducible 0.1, 0.4, 2.5, 0.8, 0.1, 0.1; int(6 / 3) = 2 kept: positions 2 and 3. The two
    # highest losses, 2 and 4, are what SB would prefer: 4 is as hard for a model that never trained on it.
    assert selected_count(6, 1 / 3) == 2
    assert top_reducible(losses, irreducible, 2).tolist() == [2, 3] == authors_selection(losses, irreducible, 1 / 3)
    generator = torch.Generator().manual_seed(0)
    for presample, percent in [(384, 1 / 3), (100, 0.1), (37, 0.25), (5, 0.1), (1280, 0.1)]:
        losses, irreducible = torch.rand(2, presample, generator=generator) * 3
        count = selected_count(presample, percent)
        assert count == max(1, int(presample * percent))
        assert top_reducible(losses, irreducible, count).tolist() == authors_selection(losses, irreducible, percent)


def test_the_strategy_looks_each_example_s_irreducible_loss_up_by_id_and_keeps_the_authors_top():
    ids = torch.tensor([40, 12, 7, 33, 21, 5, 18, 29, 50, 3])  # a presample, in the epoch's random order
    table_ids = torch.tensor([3, 5, 7, 12, 18, 21, 29, 33, 40, 50, 61])
    table = torch.linspace(0.0, 2.0, len(table_ids))
    strategy = RhoLossStrategy(selectivity=0.3, irreducible_epochs=5)
    assert strategy.irreducible_epochs() == 5  # it asks for them until it holds them
    strategy.use_irreducible_losses(table_ids.flip(0), table.flip(0))  # any order of ids
    assert strategy.irreducible_epochs() == 0
    assert strategy.wants_scores(1, ids) is Scores.ALL
    scores = torch.rand(len(ids), generator=torch.Generator().manual_seed(3)) * 2
    irreducible = table[torch.searchsorted(table_ids, ids)]
    assert strategy.decide(1, ids, scores).kept.tolist() == authors_selection(scores, irreducible, 0.3)
    restored = RhoLossStrategy(selectivity=0.3, irreducible_epochs=5)
    restored.load_state_dict(strategy.state_dict())
    assert restored.irreducible_epochs() == 0
    assert torch.equal(restored.decide(1, ids, scores).kept, strategy.decide(1, ids, scores).kept)


def test_rho_loss_is_refused_where_it_cannot_hold_a_split_out():
    with pytest.raises(ConfigError, match="strategy rho-loss trains its irreducible-loss model in one process"):
        TrainConfig(strategy="rho-loss", workers=2)
    with pytest.raises(ConfigError, match=r"holdout_share must be in \(0, 1\)"):
        TrainConfig(strategy="rho-loss", holdout_share=0.0)
    with pytest.raises(ConfigError, match="holdout_share=0.2 only applies to strategy rho-loss, not sb"):
        TrainConfig(strategy="sb", holdout_share=0.2)
    with pytest.raises(ConfigError, match="not with data_mode=stream"):
        TrainConfig(strategy="rho-loss", dataset="parquet", data_mode="stream", workers=1)
    from raysb import SelectiveBackprop

    with pytest.raises(ValueError, match="holds out 0.1 of the training data, which raysb's trainer splits off"):
        SelectiveBackprop(lambda model, batch: model(batch[0]), 8, strategy="rho-loss")
    assert TrainConfig(strategy="rho-loss").settings().data.held_out_share == 0.1
    assert TrainConfig(strategy="sb").settings().data.held_out_share == 0.0


@needs_fashion_mnist
def test_the_held_out_split_is_stratified_seeded_and_apart_from_what_trains():
    settings = TrainConfig(strategy="rho-loss", subset=1000, label_noise=0.2, holdout_share=0.2, seed=3).settings()
    full, _, flipped = prepare_data(settings.data, 50)
    train_data, held_out = split_holdout(settings.data, full, 50)
    again = split_holdout(settings.data, full, 50)[0]
    assert len(held_out) == 200 and len(train_data) == 800 and torch.equal(again.sample_ids, train_data.sample_ids)
    assert not set(train_data.sample_ids.tolist()) & set(held_out.sample_ids.tolist())
    assert torch.bincount(held_out.labels, minlength=10).min() >= 10  # every class, noisy labels included
    # Its own random stream: about as many flipped examples held out as the noise's share.
    assert 20 <= int(torch.isin(held_out.sample_ids, flipped).sum()) <= 60


@needs_fashion_mnist
def test_rho_loss_keeps_few_of_the_mislabelled_examples_and_counts_its_irreducible_model_as_work(tmp_path):
    noisy = dict(strategy="rho-loss", label_noise=0.2, holdout_share=0.25, irreducible_epochs=10, epochs=2,
                 record_analysis=True, work_budget=50.0, scoring_cost=0.5)
    lines = []
    result = train(config(tmp_path, **noisy), log=lines.append)
    summary = result.summary
    assert summary["train_examples"] == 750 and any("irreducible losses from a small-cnn trained 10" in line
                                                    for line in lines)
    counts = pd.read_parquet(tmp_path / "run" / "selection_counts.parquet")
    assert len(counts) == 750  # the held-out examples are never considered, never trained
    flipped = counts["sample_id"].isin(summary["label_noise_flipped_ids"])
    share_of_data = float(flipped.mean())
    share_of_kept = float(counts["kept"][flipped].sum() / counts["kept"].sum())
    assert 0.15 < share_of_data < 0.25 and share_of_kept < share_of_data / 2, (share_of_data, share_of_kept)
    # Its work: the model's 250 held-out examples, 10 epochs in batches of 50, and its forward over the
    # 750 training examples at a scored example's cost, beside the rounds' own.
    assert summary["side_trained_examples"] == 2500 and summary["side_forward_examples"] == 750
    rounds = summary["backprop_examples"] + 0.5 * summary["selection_forward_examples"]
    assert summary["work_epochs"] == pytest.approx((rounds + 2500 + 0.5 * 750) / 750)


@needs_fashion_mnist
def test_rho_loss_resumes_with_its_irreducible_losses_and_trains_no_second_model(tmp_path, monkeypatch):
    run = dict(strategy="rho-loss", epochs=3, holdout_share=0.2)
    whole = train(config(tmp_path, "whole", **run), log=lambda _: None)
    resumed = killed_after_epoch_2_and_resumed(tmp_path, monkeypatch, **run)
    assert untimed(resumed.metrics) == untimed(whole.metrics)
    assert resumed.summary["side_trained_examples"] == whole.summary["side_trained_examples"] > 0


# -- the train cap ------------------------------------------------------------------------------------
def test_the_cap_allows_at_most_its_count_in_every_window_of_epochs():
    assert trained_at_most(1.5, 1 / 3, 6) == 3 and trained_at_most(1.0, 0.25, 4) == 1
    cap = TrainCap(torch.tensor([10, 11]), most=2, window=4)
    kept_in = []
    for epoch in range(12):  # example 10 asks to be kept every epoch; 11 never
        if bool(cap.allowed(torch.tensor([10]), epoch)):
            cap.record(torch.tensor([10]), epoch)
            kept_in.append(epoch)
    assert kept_in == [0, 1, 4, 5, 8, 9]  # 2 in any 4 consecutive epochs, as soon as the window allows
    assert bool(cap.allowed(torch.tensor([11]), 0))


def _keeps_by_epoch(strategy: FreeSBStrategy, ids: torch.Tensor, epochs: int, first: int = 0) -> torch.Tensor:
    """Which of `ids` free-sb keeps in each of `epochs` epochs from epoch `first`, deciding each epoch whole."""
    kept = torch.zeros(epochs, len(ids), dtype=torch.bool)
    for row, epoch in enumerate(range(first, first + epochs)):
        strategy.wants_scores(epoch, ids)
        kept[row, strategy.decide(epoch, ids, None).kept] = True
    return kept


def test_free_sb_with_a_train_cap_keeps_no_example_past_it_where_its_keep_rule_alone_would():
    ids = torch.arange(300)
    # The same 30 examples hold the highest scores throughout: free-sb's rule keeps them almost every epoch.
    scores = torch.cat([torch.full((30,), 5.0), torch.linspace(0.01, 1.0, 270)])
    built = []
    for options in ({}, {"train_cap": 1.5}):
        spec = TrainConfig(strategy="free-sb", **options).selection_spec()
        strategy = FreeSBStrategy.build(spec, history=None, sample_ids=ids, device="cpu")
        strategy.table.record(ids, scores)
        strategy.table.flush()
        built.append(_keeps_by_epoch(strategy, ids, 24))
    uncapped, capped = built
    most, window = trained_at_most(1.5, 1 / 3, 6), 6  # 3 of any 6 epochs: 1.5 times a uniform draw's 2
    windows = lambda kept: torch.stack([kept[e:e + window].sum(0) for e in range(len(kept) - window + 1)])  # noqa: E731
    assert int(windows(uncapped).max()) > most  # the keep rule alone exceeds the cap
    assert int(windows(capped).max()) <= most
    assert float(capped[:, :30].float().mean()) == pytest.approx(most / window, abs=0.02)
    with pytest.raises(ConfigError, match="train_cap counts each example's keeps in one process"):
        TrainConfig(strategy="free-sb", train_cap=1.5, workers=2)


def test_the_cap_leaves_out_the_keeps_of_examples_not_yet_scored():
    # One keep in any 6 epochs (K = 0.5 at s = 1/3). The first epoch keeps every example, none scored
    # yet; counted against the cap, that keep blocked every example for epochs 1-5 (a 10,000-example
    # run trained nothing there).
    ids = torch.arange(300)
    spec = TrainConfig(strategy="free-sb", train_cap=0.5).selection_spec()
    strategy = FreeSBStrategy.build(spec, history=None, sample_ids=ids, device="cpu")
    strategy.wants_scores(0, ids)
    assert len(strategy.decide(0, ids, None).kept) == 300
    strategy.table.record(ids, torch.linspace(0.01, 1.0, 300))
    strategy.table.flush()
    kept = _keeps_by_epoch(strategy, ids, 6, first=1)
    assert float(kept[0].float().mean()) == pytest.approx(1 / 3, abs=0.08)  # the keep rule's share, not 0
    assert int(kept.sum(0).max()) <= 1  # and the cap holds over epochs 1-6


# -- the over-fitting guard ---------------------------------------------------------------------------
# Over-fitting: the held-out loss falls to 0.27 and then rises, while the trained examples' loss
# collapses (the diagnosis' free-sb: test loss 0.24 -> 0.36, training loss 11x below Traditional's).
OVERFITTING = ([0.60, 0.40, 0.31, 0.27, 0.29, 0.31], [1.20, 0.60, 0.30, 0.20, 0.08, 0.05])
# Steady: both fall, the held-out loss with noise of a few percent.
STEADY = ([0.60, 0.40, 0.33, 0.30, 0.31, 0.29], [1.20, 0.70, 0.45, 0.30, 0.22, 0.16])
# The held-out loss rises, but so does the training loss (an lr step, a bad epoch): no over-fitting.
BOTH_RISE = ([0.60, 0.40, 0.31, 0.27, 0.29, 0.33], [1.20, 0.60, 0.40, 0.30, 0.33, 0.36])


def test_the_guard_acts_on_an_over_fitting_signal_and_not_on_a_steady_one():
    held_out, trained = OVERFITTING
    acted = [overfitting(held_out[:e], trained[:e]) for e in range(1, len(held_out) + 1)]
    # 0.31 > 1.1 * 0.27 and rising, 0.05 < 0.5 * 0.20: the last epoch only (at 0.29 it had not risen 10%).
    assert acted == [False] * 5 + [True]
    for signal in (STEADY, BOTH_RISE):
        assert not any(overfitting(signal[0][:e], signal[1][:e]) for e in range(1, 7))


def _guarded(action: str, signal) -> FreeSBStrategy:
    """free-sb with the guard `action`, shown the losses of `signal` epoch by epoch."""
    ids = torch.arange(10)
    spec = TrainConfig(strategy="free-sb", overfit_guard=action).selection_spec()
    strategy = FreeSBStrategy.build(spec, history=None, sample_ids=ids, device="cpu")
    lines = []
    for epoch, (held_out, trained) in enumerate(zip(*signal)):
        lines.append(strategy.observe_held_out_loss(epoch, held_out, trained))
    assert [line is not None for line in lines] == [signal is OVERFITTING and e == 5 for e in range(6)]
    return strategy


@pytest.mark.parametrize("action", ["strength", "fraction"])
def test_the_guard_moves_free_sb_half_way_to_uniform_or_to_every_example_when_it_acts(action):
    steady = _guarded(action, STEADY)
    assert steady.selector.strength == 1.0 and steady.selector.beta == pytest.approx(2.0)
    moved = _guarded(action, OVERFITTING)
    if action == "strength":
        assert moved.selector.strength == 0.5 and moved.selector.beta == pytest.approx(2.0)
        moved.set_selection_strength(7, 0.8)  # a schedule's strength is moved as far
        assert moved.selector.strength == pytest.approx(0.4)
    else:
        assert moved.selector.strength == 1.0 and moved.selector.beta == pytest.approx(beta_from_selectivity(2 / 3))
        moved.set_selectivity(7, 0.5)  # half way from a schedule's 0.5 to every example
        assert moved.selector.beta == pytest.approx(beta_from_selectivity(0.75))
    restored = FreeSBStrategy.build(TrainConfig(strategy="free-sb", overfit_guard=action).selection_spec(),
                                    history=None, sample_ids=torch.arange(10), device="cpu")
    restored.load_state_dict(moved.state_dict())
    assert (restored.selector.strength, restored.selector.beta) == (moved.selector.strength, moved.selector.beta)


def test_the_guard_s_state_is_its_histories_and_how_far_it_moved():
    guard = OverfitGuard("strength")
    for held_out, trained in zip(*OVERFITTING):
        guard.update(held_out, trained)
    again = OverfitGuard("strength")
    again.load_state_dict(guard.state_dict())
    assert again.remaining == guard.remaining == 0.5 and again.strength(1.0) == 0.5 and again.selectivity(0.3) == 0.3
    with pytest.raises(ConfigError, match="overfit_guard reads a held-out loss in one process"):
        TrainConfig(strategy="free-sb", overfit_guard="strength", workers=2)
    with pytest.raises(ConfigError, match="unknown overfit_guard .uniform.; choose one of off, strength, fraction"):
        TrainConfig(strategy="free-sb", overfit_guard="uniform")


@needs_fashion_mnist
def test_the_guard_reads_its_held_out_split_every_epoch_and_counts_it_as_scored_work(tmp_path, monkeypatch):
    run = dict(strategy="free-sb", overfit_guard="strength", guard_holdout_share=0.05, epochs=3,
               work_budget=50.0, scoring_cost=0.5)
    whole = train(config(tmp_path, "whole", **run), log=lambda _: None)
    summary = whole.summary
    assert summary["train_examples"] == 950  # 50 held out
    assert [row["side_forward_examples"] for row in whole.metrics] == [50, 100, 150]
    assert summary["side_trained_examples"] == 0 and summary["selection_forward_examples"] == 0
    assert summary["work_epochs"] == pytest.approx((summary["backprop_examples"] + 0.5 * 150) / 950)
    guard_share = 0.5 * 150 / (summary["work_epochs"] * 950)
    assert guard_share < 0.05, guard_share
    resumed = killed_after_epoch_2_and_resumed(tmp_path, monkeypatch, **run)
    assert untimed(resumed.metrics) == untimed(whole.metrics)
    saved = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert saved["config"]["overfit_guard"] == "strength"
