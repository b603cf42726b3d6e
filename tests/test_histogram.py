"""The shared CDF_R's histogram: bins that order losses, exact merges, ranks close to the exact CDF_R."""

import pytest
import torch

from raysb.core.histogram import LOSS_BINS, bin_counts, bin_indices, bin_values, histogram_ranks
from raysb.core.keep_rule import LossHistory, Selector, percentile_ranks
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


def test_the_window_holds_the_last_r_losses_and_ranks_alone_before_the_first_merge():
    history = MergedLossHistogram(capacity=100)
    alone = torch.tensor([1.0, 2.0, 3.0, 4.0])
    history.extend(alone)
    # Nothing merged yet: this rank's own chunk decides; 4.0 is its largest loss.
    assert float(history.ranks(torch.tensor([4.0]), torch.tensor([1.0]))) == 1.0
    for round_index in range(5):
        if round_index:
            history.extend(torch.full((40,), float(round_index)))
        merge_alone(history)
    # The steps that hold R = 100 losses: rounds 2, 3 and 4 (40 each); rounds 0 and 1 are gone.
    assert len(history) == 120 and history.step_sizes == [40, 40, 40]
    assert sorted(set(history.values().tolist())) == [2.0, 3.0, 4.0]
    # CDF_R ranks against the last 100 of them: rounds 4 and 3 whole and half of round 2.
    assert float(history.ranks(torch.tensor([1.5]), torch.tensor([0.5]))) == 0.0
    assert float(history.ranks(torch.tensor([3.0]), torch.tensor([0.5]))) == pytest.approx((20 + 0.5 * 40) / 100)


def test_state_dict_restores_the_same_ranks_and_refuses_another_r():
    history = MergedLossHistogram(capacity=256, world_size=2, rank=1)
    for seed in range(6):
        history.extend(spread_losses(56, seed))
        history.merge([history.take_round(), history.take_round()])
    history.extend(torch.rand(10))  # a chunk counted but not yet merged
    probe, ties = spread_losses(100, 9), torch.rand(108)
    restored = MergedLossHistogram(capacity=256, world_size=2, rank=1)
    restored.load_state_dict(history.state_dict())
    assert torch.equal(restored.ranks(probe, ties), history.ranks(probe, ties))
    assert restored.checksum() == history.checksum()
    merge_alone(restored), merge_alone(history)
    assert restored.checksum() == history.checksum()
    with pytest.raises(ValueError, match="R=256"):
        MergedLossHistogram(capacity=128).load_state_dict(history.state_dict())


def test_a_checkpoint_from_before_chunk_steps_is_refused_in_one_line():
    # Before 2026-11-30 the histogram kept whole exchanges' counts ("rounds").
    before = {"rounds": torch.zeros(2, LOSS_BINS, dtype=torch.int64), "pending": torch.zeros(LOSS_BINS),
              "merged_rounds": 3, "merge_seconds": 0.0}
    with pytest.raises(ValueError, match="before 2026-11-30"):
        MergedLossHistogram(1024, world_size=2).load_state_dict(before)


@pytest.mark.parametrize("world, rank", [(1, 0), (2, 1), (4, 0), (4, 3)])
def test_where_every_rank_draws_the_same_chunks_a_rank_ranks_exactly_as_one_process_does(world, rank):
    """The rule by hand: one process ranks every rank's chunk in turn, step by step and rank by rank,
    against its last R losses. A rank knows the merged steps and estimates the other ranks' chunks
    since by its own of the same step; where they are the same chunks the estimate is exact, so its
    ranks are one process's exactly (R = 9, three chunks of 3, is not a whole number of steps from 2
    ranks on: the oldest step counts in part, a whole number of its chunks). Losses are powers of
    two, each alone in its bin, so bins lose nothing."""
    generator = torch.Generator().manual_seed(world + rank)
    history = MergedLossHistogram(capacity=9, world_size=world, rank=rank)
    one = LossHistory(9)
    probe, ties = 2.0 ** torch.arange(-8, 9).float(), torch.rand(17, generator=generator)
    for exchange in range(4):
        for step in range(3):
            chunk = 2.0 ** torch.randint(-8, 9, (3,), generator=generator).float()
            for _ in range(rank + 1):
                one.extend(chunk)
            history.extend(chunk)
            assert torch.allclose(history.ranks(probe, ties), one.ranks(probe, ties), atol=1e-6), (exchange, step)
            for _ in range(world - rank - 1):
                one.extend(chunk)
        merged = history.take_round()
        history.merge([merged] * world)
        assert torch.allclose(history.ranks(probe, ties), one.ranks(probe, ties), atol=1e-6), exchange


# The largest gap in a chunk allowed: at the default b (128 over the ranks) the 0.01; at 128 on each
# rank (--batch-size 128) the estimate covers more of the window, which grows with the ranks.
DROP_GAP_AT_MOST = {None: {2: 0.01, 4: 0.01, 8: 0.01}, 128: {2: 0.01, 4: 0.015, 8: 0.03}}


@pytest.mark.parametrize("batch_size", [None, 128], ids=["default-b", "128-each"])
@pytest.mark.parametrize("fixed_count", [False, True], ids=["per-example-draw", "fixed-count"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_after_a_20x_drop_ranks_keep_what_one_process_keeps_in_every_chunk(world, fixed_count, batch_size):
    """The drop replayed: the losses fall 20x at the first chunk of exchange 8. One process's ring fills
    with the new low losses chunk by chunk (it keeps 0.01-0.15 of the drop's first chunk, back near a
    third within 3-8 chunks); the ranks, which estimate the other ranks' chunks of the exchange by their
    own, keep the same in every chunk of it. Before, they ranked their new losses against the last
    exchange's old ones: 4 ranks kept 0.012, 0.022 and 0.038 where one process kept 0.061, 0.226 and 0.336.
    What is left is the estimate's noise, the same before the drop as after: a chunk's expected kept
    fraction within 0.006, 0.007 and 0.008 at 2, 4 and 8 ranks at the default b, and 0.006, 0.011 and
    0.025 at 128 on each rank, where an exchange's window reaches past R and a rank estimates more of it
    from its own chunks (all chunks, 3 seeds; BENCHMARKS.md, "Many ranks keep what one process keeps")."""
    from raysb.bench.cdf_load import after_a_drop

    means = after_a_drop(world, fixed_count, batch_size=batch_size)
    drop = 8 * 3  # the first chunk of exchange 8
    # One process: the drop, then back toward s.
    assert means[drop][0] < 0.2 and max(alone for alone, _ in means[drop:drop + 8]) > 0.3
    gaps = [abs(alone - together) for alone, together in means[3:]]
    assert max(gaps) < DROP_GAP_AT_MOST[batch_size][world]
    assert sum(abs(alone - together) for alone, together in means[drop:drop + 3]) / 3 < 0.01
