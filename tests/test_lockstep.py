"""Lockstep batching and the shared CDF, with ranks simulated by threads."""

import threading

import pytest
import torch

from raysb.batch_former import Batch
from raysb.batching import LockstepBatching
from raysb.collective import Collective
from raysb.selection import LossHistory, percentile_ranks
from raysb.strategies import LossTable


class ThreadCollective(Collective):
    """all_gather among threads of one process, through a barrier."""

    def __init__(self, rank: int, world_size: int, shared: dict):
        self.rank, self.world_size, self.shared = rank, world_size, shared

    def all_gather(self, tensor, length_bound=None):
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = tensor.clone()
        barrier.wait()
        gathered = list(slots)
        barrier.wait()
        return gathered

    def all_true(self, flag):
        return all(bool(t[0]) for t in self.all_gather(torch.tensor([float(flag)])))


def batch_of(ids: torch.Tensor) -> Batch:
    return Batch(ids, ids.float().unsqueeze(1), ids % 10)


def run_ranks(world, target):
    shared = {"slots": [None] * world, "barrier": threading.Barrier(world)}
    results, errors = [None] * world, []

    def body(rank):
        try:
            results[rank] = target(ThreadCollective(rank, world, shared))
        except Exception as error:  # surfaced to the test below
            errors.append(error)
            shared["barrier"].abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def test_skewed_ranks_take_equal_steps_and_lose_nothing():
    world, b, rounds, chunk = 3, 8, 40, 32
    keep_rates = [0.9, 0.05, 0.3]  # one busy rank, one idle, one in between

    def rank_body(collective):
        rank = collective.rank
        generator = torch.Generator().manual_seed(rank)
        batching = LockstepBatching(collective, b, load_ids=batch_of)
        kept_ids, trained = [], []
        for round_index in range(rounds):
            ids = torch.arange(chunk) + 10_000 * rank + chunk * round_index
            keep = torch.rand(chunk, generator=generator) < keep_rates[rank]
            kept_ids.extend(ids[keep].tolist())
            for batch in batching.ready_batches(batch_of(ids[keep]), False, None):
                assert len(batch) == b
                trained.append(batch.sample_ids.tolist())
        return kept_ids, trained, batching.queue_ids.tolist()

    results = run_ranks(world, rank_body)
    steps = [len(trained) for _, trained, _ in results]
    assert len(set(steps)) == 1 and steps[0] > 0
    all_kept = sorted(i for kept, _, _ in results for i in kept)
    all_trained = [i for _, trained, _ in results for batch in trained for i in batch]
    remainder = results[0][2]
    assert all(r[2] == remainder for r in results), "every rank holds the same queue"
    assert len(remainder) < world * b
    assert sorted(all_trained + remainder) == all_kept  # nothing dropped, nothing twice
    # the idle rank trained on examples the busy rank kept
    assert any(i < 10_000 for batch in results[1][1] for i in batch)


def test_stop_vote_of_rank_zero_stops_every_rank_in_the_same_round():
    def rank_body(collective):
        batching = LockstepBatching(collective, 4, load_ids=batch_of)
        for round_index in range(10):
            ids = torch.arange(8) + 100 * round_index + 10_000 * collective.rank
            # only rank 0's clock counts; rank 1 votes stop early and is ignored
            vote = round_index >= 5 if collective.rank == 0 else round_index >= 1
            list(batching.ready_batches(batch_of(ids), vote, None))
            if batching.stop_requested:
                return round_index
        return None

    assert run_ranks(2, rank_body) == [5, 5]


def test_an_error_on_one_rank_stops_all_ranks_without_a_hang():
    def rank_body(collective):
        batching = LockstepBatching(collective, 4, load_ids=batch_of)
        error = "losses are NaN at epoch 1, step 3" if collective.rank == 1 else None
        list(batching.ready_batches(batch_of(torch.arange(8) + 100 * collective.rank), False, error))

    with pytest.raises(Exception, match=r"rank\(s\) \[1\] stopped the run"):
        run_ranks(2, rank_body)


def test_stale_losses_reach_every_rank():
    ids = torch.arange(20)

    def rank_body(collective):
        table = LossTable(ids)
        batching = LockstepBatching(collective, 4, load_ids=batch_of, loss_table=table)
        mine = ids[collective.rank :: 2]
        table.record(mine, mine.float() / 10)
        list(batching.ready_batches(batch_of(mine[:0]), False, None))
        return table.lookup(ids)

    for losses in run_ranks(2, rank_body):
        assert losses.tolist() == pytest.approx((ids.float() / 10).tolist())


def test_ranks_with_different_losses_share_one_percentile_function(ray_session):
    from raysb.histogram import LossHistogramActor, SharedLossHistory

    actor = LossHistogramActor.remote(2, 256)
    probe = torch.linspace(0, 5, 50)
    tie_break = torch.full_like(probe, 0.5)

    def rank_body(collective):
        rank = collective.rank
        history = SharedLossHistory(actor, rank, 256, sync_interval=2, lag=1)
        generator = torch.Generator().manual_seed(rank)
        local = LossHistory(256)
        views = []
        for _ in range(12):
            # rank 0 sees hard examples, rank 1 easy ones
            losses = torch.rand(64, generator=generator) * (4.0 if rank == 0 else 0.5)
            history.extend(losses)
            local.extend(losses)
            views.append(percentile_ranks(history.values(), probe, tie_break))
            collective.all_gather(torch.zeros(1))  # keep the simulated ranks in step
        return views, percentile_ranks(local.values(), probe, tie_break), history.stats()

    (views0, local0, stats0), (views1, local1, stats1) = run_ranks(2, rank_body)
    for a, b in zip(views0, views1):
        assert torch.equal(a, b)
    assert not torch.equal(local0, local1), "private histories would disagree"
    assert stats0["mean_staleness_rounds"] >= 1


def test_histogram_actor_loss_falls_back_without_hanging(ray_session):
    from raysb.histogram import LossHistogramActor, SharedLossHistory

    actor = LossHistogramActor.remote(1, 128)
    lines = []
    history = SharedLossHistory(actor, 0, 128, sync_interval=1, lag=0, timeout_s=10, log=lines.append)
    for _ in range(3):
        history.extend(torch.rand(16))
    ray_session.kill(actor)
    for _ in range(3):
        history.extend(torch.rand(16))
    assert history.stats()["actor_failed_at_round"] == 3
    assert history.values().numel() == 96  # this rank's own history
    assert "unavailable" in lines[0]
