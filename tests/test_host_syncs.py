"""Host syncs per selection round and per training step: what a GPU waits on, counted on the CPU.

A sync stops the host from queuing the next kernels until the device has caught up. The
counter (raysb.bench.host_syncs) follows the tensors that would live on the GPU (the model,
the optimizer's state, the shard's data, the selection state a strategy keeps there, and all
computed from them) and counts the reads, host copies and data-sized outputs of those. What
a round may do is wait for nothing: every strategy decides without reading the device, and
the rounds read the device only where they read the training losses (every 16 steps on a
GPU, and at an epoch's end), bringing the selection losses' finiteness, recorded losses and
Kath18's gate along. Lockstep ranks add one copy an exchange (the kept examples' ids).
"""

import threading

import pytest
import torch
from test_data import make_dataset
from test_lockstep import ThreadCollective

from raysb.bench.host_syncs import HostSyncCounter, engine_device_tensors
from raysb.config import TrainConfig
from raysb.core.errors import NonFiniteLossError
from raysb.core.strategy_table import STRATEGIES
from raysb.data.shards import MemoryShard
from raysb.training.builders import build_engine
from raysb.training.run_engine import ready_engine
from raysb.training.selection.merged_histogram import MergedLossHistogram

EXAMPLES = 320
# A GPU engine reads its training losses every 16 steps (raysb.training.engine).
GPU_READS = 16


def engine_config(strategy: str, workers: int | None = None, **overrides) -> TrainConfig:
    # On a GPU `kept_per_chunk` auto is fixed; Kath18's threshold is low enough that its gate opens.
    values = dict(model_options={"width": 8}, batch_size=16, record_analysis=False, device="cpu", strategy=strategy,
                  kept_per_chunk="fixed", workers=workers, kath18_tau_threshold=0.5 if strategy == "kath18" else None)
    return TrainConfig(**{**values, **overrides})


def small_engine(loss_read_every=1, **overrides):
    config = TrainConfig(model_options={"width": 8}, batch_size=16, record_analysis=False, device="cpu", **overrides)
    torch.manual_seed(0)
    engine = build_engine(config.settings(), MemoryShard(make_dataset(n=EXAMPLES, num_classes=4)), torch.device("cpu"))
    engine.rounds.reads.every = loss_read_every  # a GPU engine's is 16
    return engine


def counted_epochs(engine, epochs=(1, 2, 3)) -> tuple[dict, dict]:
    """Syncs over `epochs`, after a first epoch left uncounted; and what else happened in them:
    the rounds' loss reads, the rounds, the optimizer steps and the lockstep exchanges."""
    reads = [0]
    read = engine.rounds.reads.read

    def counted_read(*args):
        reads[0] += 1
        read(*args)

    engine.rounds.reads.read = counted_read
    engine.train_epoch(0)
    reads[0] = 0
    steps_before = engine.counters.optimizer_steps
    exchanges_before = getattr(engine.rounds.exchange, "rounds", 0)
    with HostSyncCounter(engine_device_tensors(engine)) as syncs:
        for epoch in epochs:
            engine.train_epoch(epoch)
    return dict(syncs.by_op), {
        "reads": reads[0],
        "rounds": len(epochs) * -(-engine.shard.num_examples // engine.chunk_size),
        "steps": engine.counters.optimizer_steps - steps_before,
        "exchanges": getattr(engine.rounds.exchange, "rounds", 0) - exchanges_before,
    }


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_no_round_of_any_strategy_waits_for_the_device(strategy):
    torch.manual_seed(0)
    # Built as a run builds it (rho-loss's held-out split and irreducible losses): every strategy in the table.
    engine = ready_engine(engine_config(strategy).settings(), make_dataset(n=EXAMPLES, num_classes=4),
                          torch.device("cpu"))
    engine.rounds.reads.every = GPU_READS
    by_op, seen = counted_epochs(engine)
    assert seen["steps"] > 0 and seen["rounds"] > seen["reads"]
    # Nothing but copies at the loss reads: one for the losses (with the selection losses'
    # finiteness), one more where the strategy brings its records or Kath18 its gate along.
    assert set(by_op) <= {"aten._to_copy"} and 0 < by_op["aten._to_copy"] <= 2 * seen["reads"]
    assert seen["reads"] <= seen["steps"] // GPU_READS + 3


def test_the_papers_random_kept_count_reads_each_rounds_count():
    torch.manual_seed(0)
    engine = build_engine(engine_config("sb", kept_per_chunk="random").settings(),
                          MemoryShard(make_dataset(n=EXAMPLES, num_classes=4)), torch.device("cpu"))
    engine.rounds.reads.every = GPU_READS
    by_op, seen = counted_epochs(engine)
    assert by_op == {"aten.nonzero": seen["rounds"], "aten._to_copy": seen["reads"]}


def test_the_papers_draw_in_sbs_round_graph_reads_no_count_of_its_own():
    # SB's round as one graph (raysb.training.selection.round_graph) queues the per-example draw's kept rows
    # on the device and copies their count to pinned memory without a wait; the host reads it rounds later
    # (on CUDA after an event two rounds old), through memory it shares: nothing left but the loss reads.
    torch.manual_seed(0)
    engine = build_engine(engine_config("sb", kept_per_chunk="random", capture_selection=True).settings(),
                          MemoryShard(make_dataset(n=EXAMPLES, num_classes=4)), torch.device("cpu"))
    engine.rounds.reads.every = GPU_READS
    by_op, seen = counted_epochs(engine)
    assert engine.rounds.round_graph.captures > 0
    assert by_op == {"aten._to_copy": seen["reads"]}


def test_lockstep_ranks_copy_to_the_host_once_an_exchange_and_at_their_loss_reads():
    shared = {"slots": [None] * 2, "barrier": threading.Barrier(2)}
    results, errors = [None, None], []

    def rank(r: int):
        try:
            config = engine_config("sb", workers=2)
            torch.manual_seed(0)
            data = make_dataset(n=EXAMPLES, num_classes=4)
            history = MergedLossHistogram(config.history_size, world_size=2, rank=r)
            engine = build_engine(config.settings(), MemoryShard(data, lambda order: order[r::2]), torch.device("cpu"),
                                  history=history, collective=ThreadCollective(r, 2, shared))
            engine.rounds.reads.every = GPU_READS
            results[r] = counted_epochs(engine)
        except Exception as error:  # surfaced below
            errors.append(error)
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    (by_op, seen), (other_by_op, other_seen) = results
    assert by_op == other_by_op and seen == other_seen
    # A copy an exchange (ranks exchange when each holds about a batch: about one a step) and
    # one a loss read.
    assert by_op == {"aten._to_copy": seen["exchanges"] + seen["reads"]}
    assert seen["exchanges"] <= 1.5 * seen["steps"] + 3


def test_losses_read_every_k_steps_sync_once_per_k_and_sum_the_same():
    every_step = small_engine(strategy="traditional")
    every_step.train_epoch(0)
    engine = small_engine(loss_read_every=4, strategy="traditional")
    engine.train_epoch(0)
    with HostSyncCounter(engine_device_tensors(engine)) as syncs:
        engine.train_epoch(1)
    every_step.train_epoch(1)
    assert syncs.by_op == {"aten._to_copy": 5}  # 20 steps, read 4 at a time
    assert engine.progress_counts()["epoch_loss_sum"] == pytest.approx(
        every_step.progress_counts()["epoch_loss_sum"], rel=1e-12)


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


def test_a_non_finite_selection_loss_is_read_with_the_training_losses_and_names_its_round():
    engine = small_engine(loss_read_every=GPU_READS, strategy="sb", kept_per_chunk="fixed")
    engine.train_epoch(0)
    score, rounds = engine.feed.score, []

    def nan_in_fourth_round(batch):
        rounds.append(1)
        losses = score(batch)
        return losses * float("nan") if len(rounds) == 4 else losses

    engine.feed.score = nan_in_fourth_round
    with pytest.raises(NonFiniteLossError, match=r"selection losses are not finite at epoch 2, round 4;"):
        engine.train_epoch(1)
    # No step reached 16: the epoch's last read found it, after every round had run.
    assert len(rounds) == EXAMPLES // 16


def test_the_counter_sees_reads_copies_and_data_sized_outputs_of_device_tensors_only():
    on_device, on_host = torch.randn(10), torch.randn(10)
    with HostSyncCounter([on_device]) as syncs:
        derived = on_device * 2
        float(derived.sum()), bool((derived > 0).any()), derived[derived > 0], (derived > 0).nonzero()
        copied = derived.to("cpu", copy=True)  # raysb.core.transfer.to_host: a GPU waits for it
        float(copied.sum()), on_host[on_host > 0], (on_host > 0).nonzero()
    assert syncs.by_op == {"aten._local_scalar_dense": 2, "aten.index (boolean mask)": 1, "aten.nonzero": 1,
                           "aten._to_copy": 1}
