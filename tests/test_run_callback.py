"""The epoch loop's callbacks on two lockstep ranks (threads): the collectives every rank must call
run in the loop, so a rank whose callback does nothing neither hangs the other nor parts from it."""

import torch
from test_data import make_dataset
from test_host_syncs import engine_config
from test_lockstep import run_ranks

from raysb.data.shards import MemoryShard
from raysb.training.builders import build_engine
from raysb.training.collapse import CollapseGuard
from raysb.training.loop import run_epochs
from raysb.training.outputs import MetricsWriter
from raysb.training.run_callback import RunCallback
from raysb.training.selection.merged_histogram import MergedLossHistogram
from raysb.training.selection.counts import COUNTER_NAMES

EXAMPLES = 320
WORLD = 2


class WritingRank(RunCallback):
    """Rank 0: writes the outputs and hears of every epoch."""

    def __init__(self):
        self.epochs = []

    def after_epoch(self, epoch, row, stopped):
        self.epochs.append((epoch, row is not None, stopped))

    def summary_extras(self):
        return {"epochs_heard": len(self.epochs)}


class SilentRank(RunCallback):
    """Rank 1: every event left as the base's no-op."""

    writes_outputs = False


def two_ranks(tmp_path, epochs: int) -> list:
    """Each rank's summary, its own counts and its callback after `run_epochs` on two thread ranks."""
    config = engine_config("sb", workers=WORLD, epochs=epochs, out=str(tmp_path), progress_seconds=0)
    settings = config.settings()
    test_data = make_dataset(n=64, num_classes=4, seed=1)

    def rank(collective):
        r = collective.rank
        torch.manual_seed(0)
        history = MergedLossHistogram(config.history_size, world_size=WORLD, rank=r)
        shard = MemoryShard(make_dataset(n=EXAMPLES, num_classes=4), lambda order: order[r::WORLD])
        engine = build_engine(settings, shard, torch.device("cpu"), history=history, collective=collective)
        callback = WritingRank() if r == 0 else SilentRank()
        result = run_epochs(engine, settings.run, test_data, torch.empty(0, dtype=torch.int64),
                            MetricsWriter(tmp_path / "metrics.parquet"), lambda line: None, callback)
        return result.summary, engine.progress_counts(), callback

    return run_ranks(WORLD, rank)


def test_a_rank_whose_callback_does_nothing_neither_hangs_the_writer_nor_differs_in_its_totals(tmp_path):
    (summary_0, own_0, writer), (summary_1, own_1, _) = two_ranks(tmp_path, epochs=2)
    assert summary_0["status"] == summary_1["status"] == "completed"
    assert writer.epochs == [(0, True, False), (1, True, False)] and summary_0["epochs_heard"] == 2
    assert "epochs_heard" not in summary_1
    # The run's totals, on both ranks: examples summed over the ranks, lockstep steps taken once.
    assert {name: summary_0[name] for name in COUNTER_NAMES} == {name: summary_1[name] for name in COUNTER_NAMES}
    assert summary_0["examples_considered"] == own_0["examples_considered"] + own_1["examples_considered"] == EXAMPLES * 2
    assert summary_0["optimizer_steps"] == own_0["optimizer_steps"] == own_1["optimizer_steps"] > 0


def test_the_writers_collapse_verdict_stops_a_silent_rank_in_the_same_epoch(tmp_path, monkeypatch):
    # Only the writer evaluates: its guard calls the collapse after the second epoch. A rank left
    # training would hang DDP. (A real collapse, at lr 3, is tests/test_stability.py's, in one process;
    # on Ray Train the verdict travels by the same broadcast this collective stands in for.)
    monkeypatch.setattr(CollapseGuard, "update", lambda self, epoch, error: "collapsed" if epoch == 2 else None)
    (summary_0, own_0, writer), (summary_1, own_1, _) = two_ranks(tmp_path, epochs=4)
    assert writer.epochs == [(0, True, False), (1, True, True)]
    assert summary_0["status"] == summary_1["status"] == "diverged"
    assert summary_0["error"] == summary_1["error"] == "collapsed"
    assert own_0["optimizer_steps"] == own_1["optimizer_steps"] == summary_1["optimizer_steps"]
