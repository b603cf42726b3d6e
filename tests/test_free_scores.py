"""Strategies that score nothing: free-sb (SB's keep rule on each example's last training loss)
and InfoBatch, in one process, on 2 gloo ranks, and across a kill and resume."""

import json
import zlib
from pathlib import Path

import pytest
import torch

from raysb.api import train
from raysb.config import ConfigError, TrainConfig
from raysb.core.histogram import bin_indices, counts_of_bins
from raysb.core.keep_rule import unbiased_weights
from raysb.core.sample_index import SampleIndex
from raysb.core.selectivity import scheduled_selectivity
from raysb.core.spec import SelectionSpec
from raysb.training.collective import Collective
from raysb.training.selection.loss_table import LossTable, RecordedLosses
from raysb.training.selection.strategies import FreeSBStrategy, InfoBatchStrategy, Scores

from conftest import needs_fashion_mnist
from run_rows import untimed
from test_budget_baselines import config, killed_after_epoch_2_and_resumed
from test_distributed import assert_lockstep
from test_host_syncs import small_engine
from test_kept_fraction_schedule import cosine_share


# Runs of 3,000 examples: the kept fraction's spread an epoch is about 0.009 at s = 1/3.
SCALE = dict(subset=3000, epochs=4)


# -- the loss table -------------------------------------------------------------------------------
@pytest.mark.parametrize("ids, unbroken", [
    (torch.arange(5, 25), True), (torch.arange(20).flip(0), True), (torch.tensor([3, 9, 4, 12, 7]), False),
    (torch.arange(3, 60, 4), True),  # a sharded table's: every 4th id of 0..N-1 from rank 3's
])
def test_an_index_of_evenly_spaced_ids_finds_what_the_search_finds(ids, unbroken):
    """Ids that run evenly (a data set's 0..N-1, or a rank's share of them) skip the search a loss
    table's every record paid for."""
    index, searched = SampleIndex(ids), SampleIndex(ids)
    searched.first = None  # the search every index ran before
    assert (index.first is not None) == unbroken
    outside = torch.tensor([-1, int(ids.min()) - 1, int(ids.max()) + 1, 1000, int(ids.min()) + 1])
    outside = outside[~torch.isin(outside, ids)]  # min + 1 lies between a stride's ids
    queries = torch.cat([ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))], outside])
    (slots, held), (searched_slots, searched_held) = index.find(queries), searched.find(queries)
    assert held.tolist() == [True] * len(ids) + [False] * len(outside) and torch.equal(held, searched_held)
    assert torch.equal(slots[held], searched_slots[held])
    kept = queries[held]
    assert torch.equal(index.slots(kept, checked=False), searched.slots(kept, checked=False))
    assert torch.equal(index.rows_of(kept), searched.rows_of(kept))
    assert torch.equal(ids[index.rows_of(kept)], kept)
    with pytest.raises(KeyError):
        index.slots(outside)


def test_the_table_counts_each_examples_last_loss_once_whatever_replaces_it():
    table = LossTable(torch.arange(10, 20), distribution=True)
    table.record(torch.tensor([10, 11, 12]), torch.tensor([0.5, 1.0, 2.0]))
    # 11 named twice in one record (a batch that spans an epoch's end): its last loss stands, counted once.
    table.record(torch.tensor([11, 13, 11]), torch.tensor([4.0, 0.25, 8.0]))
    assert torch.isnan(table.lookup(torch.tensor([10])))[0]  # records wait for the rounds' next loss read
    table.flush()
    assert table.lookup(torch.tensor([10, 11, 12, 13, 14])).tolist()[:4] == [0.5, 8.0, 2.0, 0.25]
    assert torch.isnan(table.lookup(torch.tensor([14])))[0]
    assert int(table.counts.sum()) == 4 and int(table.counts.min()) == 0
    scores = RecordedLosses(table)
    ranks = scores.ranks(torch.tensor([0.25, 0.5, 2.0, 8.0, 100.0]), torch.full((5,), 0.5))
    assert ranks.tolist() == pytest.approx([0.125, 0.375, 0.625, 0.875, 1.0])


@pytest.mark.slow
def test_a_10m_example_table_sharded_over_4_ranks_holds_a_quarter_each_and_ranks_as_the_whole():
    """The sharded table at scale, its ranks simulated one after another: each receives every record
    (as the exchange brings them) and keeps its own quarter; their summed summary is the whole set's."""
    examples, world = 10_000_000, 4
    losses = torch.exp(torch.randn(examples, generator=torch.Generator().manual_seed(0)))
    ids = torch.arange(examples)
    tables = []
    for rank in range(world):
        table = LossTable(ids, shared=True, distribution=True)
        table.shard(rank, world)
        table.apply(ids, losses)
        tables.append(table)
    assert [table.losses.numel() for table in tables] == [examples // world] * world
    assert all(not table.losses.isnan().any() for table in tables)
    assert torch.equal(tables[3].index.ids[:3], torch.tensor([3, 7, 11]))

    class Summed(Collective):
        """The all-reduce of `world` ranks' summaries, each rank's taken in turn."""

        def __init__(self):
            self.parts = []

        def all_sum(self, tensor):
            self.parts.append(tensor)
            return tensor

    summed = Summed()
    for table in tables:
        table.owner.share(table, summed)
    total = torch.stack(summed.parts).sum(0)
    for table in tables:
        table.owner._summed = total
    assert torch.equal(tables[0].distribution_counts(), counts_of_bins(bin_indices(losses)))
    assert float(tables[2].mean()) == pytest.approx(float(losses.double().mean()), rel=1e-6)
    # A rank decides its own quarter against the whole set's CDF: it keeps s = 1 / (beta + 1) of it.
    strategy = FreeSBStrategy(tables[1], beta=2.0, seed=0)
    owned = tables[1].index.ids[torch.randperm(examples // world, generator=torch.Generator().manual_seed(1))]
    assert strategy.decides_epoch(1, owned) and strategy.wants_scores(1, owned) is Scores.NONE
    plan = strategy.decide(1, owned, None)
    assert abs(len(plan.kept) / owned.numel() - 1 / 3) < 0.002


def test_lockstep_records_wait_for_the_exchange_and_resume_with_the_table():
    table = LossTable(torch.arange(4), shared=True, distribution=True)
    table.record(torch.tensor([0, 1]), torch.tensor([1.0, 2.0]))
    table.flush()
    assert torch.isnan(table.lookup(torch.arange(4))).all()  # applied only when the exchange carries it
    restored = LossTable(torch.arange(4), shared=True, distribution=True)
    restored.load_state_dict(table.state_dict())
    for held in (table, restored):
        ids, losses = held.take_unshared()
        held.apply(ids, losses)
        assert held.lookup(torch.arange(2)).tolist() == [1.0, 2.0] and int(held.counts.sum()) == 2


# -- free-sb ---------------------------------------------------------------------------------------
@pytest.mark.slow
@needs_fashion_mnist
def test_free_sb_keeps_s_from_its_second_epoch_scores_nothing_and_resumes_exactly(tmp_path, monkeypatch):
    free = dict(strategy="free-sb", selectivity=1 / 3, **SCALE)
    whole = train(config(tmp_path, "whole", **free), log=lambda _: None)
    kept = [row["kept_fraction"] for row in whole.metrics]
    assert kept[0] == 1.0  # never trained on: kept
    assert all(abs(fraction - 1 / 3) < 0.03 for fraction in kept[1:]), kept
    assert whole.summary["selection_forward_examples"] == 0

    resumed = killed_after_epoch_2_and_resumed(tmp_path, monkeypatch, **free)
    assert untimed(resumed.metrics) == untimed(whole.metrics)


@needs_fashion_mnist
def test_free_sb_refreshes_scores_older_than_k_epochs_with_a_selection_forward(tmp_path):
    result = train(config(tmp_path, strategy="free-sb", score_refresh_epochs=1, **SCALE), log=lambda _: None)
    forwards = [row["selection_forward_examples"] for row in result.metrics]
    # Epochs 1 and 2 find no score older than an epoch; from epoch 3 the ones not trained since
    # epoch 1 (about 2/3 of them) are scored again.
    assert forwards[:2] == [0, 0]
    assert 0.4 * 3000 < forwards[2] < 0.9 * 3000


# -- InfoBatch --------------------------------------------------------------------------------------
def decided(strategy, epoch: int, ids: torch.Tensor):
    """A free-score strategy's decision on `ids`: the kept ids and their weights. It asks for no
    selection forward."""
    assert strategy.wants_scores(epoch, ids) is Scores.NONE
    decision = strategy.decide(epoch, ids, None)
    return ids[decision.kept], decision.weights


def test_infobatch_drops_a_random_half_of_the_below_mean_examples_and_doubles_the_rest():
    ids = torch.arange(100, 140)
    losses = torch.linspace(0.1, 4.0, 40)
    strategy = InfoBatchStrategy(LossTable(ids), prune_ratio=0.5, delta=0.875, seed=7)
    strategy.table.record(ids[:30], losses[:30])  # the last 10 were never trained on
    strategy.table.flush()
    kept_ids, weights = decided(strategy, 1, ids)

    # By hand: the mean of the recorded losses, one U(0, 1) draw per example from the strategy's seed.
    below = losses < losses[:30].mean()
    below[30:] = False
    draws = torch.rand(40, generator=torch.Generator().manual_seed(7))
    survives = ~(below & (draws < 0.5))
    assert kept_ids.tolist() == ids[survives].tolist()
    assert weights.tolist() == torch.where(below[survives], 2.0, 1.0).tolist()
    assert 0 < int((below & ~survives).sum()) < int(below.sum())  # some pruned, some kept


def test_infobatch_anneals_from_epoch_floor_delta_e_as_its_authors_code_does():
    strategy = InfoBatchStrategy(LossTable(torch.arange(4)), prune_ratio=0.5, delta=0.875, seed=0)
    # The authors' sampler prunes at the start of epoch e unless (e + 1) / E > delta.
    for epochs in range(1, 17):
        for delta in (0.5, 0.8, 0.875):
            strategy.delta = delta
            annealed = [e for e in range(1, epochs) if strategy.anneals(e, e / epochs)]
            by_hand = [e for e in range(1, epochs) if (e + 1) / epochs > delta]
            assert annealed == by_hand, (epochs, delta)
    strategy.delta = 0.875
    assert [e for e in range(8) if strategy.anneals(e, e / 8)] == [7]  # 8 epochs: the last one
    assert [e for e in range(5) if strategy.anneals(e, e / 5)] == [4]  # 5 epochs: the last one too
    # Under a budget an epoch's share is what epochs took so far: 3 epochs in 0.66 of it end at 0.88.
    assert strategy.anneals(3, 0.66) and not strategy.anneals(3, 0.65)


def test_infobatch_refuses_a_prune_ratio_past_its_authors_cap():
    with pytest.raises(ValueError, match=r"in \(0, 0.9\]"):
        SelectionSpec(strategy="infobatch", batch_size=8, beta=2.0, selection_batch_size=8,
                      options={"infobatch_prune_ratio": 0.95})
    with pytest.raises(ConfigError, match=r"infobatch_prune_ratio must be in \(0, 0.9\] .*a tenth"):
        TrainConfig(strategy="infobatch", infobatch_prune_ratio=0.95)


@pytest.mark.slow
@needs_fashion_mnist
def test_infobatch_prunes_below_the_mean_scores_nothing_and_resumes_exactly(tmp_path, monkeypatch):
    info = dict(strategy="infobatch", subset=3000, epochs=5)
    whole = train(config(tmp_path, "whole", **info), log=lambda _: None)
    kept = [row["kept_fraction"] for row in whole.metrics]
    # Every example in the first epoch and the last (which ends past 0.875 of the run); in between
    # the ones at or above the mean and half of the others.
    assert kept[0] == 1.0 and kept[-1] == 1.0
    assert all(0.5 < fraction < 0.85 for fraction in kept[1:-1]), kept
    assert whole.summary["selection_forward_examples"] == 0

    resumed = killed_after_epoch_2_and_resumed(tmp_path, monkeypatch, **info)
    assert untimed(resumed.metrics) == untimed(whole.metrics)


# -- two ranks ---------------------------------------------------------------------------------------
@needs_fashion_mnist
@pytest.mark.slow
def test_two_ranks_take_equal_steps_hold_a_table_each_and_keep_what_one_process_keeps(ray_session, tmp_path):
    # A replicated table on thread ranks (every rank applies every rank's losses) is
    # tests/test_epoch_plans.py's, and on Ray Train tests/test_label_doubt.py's two-rank run.
    # The kept fraction that rises as the lr decays (tests/test_kept_fraction_schedule.py), set at each
    # epoch's start: the same on every rank. Label doubt on a table whose ranks hold a part each: the
    # measure and the doubted examples' scores come from the sums every rank shares as an epoch starts.
    common = dict(strategy="free-sb", subset=2000, epochs=4, kept_fraction_schedule="lr", selectivity=0.25,
                  collapse_patience=0, strategy_options={"label_doubt": "auto"})
    two = train(config(tmp_path, "two", workers=2, cpus_per_worker=1, batch_size=25, loss_table="sharded", **common),
                log=lambda _: None)
    one = train(config(tmp_path, "one", batch_size=50, **common), log=lambda _: None)
    summary = json.loads((Path(two.out_dir) / "summary.json").read_text())
    assert_lockstep(summary)
    assert summary["selection_forward_examples"] == 0 and summary["loss_table"] == "sharded"
    # Each rank holds its own half's losses, recorded.
    first, second = summary["per_rank_loss_table_checksum"]
    never_trained = LossTable(torch.arange(1000), margins=True).checksum()
    assert first != second and never_trained not in (first, second)
    for mine, theirs in zip(two.metrics, one.metrics):
        assert mine["kept_fraction"] == pytest.approx(theirs["kept_fraction"], abs=0.06)
    # Uniform until the measure, taken once as the third epoch starts (tests/test_label_doubt.py).
    rules = [row["label_doubt_rule"] for row in two.metrics]
    assert rules[:2] == ["uniform", "uniform"] and rules[2] == rules[3] in ("off", "tiered"), rules
    assert [row.get("label_doubt_share") is not None for row in two.metrics] == [False, False, True, True]
    kept = [row["kept_fraction"] for row in two.metrics]
    expected = [scheduled_selectivity("lr", 0.25, cosine_share(epoch, 4)) for epoch in range(4)]
    assert kept[0] == 1.0 and all(abs(k - s) < 0.05 for k, s in zip(kept[1:], expected[1:])), (kept, expected)


# -- Stale-SB's training-loss refresh -----------------------------------------------------------------
@pytest.mark.parametrize("refresh", [False, True])
def test_stale_sb_records_trained_examples_losses_between_selection_passes_when_asked(refresh):
    engine = small_engine(strategy="stale-sb", staleness=3, training_loss_refresh=refresh)
    engine.train_epoch(0)  # the selection pass records every example's selection loss
    table = engine.strategy.loss_table()
    before = table.losses.clone()
    trained = []
    step = engine.train_step
    engine.train_step = lambda batch: (trained.extend(batch.sample_ids.tolist()), step(batch))
    engine.train_epoch(1)  # reuses the recorded losses, scoring nothing
    changed = (table.losses != before).nonzero().squeeze(1)
    assert engine.counters.selection_forward_examples == 320 and len(trained) > 0
    assert sorted(table.index.ids[changed].tolist()) == (sorted(set(trained)) if refresh else [])


@pytest.mark.parametrize("schedule", ["raysb", "authors"])
def test_stale_sb_passes_fall_where_raysb_or_its_authors_put_them(schedule):
    # raysb: one unscored plain-SGD epoch, then passes at 1, 4. The authors' code: a scored plain-SGD
    # first epoch that is the pass at 0, then passes at 3, 6, each trained example's training loss
    # replacing its recorded score.
    priming = dict(raysb={"prime_epochs": 1}, authors={"stale_sb_schedule": "authors"})[schedule]
    engine = small_engine(strategy="stale-sb", staleness=3, **priming)
    table = engine.strategy.loss_table()
    trained_losses = {}
    observe = engine.strategy.observe_training_losses

    def observed(batch, losses, margins):
        trained_losses.update(zip(batch.sample_ids.tolist(), losses.tolist()))
        observe(batch, losses, margins)

    engine.strategy.observe_training_losses = observed
    scored, kept = [], []
    for epoch in range(5):
        before = engine.counters.selection_forward_examples
        engine.train_epoch(epoch)
        scored.append(engine.counters.selection_forward_examples - before)
        kept.append(engine.progress_counts()["epoch_kept"])
        if epoch == 0 and schedule == "authors":
            ids = torch.tensor(sorted(trained_losses))
            # Every example trained, and its training loss replaced the score its pass recorded.
            assert len(ids) == 320
            assert table.lookup(ids).tolist() == pytest.approx([trained_losses[i] for i in ids.tolist()])
    passes = {"raysb": [1, 4], "authors": [0, 3]}[schedule]
    assert [epoch for epoch in range(5) if scored[epoch]] == passes and all(scored[e] == 320 for e in passes)
    assert kept[0] == 320 and all(kept[e] < 320 for e in range(1, 5))  # plain SGD, then selection
    if schedule == "authors":
        assert engine.strategy.record_training_losses and engine.schedule.selects(0)
    with pytest.raises(ConfigError, match="stale_sb_schedule authors primes one epoch of its own"):
        TrainConfig(strategy="stale-sb", stale_sb_schedule="authors", prime_epochs=1)
    with pytest.raises(ConfigError, match="stale_sb_schedule authors only applies to strategy stale-sb"):
        TrainConfig(strategy="sb", stale_sb_schedule="authors")


def test_free_sb_with_unbiased_weights_weighs_each_kept_example_mean_p_over_its_p():
    ids = torch.arange(200)
    table = LossTable(ids, distribution=True)
    table.record(ids, torch.linspace(0.01, 3.0, 200))
    table.flush()
    strategy = FreeSBStrategy(table, beta=2.0, seed=5, weighted=True)
    kept_ids, kept_weights = decided(strategy, 1, ids)
    # By hand: each score's rank among the 200 recorded (the tie share of its own entry drawn as
    # the selector draws it), P = rank ** 2, the weight mean(P) / P, capped at 10; the table ranks
    # at its histogram's resolution, within 2.5% of the exact ranks here.
    draws = torch.rand(2, 200, generator=torch.Generator().manual_seed(5))
    ranks = (torch.arange(200) + draws[0]) / 200
    probabilities = ranks.pow(2)
    keep = draws[1] < probabilities
    assert kept_ids.tolist() == ids[keep].tolist()
    weights = (probabilities.mean() / probabilities).clamp(max=10)[keep]
    assert kept_weights.tolist() == pytest.approx(weights.tolist(), rel=0.025)
    assert unbiased_weights(torch.tensor([1.0, 0.5, 0.25, 0.0])).tolist() == [0.4375, 0.875, 1.75, 10.0]
    assert unbiased_weights(torch.ones(3)).tolist() == [1.0, 1.0, 1.0]  # kept whole: unweighted
    assert kept_weights.max() <= 10 and kept_weights.min() < 1 < kept_weights.max()  # hard ones weigh less
    # Their mean over the kept examples estimates 1: the step keeps its size.
    assert float(kept_weights.mean()) == pytest.approx(1.0, abs=0.25)
    with pytest.raises(ConfigError, match="selection_weights unbiased only applies to strategy free-sb"):
        TrainConfig(strategy="sb", selection_weights="unbiased")
