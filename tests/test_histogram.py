"""The shared CDF_R's histogram: bins that order losses, exact merges, ranks close to the exact CDF_R."""

import pytest
import torch

from raysb.core.histogram import LOSS_BINS, bin_counts, bin_indices, bin_values, histogram_ranks
from raysb.core.keep_rule import Selector, percentile_ranks
from raysb.training.selection.merged_histogram import MergedLossHistogram


def merge_alone(history: MergedLossHistogram) -> None:
    """A world of one's round: what its exchange would carry, merged."""
    history.merge([history.take_round()])


def spread_losses(count: int, seed: int = 0) -> torch.Tensor:
    """Losses over many decades, both signs, zeros and values past both ends of the binned range."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp(torch.randn(count, generator=generator) * 12)
    signs = torch.where(torch.rand(count, generator=generator) < 0.2, -1.0, 1.0)
    extremes = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3e38, -3e38, 1.0, -1.0])
    return torch.cat([magnitudes * signs, extremes])


def test_bins_never_order_two_losses_the_wrong_way():
    losses = torch.sort(spread_losses(100_000)).values
    bins = bin_indices(losses)
    assert bool((bins.diff() >= 0).all())
    assert int(bins.min()) >= 0 and int(bins.max()) < LOSS_BINS
    # Each bin's representative value lies in that bin.
    assert torch.equal(bin_indices(bin_values()), torch.arange(LOSS_BINS))


def test_a_bin_holds_losses_within_two_percent_of_each_other():
    losses = torch.logspace(-10, 6, 200_000)
    bins = bin_indices(losses)
    for b in bins.unique()[1:-1].tolist():
        inside = losses[bins == b]
        assert float(inside.max() / inside.min()) < 1.02


def test_counts_merged_in_any_order_are_the_counts_of_all_losses():
    shards = [spread_losses(1000, seed) for seed in range(5)]
    whole = bin_counts(torch.cat(shards))
    assert torch.equal(sum(bin_counts(s) for s in shards), whole)
    assert torch.equal(sum(bin_counts(s) for s in reversed(shards)), whole)
    assert int(whole.sum()) == 5 * 1008


def test_histogram_ranks_are_within_their_bins_share_of_the_exact_ranks():
    generator = torch.Generator().manual_seed(1)
    history = torch.exp(torch.randn(4096, generator=generator))
    losses = torch.exp(torch.randn(512, generator=generator))
    ties = torch.rand(512, generator=generator)
    counts = bin_counts(history)
    exact = percentile_ranks(history, losses, ties)
    approximate = histogram_ranks(counts, losses, ties)
    bin_share = counts[bin_indices(losses)].double() / len(history)
    assert bool(((approximate - exact).abs() <= bin_share + 1e-6).all())
    assert float((approximate - exact).abs().max()) < 0.01


def test_an_empty_histogram_keeps_everything():
    assert torch.equal(histogram_ranks(torch.zeros(LOSS_BINS, dtype=torch.int32), torch.rand(5), torch.rand(5)),
                       torch.ones(5))


def test_the_window_holds_the_last_rounds_and_ranks_alone_before_the_first_merge():
    history = MergedLossHistogram(capacity=100, losses_per_round=40)  # a window of 3 rounds
    assert history.window_rounds == 3
    alone = torch.tensor([1.0, 2.0, 3.0, 4.0])
    history.extend(alone)
    # Nothing merged yet: this rank's own round decides; 4.0 is its largest loss.
    assert float(history.ranks(torch.tensor([4.0]), torch.tensor([1.0]))) == 1.0
    for round_index in range(5):
        if round_index:
            history.extend(torch.full((40,), float(round_index)))
        merge_alone(history)
    # Rounds 2, 3 and 4 (40 losses each) are in the window; round 0's and 1's are gone.
    assert len(history) == 120
    assert float(history.ranks(torch.tensor([1.5]), torch.tensor([0.5]))) == 0.0
    assert float(history.ranks(torch.tensor([3.0]), torch.tensor([0.5]))) == pytest.approx(0.5)
    assert sorted(set(history.values().tolist())) == [2.0, 3.0, 4.0]


def test_state_dict_restores_the_same_ranks_and_refuses_another_shape():
    history = MergedLossHistogram(capacity=256, losses_per_round=64)
    for seed in range(6):
        history.extend(spread_losses(56, seed))
        merge_alone(history)
    history.extend(torch.rand(10))  # a round counted but not yet merged
    probe, ties = spread_losses(100, 9), torch.rand(108)
    restored = MergedLossHistogram(capacity=256, losses_per_round=64)
    restored.load_state_dict(history.state_dict())
    assert torch.equal(restored.ranks(probe, ties), history.ranks(probe, ties))
    assert restored.checksum() == history.checksum()
    merge_alone(restored), merge_alone(history)
    assert restored.checksum() == history.checksum()
    with pytest.raises(ValueError, match="R=256"):
        MergedLossHistogram(capacity=256, losses_per_round=32).load_state_dict(history.state_dict())


def test_a_checkpoint_of_another_window_is_refused_with_what_must_match():
    # 2 ranks at s = 1/3 merged every selection batch of 128 before 2026-11-26 (a window of 4
    # merges of 256 losses); now every 3 batches (2 merges of 768).
    before, now = MergedLossHistogram(1024, 2 * 128), MergedLossHistogram(1024, 2 * 128 * 3)
    with pytest.raises(ValueError, match="history size, selection batch, selectivity and worker count"):
        now.load_state_dict(before.state_dict())


def test_two_ranks_keep_what_one_process_keeps_every_round_even_right_after_the_losses_drop():
    """Each rank ranks a round against the window as the round's merge will leave it, the round's
    own losses in: 2 ranks' keep probabilities then follow one process's CDF_R round by round, from
    the first round, and when the losses fall 20x at once (ranked against earlier rounds alone
    they trailed it by up to 0.13 in the 4 rounds after the drop; within 0.001 now)."""
    generator = torch.Generator().manual_seed(0)
    one = Selector(beta=2.0, history_size=1024, seed=0)
    ranks = [MergedLossHistogram(1024, losses_per_round=256, world_size=2) for _ in range(2)]
    selectors = [Selector(beta=2.0, seed=1 + rank, history=history) for rank, history in enumerate(ranks)]
    for round_index in range(48):
        losses = torch.empty(256).exponential_(generator=generator) / (20 if round_index >= 32 else 1)
        _, alone = one.keep_mask_and_probabilities(losses)
        halves = [selector.keep_mask_and_probabilities(half)[1] for selector, half in zip(selectors, losses.chunk(2))]
        assert abs(float(alone.mean()) - float(torch.cat(halves).mean())) < 0.02, round_index
        merged = [history.take_round() for history in ranks]
        for history in ranks:
            history.merge(merged)


def keep_probabilities_after_a_drop(world: int, exchanges: int = 12, drop_at: int = 8) -> list[tuple[float, float]]:
    """Per selection chunk, the mean keep probability of one process's Selector and of `world` lockstep
    ranks at the defaults (b = 128, s = 1/3: 3 chunks of 128 a rank between exchanges, R = 1024), fed the
    same losses (one process ranks every rank's chunk in turn), which fall 20x at once at exchange `drop_at`."""
    from raysb.config import TrainConfig

    spec = TrainConfig.from_dict({"workers": world}).settings().selection.spec
    generator = torch.Generator().manual_seed(0)
    one = Selector(beta=spec.beta, history_size=spec.history_size, seed=0)
    ranks = [MergedLossHistogram(spec.history_size, spec.losses_per_exchange(world), world_size=world)
             for _ in range(world)]
    selectors = [Selector(beta=spec.beta, seed=1 + rank, history=history) for rank, history in enumerate(ranks)]
    means = []
    for exchange in range(exchanges):
        for _ in range(spec.rounds_per_exchange):
            chunks = [torch.empty(spec.selection_batch_size).exponential_(generator=generator)
                      / (20 if exchange >= drop_at else 1) for _ in range(world)]
            alone = torch.cat([one.keep_mask_and_probabilities(chunk)[1] for chunk in chunks])
            together = torch.cat([selector.keep_mask_and_probabilities(chunk)[1]
                                  for selector, chunk in zip(selectors, chunks)])
            means.append((float(alone.mean()), float(together.mean())))
        merged = [history.take_round() for history in ranks]
        for history in ranks:
            history.merge(merged)
    return means


@pytest.mark.parametrize("world, window_rounds", [(2, 2), (3, 1), (4, 1), (8, 1)])
def test_at_the_defaults_a_rank_counts_its_own_round_once_from_3_ranks(world, window_rounds):
    """What README's "How selection works" and the module say: a round of 3 ranks (3 chunks of 128 each
    between exchanges) fills R = 1024, so from 3 ranks a rank's own losses count once."""
    from raysb.config import TrainConfig

    spec = TrainConfig.from_dict({"workers": world}).settings().selection.spec
    history = MergedLossHistogram(spec.history_size, spec.losses_per_exchange(world), world_size=world)
    assert history.window_rounds == window_rounds


def test_at_4_ranks_the_exchange_of_a_20x_drop_keeps_far_less_than_one_process_then_agrees():
    """The lag README states: before the drop and from the next exchange on, within 0.01-0.02 of one
    process; in the drop's own exchange 4 ranks keep a few hundredths of each chunk where one process,
    whose ring fills with the new low losses, is back near s by its second chunk."""
    means = keep_probabilities_after_a_drop(4)
    drop = 8 * 3  # the first chunk of exchange 8
    assert all(abs(alone - together) < 0.02 for alone, together in means[3:drop])
    assert all(together < 0.05 for _, together in means[drop:drop + 3])
    assert means[drop + 1][0] > 0.2 and means[drop + 2][0] > 0.3
    assert all(abs(alone - together) < 0.02 for alone, together in means[drop + 3:])
