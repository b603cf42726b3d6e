"""Host syncs per selection round and per training step: what a GPU waits on, counted on the CPU.

A sync stops the host from queuing the next kernels until the device has caught up;
raysb's round needs one to check the losses finite and one to learn how many
examples it kept. Training losses are read (summed, and agreed finite on every rank)
before each backward on a CPU, where nothing waits, and every 16 steps on a GPU.
Anything more is overhead a GPU pays every round.
"""

import pytest
import torch
from test_data import make_dataset

from raysb.core.errors import NonFiniteLossError
from raysb.bench.host_syncs import HostSyncCounter
from raysb.config import TrainConfig
from raysb.data.shards import MemoryShard
from raysb.training.builders import build_engine

EXAMPLES = 320


def small_engine(loss_read_every=1, **overrides):
    config = TrainConfig(model_options={"width": 8}, batch_size=16, record_analysis=False, device="cpu", **overrides)
    torch.manual_seed(0)
    engine = build_engine(config, MemoryShard(make_dataset(n=EXAMPLES, num_classes=4)), torch.device("cpu"))
    engine.rounds.loss_read_every = loss_read_every  # a GPU engine's is 16
    return engine


def counted_epoch(loss_read_every=1, **overrides):
    engine = small_engine(loss_read_every, **overrides)
    engine.train_epoch(0)
    steps_before = engine.counters.optimizer_steps
    with HostSyncCounter() as syncs:
        engine.train_epoch(1)
    rounds = -(-EXAMPLES // engine.chunk_size)
    return syncs.by_op, rounds, engine.counters.optimizer_steps - steps_before, engine.progress_counts()


@pytest.mark.parametrize("selection_batch_size", [None, 64])
def test_sb_syncs_twice_a_round_and_once_a_step(selection_batch_size):
    by_op, rounds, steps, _ = counted_epoch(strategy="sb", selection_batch_size=selection_batch_size)
    assert steps > 0
    # Per round: the losses' finiteness and the kept examples' positions; per step: the loss.
    assert by_op == {"aten._local_scalar_dense": rounds + steps, "aten.nonzero": rounds}


def test_traditional_syncs_once_a_step():
    by_op, rounds, steps, _ = counted_epoch(strategy="traditional")
    assert by_op == {"aten._local_scalar_dense": steps}


def test_losses_read_every_k_steps_sync_once_per_k_and_sum_the_same():
    every_step = counted_epoch(strategy="traditional")
    by_op, _, steps, counts = counted_epoch(loss_read_every=4, strategy="traditional")
    assert steps == 20 and by_op == {"aten._local_scalar_dense": 5}
    assert counts["epoch_loss_sum"] == pytest.approx(every_step[3]["epoch_loss_sum"], rel=1e-12)


def test_a_late_read_names_the_step_whose_loss_was_not_finite_and_stops_within_k_steps():
    engine = small_engine(loss_read_every=4, strategy="traditional")
    engine.train_epoch(0)
    loss_fn, calls = engine.rounds.loss_fn, []

    def nan_at_sixth_step(model, batch):
        calls.append(1)
        losses = loss_fn(model, batch)
        return losses * float("nan") if len(calls) == 6 else losses

    engine.rounds.loss_fn = nan_at_sixth_step
    steps_before = engine.counters.optimizer_steps
    with pytest.raises(NonFiniteLossError, match=r"training loss is not finite \(here nan\) at epoch 2, step 6;"):
        engine.train_epoch(1)
    # Read after the 8th step's forward: steps 1-7 were taken, the 8th stopped before its backward.
    assert len(calls) == 8 and engine.counters.optimizer_steps - steps_before == 7


def test_the_counter_sees_value_reads_and_data_sized_outputs():
    x = torch.randn(10)
    with HostSyncCounter() as syncs:
        float(x.sum()), bool((x > 0).any()), x[x > 0], (x > 0).nonzero(), x * 2
    assert syncs.by_op == {"aten._local_scalar_dense": 2, "aten.index (boolean mask)": 1, "aten.nonzero": 1}
