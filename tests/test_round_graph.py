"""SB's selection round as one graph (raysb.training.selection.round_graph).

On a CPU the graph's function runs on its static buffers (Replay.DIRECT): these tests hold a run whose
rounds are captured to the same run decided eagerly, step for step (the kept rows each step trains on,
the weights after every epoch, CDF_R's ring and the random streams), through an epoch's shorter last
chunk, a change of BatchNorm mode, a kept-fraction schedule, a restored checkpoint and a NaN. Where CUDA
is present the same runs replay real graphs.
"""

import copy
import functools
from collections import deque

import pytest
import torch

from raysb.bench.gpu import synthetic_cifar
from raysb.api import train
from raysb.config import TrainConfig
from raysb.core.errors import NonFiniteLossError
from raysb.training.run_engine import ready_engine
from raysb.training import cuda_graphs
from raysb.training.cuda_graphs import CaptureRefused
from raysb.training.selection import round_graph
from raysb.training.selection.round_graph import KeptQueue, RoundGraph

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def built_engine(device: str, examples: int = 200, **overrides):
    """An engine over small CIFAR-shaped images, SB's with a fixed count and its selection captured unless
    `overrides` say otherwise."""
    options = dict(strategy="sb", model="small-cnn", model_options={"width": 8}, batch_size=16,
                   selection_batch_size=24, selectivity=1 / 3, kept_per_chunk="fixed", record_analysis=False,
                   device=device, capture_training=False, capture_selection=True, compile_training=False,
                   crop_padding=2, horizontal_flip=True, lr=0.05, lr_schedule="static", lr_warmup_epochs=0)
    options.update(overrides)
    train_data, _ = synthetic_cifar(examples, 8, 16, seed=0)
    torch.manual_seed(0)
    return ready_engine(TrainConfig(**options).settings(), train_data, torch.device(device))


def sb_engine(device: str, captured: bool, examples: int = 200, **overrides):
    """An SB engine (`built_engine`), its rounds captured or decided eagerly."""
    engine = built_engine(device, examples, **overrides)
    assert isinstance(engine.rounds.round_graph, RoundGraph)
    if not captured:
        engine.rounds.round_graph = None
    return engine


def trained_steps(engine, epochs: range, should_stop=None) -> list[tuple[torch.Tensor, ...]]:
    """Each step's examples (ids, labels, inputs) as the step received them, over `epochs`, each ended early
    where `should_stop(epoch, round_index)` (which must stop each)."""
    steps = []
    train_step = engine.train_step

    def recorded(batch):
        steps.append((batch.sample_ids.cpu().clone(), batch["labels"].cpu().clone(), batch["inputs"].cpu().clone()))
        train_step(batch)

    engine.train_step = recorded
    for epoch in epochs:
        assert engine.train_epoch(epoch, should_stop) == (should_stop is not None)
    engine.train_step = train_step
    return steps


def assert_same_runs(eager, graphed, eager_steps, graphed_steps, device: str) -> None:
    assert len(graphed_steps) == len(eager_steps)
    for index, (mine, theirs) in enumerate(zip(graphed_steps, eager_steps)):
        assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1]), f"step {index}"
        torch.testing.assert_close(mine[2], theirs[2], rtol=0, atol=0, msg=f"step {index}")
    exact = device == "cpu"
    for mine, theirs in zip(graphed.step.model.state_dict().values(), eager.step.model.state_dict().values()):
        torch.testing.assert_close(mine, theirs, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-5)
    mine, theirs = graphed.strategy.selector.state_dict(), eager.strategy.selector.state_dict()
    torch.testing.assert_close(mine["history"]["values"], theirs["history"]["values"],
                               rtol=0 if exact else 1e-4, atol=0 if exact else 1e-5)
    assert (mine["history"]["size"], mine["history"]["next"]) == (theirs["history"]["size"], theirs["history"]["next"])
    assert torch.equal(mine["generator"], theirs["generator"])
    assert (mine["examples_seen"], mine["examples_kept"]) == (theirs["examples_seen"], theirs["examples_kept"])
    assert torch.equal(graphed.feed.augment_generator.get_state(), eager.feed.augment_generator.get_state())
    assert graphed.counters.selection_forward_examples == eager.counters.selection_forward_examples


@pytest.mark.parametrize("kept_per_chunk", ["fixed", "random"])
@pytest.mark.parametrize("device", DEVICES)
def test_captured_rounds_train_on_the_eager_rounds_rows_step_for_step(device, kept_per_chunk, monkeypatch):
    # 200 examples in chunks of 24: eight captured rounds and an eager last one of 8 each epoch; BatchNorm
    # scores with the chunk's statistics through step 5, then with the running ones (a second graph). The
    # per-example draw's counts are learned as each round ends (on CUDA too, here), so its steps are the
    # eager rule's.
    monkeypatch.setattr(round_graph, "CUDA_COUNT_LAG", 0)
    overrides = dict(selection_batchnorm="running-after-warmup", lr_warmup_epochs=0.4, kept_per_chunk=kept_per_chunk)
    eager, graphed = sb_engine(device, False, **overrides), sb_engine(device, True, **overrides)
    replays = []
    decide = RoundGraph.__call__

    def counted(self, chunk, step):
        replays.append(decide(self, chunk, step))
        return replays[-1]

    monkeypatch.setattr(RoundGraph, "__call__", counted)
    eager_steps, graphed_steps = trained_steps(eager, range(3)), trained_steps(graphed, range(3))
    assert_same_runs(eager, graphed, eager_steps, graphed_steps, device)
    assert sum(decided is not None for decided in replays) == 3 * 8
    assert sum(decided is None for decided in replays) == 3  # each epoch's short last chunk
    assert graphed.rounds.round_graph.stats() == {"round_graphs": 2}  # the chunk's statistics, then the running ones
    assert len(eager_steps) >= 9  # steps enough to compare (the per-example draw kept 0.27 here)


@pytest.mark.slow
def test_a_compiled_selection_forward_scores_inside_the_round_graph(monkeypatch):
    # On CUDA the selection forward is compiled where it is captured (compile_selection's default): here
    # dynamo's guards and recompiles on the "eager" backend, through both BatchNorm modes, in the round.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    overrides = dict(compile_selection=True, selection_batchnorm="running-after-warmup", lr_warmup_epochs=0.4)
    eager, graphed = sb_engine("cpu", False, **overrides), sb_engine("cpu", True, **overrides)
    assert graphed.feed.scorer.compiled and graphed.feed.scorer.forward is not graphed.feed.scorer.model
    assert_same_runs(eager, graphed, trained_steps(eager, range(2)), trained_steps(graphed, range(2)), "cpu")
    assert graphed.rounds.round_graph.captures == 2


def test_queued_rows_outlive_their_slots():
    # b = 40 against 8 kept a round, and each epoch's short last chunk (decided eagerly) queues 3 more: the
    # queue's length moves through every residue, and a round's last rows wait five rounds for their step,
    # as long as ceil(b / kept) + 1 slots allow (one slot fewer trains on overwritten rows).
    overrides = dict(batch_size=40, epochs=4)
    eager, graphed = sb_engine("cpu", False, **overrides), sb_engine("cpu", True, **overrides)
    assert_same_runs(eager, graphed, trained_steps(eager, range(4)), trained_steps(graphed, range(4)), "cpu")
    assert graphed.rounds.round_graph.outputs.slot_count == 40 // 8 + 1


def lagged(engine, lag: int):
    """`engine`'s per-example rounds learning each round's kept count `lag` rounds late, as on CUDA."""
    graph = engine.rounds.round_graph
    queue = graph.outputs
    graph.outputs = KeptQueue(graph.rule, engine.feed.shard.data.images.shape[1:], engine.rounds.batch_size,
                              queue.with_probabilities, lag)
    return engine


@pytest.mark.parametrize("examples", [200, 192])  # an eager last chunk of 8, or a captured one
@pytest.mark.parametrize("device", DEVICES)
def test_a_lagged_count_trains_the_same_rows_in_the_same_order_steps_later(device, examples):
    # With the weights fixed (an lr of 1e-30 moves no float32 weight; selection's BatchNorm on the chunk's
    # statistics) every round's losses and draws are
    # the same however late its count is learned: the lagged queue must hand the training queue the eager
    # rule's rows in their order, every step of b whole, none lost at an epoch's end. b = 41 against chunks
    # of 24 nearly all kept (a floor of 0.9): the queue fills to its b + 4 chunks.
    overrides = dict(kept_per_chunk="random", lr=1e-30, selection_batchnorm="batch", batch_size=41, keep_floor=0.9)
    eager = sb_engine(device, False, examples, **overrides)
    graphed = lagged(sb_engine(device, True, examples, **overrides), 2)
    assert graphed.rounds.round_graph.outputs.capacity == 41 + 4 * 24
    assert_same_runs(eager, graphed, trained_steps(eager, range(3)), trained_steps(graphed, range(3)), device)
    assert graphed.rounds.round_graph.outputs.in_flight == deque()
    assert graphed.counters.examples_kept == eager.counters.examples_kept


def test_an_epoch_stopped_early_queues_the_rows_whose_count_was_still_in_flight():
    # The weights fixed as above, and no staleness correction (its weights rank against CDF_R as each step
    # finds it, which a lagged count reaches later). Stopped at its fifth round, the lagged epoch has trained
    # fewer steps (its last counts came with the stop), but its rows trained and queued, what a checkpoint
    # keeps, are the eager epoch's in their order; the next epoch trains on as the eager one.
    overrides = dict(kept_per_chunk="random", lr=1e-30, selection_batchnorm="batch", staleness_correction="never")
    eager, graphed = sb_engine("cpu", False, **overrides), lagged(sb_engine("cpu", True, **overrides), 2)

    def stopped_then_whole(engine):
        stopped = trained_steps(engine, range(1), should_stop=lambda epoch, round_index: round_index == 4)
        return stopped, engine.rounds.exchange.state_dict()["remainder"], trained_steps(engine, range(1, 2))

    (eager_stopped, eager_queued, eager_next), (graphed_stopped, graphed_queued, graphed_next) = (
        stopped_then_whole(eager), stopped_then_whole(graphed))
    assert graphed.rounds.round_graph.outputs.in_flight == deque()
    assert torch.equal(torch.cat([*(step[0] for step in graphed_stopped), graphed_queued.sample_ids]),
                       torch.cat([*(step[0] for step in eager_stopped), eager_queued.sample_ids]))
    assert_same_runs(eager, graphed, eager_stopped + eager_next, graphed_stopped + graphed_next, "cpu")


def test_a_capture_mid_run_leaves_the_rows_still_queued_as_they_were(monkeypatch):
    # A round keeps 40 rows of a chunk of 120 for steps of 16: 8 rows wait in the slot their round wrote.
    # BatchNorm switches to the running statistics at step 6, while they wait: the second graph's capture
    # runs the round 3 times first (4 on the CPU), each writing where the rounds ahead would (the device
    # queue's rounds too, undone the same way: OutputRows). Undone, or the waiting rows train as the warmup's.
    overrides = dict(batch_size=16, selection_batch_size=120, selection_batchnorm="running-after-warmup",
                     lr_warmup_epochs=0.4)
    eager, graphed = sb_engine("cpu", False, 240, **overrides), sb_engine("cpu", True, 240, **overrides)
    queued_at_captures = []
    capture = RoundGraph._capture

    def counted(self, norms):
        queued_at_captures.append(graphed.rounds.queued())
        return capture(self, norms)

    monkeypatch.setattr(RoundGraph, "_capture", counted)
    assert_same_runs(eager, graphed, trained_steps(eager, range(2)), trained_steps(graphed, range(2)), "cpu")
    assert queued_at_captures[0] == 0 and queued_at_captures[1] > 0


def test_a_kept_fraction_schedule_captures_again_while_rows_kept_under_the_old_count_wait():
    overrides = dict(kept_fraction_schedule="lr", lr_schedule="cosine", epochs=4, batch_size=40)
    eager, graphed = sb_engine("cpu", False, **overrides), sb_engine("cpu", True, **overrides)
    assert_same_runs(eager, graphed, trained_steps(eager, range(4)), trained_steps(graphed, range(4)), "cpu")
    assert graphed.rounds.round_graph.captures == 4  # s rises every epoch: a new count, new output slots


@pytest.mark.parametrize("kept_per_chunk", ["fixed", "random"])
def test_a_restored_checkpoint_goes_on_as_the_straight_run(kept_per_chunk):
    straight = sb_engine("cpu", True, kept_per_chunk=kept_per_chunk)
    trained_steps(straight, range(1))
    # Copied, as a checkpoint file copies them: a state dict's tensors are the live ones (an optimizer's
    # momentum loaded from one would be shared by both engines).
    shared, rank = copy.deepcopy(straight.shared_state_dict()), copy.deepcopy(straight.rank_state_dict())
    resumed = sb_engine("cpu", True, kept_per_chunk=kept_per_chunk)
    resumed.load_state_dict(shared, rank)
    assert_same_runs(straight, resumed, trained_steps(straight, range(1, 3)), trained_steps(resumed, range(1, 3)),
                     "cpu")


def test_a_nan_in_a_captured_rounds_losses_stops_the_run_naming_the_round():
    engine = sb_engine("cpu", True)
    engine.train_epoch(0)
    with torch.no_grad():
        next(engine.step.model.parameters()).fill_(float("nan"))
    with pytest.raises(NonFiniteLossError, match="selection losses are not finite at epoch 2, round 1"):
        engine.train_epoch(1)


@pytest.mark.parametrize("why, overrides", [
    ("stale-sb records its pass's losses", dict(strategy="stale-sb")),
    ("the per-example draw's rule has chunks of R or more", dict(kept_per_chunk="random", history_size=24)),
    ("cutout draws as it augments", dict(cutout=4)),
    ("scores ahead of training", dict(pipeline_selection="thread")),
    ("eager unless captured", dict(capture_selection=False)),
])
def test_rounds_the_graph_cannot_take_run_eagerly(why, overrides):
    assert built_engine("cpu", 64, **overrides).rounds.round_graph is None, why


def test_a_recorded_trace_leaves_the_rounds_to_the_eager_path():
    traced = sb_engine("cpu", True, record_analysis=True)
    trained_steps(traced, range(1))
    assert traced.rounds.round_graph.captures == 0  # the trace reads every rank and P: decided eagerly
    assert traced.trace is not None


@pytest.mark.parametrize("kept_per_chunk", ["fixed", "random"])
def test_a_round_the_device_refuses_to_capture_runs_eagerly_with_its_state_as_it_was(kept_per_chunk, monkeypatch):
    def refused(self, before_capture=lambda: None):
        for _ in range(cuda_graphs.WARMUP_CALLS):
            self.function()  # the warmup writes the ring, the slots and the kept count, as a real capture's does
        raise CaptureRefused("RuntimeError: operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs.GraphedFunction, "capture", refused)
    eager, graphed = sb_engine("cpu", False, kept_per_chunk=kept_per_chunk), sb_engine("cpu", True, kept_per_chunk=kept_per_chunk)
    assert_same_runs(eager, graphed, trained_steps(eager, range(2)), trained_steps(graphed, range(2)), "cpu")
    assert graphed.rounds.round_graph.stats() == {
        "round_graphs": 0, "round_capture_refused": "RuntimeError: operation not permitted when stream is capturing"}


@pytest.mark.slow
def test_an_sb_run_with_captured_rounds_trains_as_the_eager_run_and_resumes(tmp_path, cifar_shaped_dir, monkeypatch):
    base = dict(dataset="parquet", data_dir=cifar_shaped_dir, strategy="sb", kept_per_chunk="fixed", batch_size=32,
                model_options={"width": 8}, record_analysis=False, progress_seconds=0, device="cpu",
                lr_schedule="static", capture_selection=True, crop_padding=4, horizontal_flip=True)

    def run(name: str, epochs: int, **extra):
        return train(TrainConfig(**base, epochs=epochs, out=str(tmp_path / name), **extra), log=lambda line: None)

    with monkeypatch.context() as eager_only:
        eager_only.setattr("raysb.training.builders.capture_rounds", lambda *args: None)
        eager_only.setattr("raysb.training.builders.capture_keep_rule", lambda *args: None)
        eager = run("eager", 3)
    graphed = run("graph", 3)
    for eager_row, graph_row in zip(eager.metrics, graphed.metrics, strict=True):
        assert graph_row["backprop_examples"] == eager_row["backprop_examples"]
        assert graph_row["train_loss"] == eager_row["train_loss"]
    assert graphed.summary["final_test_error"] == eager.summary["final_test_error"]
    run("resumed", 2)
    resumed = run("resumed", 3, resume=True)
    assert resumed.metrics[-1]["train_loss"] == graphed.metrics[-1]["train_loss"]
    assert resumed.summary["final_test_error"] == graphed.summary["final_test_error"]
    assert graphed.summary["round_graphs"] == 1 and "round_graphs" not in eager.summary
