"""Host syncs per selection round and per training step: what a GPU waits on, counted on the CPU.

A sync stops the host from queuing the next kernels until the device has caught up;
raysb's round needs one to check the losses finite and one to learn how many
examples it kept, and a step one to agree its loss is finite (before backward, on
every rank). Anything more is overhead a GPU pays every round.
"""

import pytest
import torch
from test_data import make_dataset

from raysb.bench.host_syncs import HostSyncCounter
from raysb.config import TrainConfig
from raysb.data.shards import MemoryShard
from raysb.training.builders import build_engine

EXAMPLES = 320


def counted_epoch(**overrides):
    config = TrainConfig(model_options={"width": 8}, batch_size=16, record_analysis=False, device="cpu", **overrides)
    torch.manual_seed(0)
    engine = build_engine(config, MemoryShard(make_dataset(n=EXAMPLES, num_classes=4)), torch.device("cpu"))
    engine.train_epoch(0)
    steps_before = engine.counters.optimizer_steps
    with HostSyncCounter() as syncs:
        engine.train_epoch(1)
    rounds = -(-EXAMPLES // engine.chunk_size)
    return syncs.by_op, rounds, engine.counters.optimizer_steps - steps_before


@pytest.mark.parametrize("selection_batch_size", [None, 64])
def test_sb_syncs_twice_a_round_and_once_a_step(selection_batch_size):
    by_op, rounds, steps = counted_epoch(strategy="sb", selection_batch_size=selection_batch_size)
    assert steps > 0
    # Per round: the losses' finiteness and the kept examples' positions; per step: the loss.
    assert by_op == {"aten._local_scalar_dense": rounds + steps, "aten.nonzero": rounds}


def test_traditional_syncs_once_a_step():
    by_op, rounds, steps = counted_epoch(strategy="traditional")
    assert by_op == {"aten._local_scalar_dense": steps}


def test_the_counter_sees_value_reads_and_data_sized_outputs():
    x = torch.randn(10)
    with HostSyncCounter() as syncs:
        float(x.sum()), bool((x > 0).any()), x[x > 0], (x > 0).nonzero(), x * 2
    assert syncs.by_op == {"aten._local_scalar_dense": 2, "aten.index (boolean mask)": 1, "aten.nonzero": 1}
