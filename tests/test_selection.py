import math

import pytest
import torch

from raysb.core.keep_rule import (
    LossHistory,
    NonFiniteLossError,
    Selector,
    fixed_count_inclusion,
    keep_probabilities,
    percentile_ranks,
    staleness_weights,
    systematic_sample,
)
from raysb.core.selectivity import beta_from_selectivity, resolve_beta, selectivity_from_beta


def realistic_loss_stream(steps: int, batch: int, seed: int = 0):
    """Cross-entropy-like losses: heavy-tailed, shrinking as training goes on."""
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        scale = 2.0 * math.exp(-step / steps)
        yield torch.distributions.Exponential(1.0).sample((batch,)) * scale + torch.rand(
            batch, generator=generator
        ) * 1e-3


@pytest.mark.parametrize("beta", [1.0, 2.0, 3.0, 4.0])
def test_kept_fraction_matches_one_over_beta_plus_one(beta):
    torch.manual_seed(int(beta))
    selector = Selector(beta=beta, history_size=1024, seed=int(beta))
    for losses in realistic_loss_stream(steps=400, batch=128):
        selector.keep_mask(losses)
    assert selector.kept_fraction == pytest.approx(1 / (beta + 1), abs=0.02)


def test_high_losses_are_kept_more_often_than_low_ones():
    selector = Selector(selectivity=0.33, seed=3)
    kept_high = kept_low = 0
    for losses in realistic_loss_stream(steps=200, batch=256):
        keep = selector.keep_mask(losses)
        median = losses.median()
        kept_high += int(keep[losses > median].sum())
        kept_low += int(keep[losses <= median].sum())
    assert kept_high > 3 * kept_low


def brute_force_percentile(window: list[float], loss: float, u: float) -> float:
    below = sum(1 for h in window if h < loss)
    equal = sum(1 for h in window if h == loss)
    return (below + u * equal) / len(window)


def test_percentiles_match_brute_force_over_the_last_r_losses():
    generator = torch.Generator().manual_seed(7)
    history = LossHistory(capacity=50)
    seen: list[float] = []
    for _ in range(12):
        # Rounded so ties occur within and across batches.
        batch = (torch.rand(17, generator=generator) * 10).round() / 10
        history.extend(batch)
        seen.extend(batch.tolist())
        window = seen[-50:]
        assert sorted(history.values().tolist()) == pytest.approx(sorted(window))
        u = torch.rand(17, generator=generator)
        ranks = percentile_ranks(history.values(), batch, u)
        expected = [brute_force_percentile(window, l, ui) for l, ui in zip(batch.tolist(), u.tolist())]
        assert ranks.tolist() == pytest.approx(expected)


def test_history_keeps_only_the_last_r_when_a_batch_exceeds_it():
    history = LossHistory(capacity=4)
    history.extend(torch.arange(10.0))
    assert sorted(history.values().tolist()) == [6.0, 7.0, 8.0, 9.0]
    history.extend(torch.tensor([100.0]))
    assert sorted(history.values().tolist()) == [7.0, 8.0, 9.0, 100.0]


def test_all_equal_losses_do_not_collapse_selection():
    for loss_value in (0.0, 1.5):
        selector = Selector(selectivity=0.25, seed=11)
        for _ in range(100):
            selector.keep_mask(torch.full((128,), loss_value))
        assert selector.kept_fraction == pytest.approx(0.25, abs=0.02)


def test_probability_is_percentile_to_the_beta():
    ranks = torch.tensor([0.0, 0.5, 1.0])
    assert keep_probabilities(ranks, 2.0).tolist() == [0.0, 0.25, 1.0]
    assert keep_probabilities(ranks, 2.0, floor=0.1).tolist() == pytest.approx([0.1, 0.25, 1.0])


def test_a_keep_floor_gives_the_easiest_examples_their_share():
    losses = torch.linspace(0.0, 1.0, 1024)
    easiest = losses < 0.1
    kept = Selector(beta=2.0, keep_floor=0.2, seed=0).keep_mask(losses)
    assert kept[easiest].float().mean() == pytest.approx(0.2, abs=0.06)
    assert not Selector(beta=2.0, seed=0).keep_mask(losses)[easiest].float().mean() > 0.02


def test_selectivity_and_beta_are_interchangeable():
    for s in (0.5, 1 / 3, 0.25, 0.2):
        assert selectivity_from_beta(beta_from_selectivity(s)) == pytest.approx(s)
    assert beta_from_selectivity(0.5) == pytest.approx(1.0)
    assert resolve_beta(None, 0.25) == pytest.approx(3.0)
    assert Selector(selectivity=0.2).beta == pytest.approx(4.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"selectivity": 0.0}, "selectivity must be in"),
        ({"selectivity": 1.5}, "selectivity must be in"),
        ({"beta": -1.0}, "beta must be"),
        ({"beta": 2.0, "selectivity": 0.33}, "disagree; give one of them"),
        ({"history_size": 0}, "history size R must be >= 1"),
        ({"keep_floor": 1.0}, "keep_floor must be in"),
    ],
)
def test_bad_selection_settings_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Selector(**kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_loss_raises(bad):
    selector = Selector()
    with pytest.raises(NonFiniteLossError, match="1 of 3 losses are NaN or infinite"):
        selector.keep_mask(torch.tensor([0.1, bad, 0.3]))


def test_huge_finite_losses_are_not_mistaken_for_overflow():
    # Their float32 sum would overflow; the check sums in float64.
    Selector().keep_mask(torch.full((1000,), 3e38))


def test_same_seed_same_selection_and_state_round_trips():
    losses = list(realistic_loss_stream(steps=10, batch=64, seed=5))
    a = Selector(selectivity=0.33, seed=9, history_size=100)
    for batch in losses[:5]:
        a.keep_mask(batch)
    b = Selector(selectivity=0.33, seed=0, history_size=100)
    b.load_state_dict(a.state_dict())
    for batch in losses[5:]:
        assert torch.equal(a.keep_mask(batch), b.keep_mask(batch))
    assert a.kept_fraction == b.kept_fraction


def test_history_written_across_the_ring_end_replays_oldest_first():
    history = LossHistory(capacity=5)
    seen: list[float] = []
    for batch in (torch.arange(3.0), torch.arange(3.0, 7.0), torch.arange(7.0, 9.0)):
        history.extend(batch)  # the second and third batches wrap around the end of the ring
        seen.extend(batch.tolist())
        assert history.chronological().tolist() == seen[-5:]


def test_staleness_weights_are_fresh_over_stale_probability_and_one_for_unselected():
    now = torch.tensor([0.5, 0.1, 0.9, 0.3])
    kept_with = torch.tensor([0.5, 0.4, 0.3, float("nan")])
    assert staleness_weights(now, kept_with).tolist() == pytest.approx([1.0, 0.25, 3.0, 1.0])


def test_fresh_scores_give_every_kept_example_weight_near_one():
    """Scored and trained on the same losses, the correction changes (almost) nothing."""
    selector = Selector(selectivity=1 / 3, seed=0)
    for losses in realistic_loss_stream(20, 128):
        keep, kept_with = selector.keep_mask_and_probabilities(losses)
    weights = staleness_weights(selector.current_keep_probabilities(losses[keep]), kept_with[keep])
    # Each loss ties with its own entry in the history, so the selection's random
    # tie-break and the middle one used now differ by at most 1/(2R) in percentile.
    assert weights.tolist() == pytest.approx([1.0] * int(keep.sum()), rel=0.02, abs=0.02)


def test_current_keep_probabilities_rank_without_drawing_or_remembering():
    selector = Selector(beta=2.0, seed=0)
    selector.keep_mask(torch.arange(100, dtype=torch.float32))
    state = selector.state_dict()
    now = selector.current_keep_probabilities(torch.tensor([-1.0, 49.5, 1000.0]))
    assert now.tolist() == pytest.approx([0.0, 0.25, 1.0])
    assert torch.equal(selector.generator.get_state(), state["generator"])
    assert len(selector.history) == 100 and torch.equal(selector.history.values(), state["history"]["values"][:100])
    assert Selector(beta=2.0).current_keep_probabilities(torch.tensor([0.3])).tolist() == [1.0]  # nothing ranked yet


@pytest.mark.parametrize("probabilities, count, expected", [
    # c (1 + 0.9 + 3 x 0.1) = 2: nothing reaches 1.
    ([1.0, 0.9, 0.1, 0.1, 0.1], 2, [2 / 2.2, 1.8 / 2.2, 0.2 / 2.2, 0.2 / 2.2, 0.2 / 2.2]),
    # c (1 + 4 x 0.2) = 2 would take the first past 1: it is capped, and c 0.8 = 1 shares the rest.
    ([1.0, 0.2, 0.2, 0.2, 0.2], 2, [1.0, 0.25, 0.25, 0.25, 0.25]),
    # The order of the chunk does not matter, nor do probabilities of 0.
    ([0.2, 0.0, 1.0, 0.2, 0.2, 0.2], 2, [0.25, 0.0, 1.0, 0.25, 0.25, 0.25]),
    # Keeping all: every inclusion is 1.
    ([0.5, 0.1, 0.3], 3, [1.0, 1.0, 1.0]),
])
def test_fixed_count_inclusion_is_min_of_one_and_c_p_summing_to_the_count(probabilities, count, expected):
    inclusion = fixed_count_inclusion(torch.tensor(probabilities), count)
    assert inclusion.tolist() == pytest.approx(expected, abs=1e-6)
    assert float(inclusion.sum()) == pytest.approx(count, abs=1e-5)


def test_fixed_count_inclusion_holds_its_sum_with_zeros_and_near_ties():
    """Chunks whose probabilities span many magnitudes, with exact zeros (losses below every
    recorded one) and near ties at the top: the capped ones are exactly 1, the rest c P."""
    generator = torch.Generator().manual_seed(1)
    for trial in range(200):
        probabilities = torch.rand(128, generator=generator) ** (1 + trial % 20)
        probabilities[torch.randperm(128, generator=generator)[: trial % 30]] = 0.0
        probabilities[:3] = 1.0 - 1e-7 * torch.rand(3, generator=generator)
        count = 1 + trial % 60
        inclusion = fixed_count_inclusion(probabilities, count)
        assert float(inclusion.sum()) == pytest.approx(count, abs=1e-4)
        assert float(inclusion.min()) >= 0 and float(inclusion.max()) <= 1
        free = (inclusion < 1) & (probabilities > 1e-30)
        ratios = inclusion[free] / probabilities[free]
        assert float(ratios.max() - ratios.min()) <= 1e-4 * float(ratios.max())


def test_systematic_sampling_keeps_exactly_the_count_at_each_examples_inclusion():
    generator = torch.Generator().manual_seed(0)
    inclusion = fixed_count_inclusion(torch.rand(64, generator=generator) ** 2, 21)
    hits = torch.zeros(64)
    draws = 20_000
    for offset in torch.rand(draws, generator=generator):
        kept = systematic_sample(inclusion, 21, offset)
        assert len(kept) == 21 and len(set(kept.tolist())) == 21
        hits[kept] += 1
    # Each example's frequency is its inclusion probability (binomial sd <= 0.0036 here).
    assert (hits / draws - inclusion).abs().max() < 0.015


def test_a_fixed_count_keeps_round_s_n_of_every_chunk_preferring_high_losses():
    selector = Selector(selectivity=0.33, seed=5)
    kept_high = kept_low = 0
    for losses in realistic_loss_stream(steps=100, batch=128):
        kept, probabilities = selector.kept_positions(losses, fixed_count=True)
        assert len(kept) == round(0.33 * 128) and len(set(kept.tolist())) == len(kept)
        median = losses.median()
        kept_high += int((losses[kept] > median).sum())
        kept_low += int((losses[kept] <= median).sum())
    assert selector.kept_fraction == pytest.approx(round(0.33 * 128) / 128)
    assert kept_high > 3 * kept_low
