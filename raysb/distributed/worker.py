"""What every Ray Train worker runs: the shared epoch loop on one shard, in lockstep.

Each rank either holds the (small) training set in memory and takes its slice
`order[rank::world]` of each epoch's shared random order, or streams its Ray
Data shard of a Parquet split (data_mode=stream). It scores and selects on its
own device, ranks losses against the shared CDF_R (a loss histogram every round's
exchange merges, raysb.training.selection.merged_histogram), and trains through
`LockstepExchange` so all ranks run the same steps. Rank 0
evaluates, writes the output files and the checkpoints (raysb.distributed.checkpoints);
every rank calls `ray.train.report` exactly once per epoch.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import ray
import ray.train
import ray.train.torch
import torch

from raysb.config import TrainConfig
from raysb.core.settings import DataSettings, Settings
from raysb.data.prepare import prepare_data, split_holdout, to_device
from raysb.data.shards import MemoryShard, stream_shard
from raysb.distributed.checkpoints import restore_checkpoint, save_checkpoint
from raysb.distributed.console import relayed_log
from raysb.distributed.chaos import ChaosRunner
from raysb.models import hand_over_factory
from raysb.training.builders import build_engine
from raysb.training.collective import found_collective
from raysb.training.irreducible_loss import fit_irreducible_losses
from raysb.training.loop import run_epochs
from raysb.training.malloc_tuning import keep_freed_memory_for_reuse
from raysb.training.selection.merged_histogram import MergedLossHistogram
from raysb.training.selection.strategies import hand_over_strategy
from raysb.training.outputs import MetricsWriter
from raysb.training.progress import print_line
from raysb.training.run_callback import RunCallback

# Enough of a Ray node id (56 hex digits) to tell a cluster's nodes apart.
NODE_ID_CHARS = 12
# DDP rebuilds its gradient buckets once, after a wrapper's first backward, in the order the gradients
# became ready. A group restarted from a checkpoint takes its first step with the buckets as first
# built, and the all-reduce then sums a gradient's ranks in another order: from 3 ranks on, that step
# and every one after it differ from the unbroken run's in the last bits. Looking for unused
# parameters turns the rebuild off (a walk of the step's autograd graph, not measurable beside a
# step of the small CNN on 2 ranks), so a restarted run repeats the unbroken one to the digit
# (tests/test_two_nodes.py at 4 workers, tests/test_distributed.py's DDP test).
DDP_OPTIONS = {"find_unused_parameters": True}


def worker_loop(loop_config: dict) -> None:
    """The Ray Train entry point: this rank's whole run. `loop_config`: the run's config values,
    the driver's console relay (raysb.distributed.console), a user's model factory and a user's
    strategy (card and class), if any, and when the driver began the run (time.time())."""
    entered = time.time()
    if loop_config["strategy"] is not None:
        # Before the config is read: its checks look the strategy's card up.
        hand_over_strategy(loop_config["config"]["strategy"], *loop_config["strategy"])
    config = TrainConfig.from_dict(loop_config["config"])
    if loop_config["model_factory"] is not None:
        hand_over_factory(config.model, loop_config["model_factory"])
    settings = config.settings()
    with torch_threads(max(1, int(settings.cluster.cpus_per_worker))):
        rank = RankRun(settings, loop_config["console"])
        # A restored rank counts its start-up from its worker's start: after a restart, the driver's
        # began before time its checkpoint already counts.
        rank.started_at = entered if rank.start_epoch > 0 else loop_config["started_at"]
        rank.run()


@contextmanager
def torch_threads(count: int):
    """`count` intra-op threads for the rank, the process's own count restored after: in Ray Train's
    local mode (`--workers 0`) the rank runs in the caller's process, a notebook's or a test
    session's, whose later work would otherwise run on one thread (a full test suite ran its later
    in-process trainings 1.5x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class RankRun(RunCallback):
    """One rank's run: its shard, the shared CDF_R, the engine, and its part in the epoch loop
    (the loop's callback: rank 0 writes the outputs, every rank reports and checkpoints)."""

    def __init__(self, settings: Settings, console):
        self.run_settings = run = settings.run
        keep_freed_memory_for_reuse()
        self.collective = found_collective()
        self.rank, self.world = self.collective.rank, self.collective.world_size
        self.writes_outputs = self.rank == 0
        self.device = ray.train.torch.get_device() if settings.cluster.gpus_per_worker > 0 else torch.device("cpu")
        self.log = relayed_log(console) if self.rank == 0 else (lambda line: None)
        # Where this worker group landed (rank 0 holds the list): after a node is lost, the
        # restarted group's placement shows here and in summary.json.
        self.nodes = self.collective.gather_object(ray.get_runtime_context().get_node_id()[:NODE_ID_CHARS])
        if self.nodes is not None:
            self.log(f"raysb: {self.world} worker(s) on {len(set(self.nodes))} Ray node(s)")

        torch.manual_seed(run.seed)
        batch_size = settings.optimization.batch_size
        held_out = None  # a held-out split is of in-memory data (the config refuses it streamed)
        if settings.data.data_mode == "stream":
            self.shard, self.test_data, self.flipped_ids = _stream_shard(settings.data, batch_size, self.rank,
                                                                         self.world)
        else:
            self.shard, self.test_data, self.flipped_ids, held_out = _memory_shard(settings.data, batch_size,
                                                                                   self.device, self.rank, self.world)

        # One worker has nobody to share a CDF_R or kept examples with: it trains as a single
        # process does (its own history, a local queue), with no exchange.
        self.alone = alone = self.world == 1
        spec = settings.selection.spec
        self.history = None if alone else MergedLossHistogram(spec.history_size, self.device, self.world,
                                                              self.rank)
        self.engine = build_engine(
            settings,
            self.shard,
            self.device,
            wrap_model=(lambda model: model) if alone else partial(ray.train.torch.prepare_model,
                                                                    parallel_strategy_kwargs=DDP_OPTIONS),
            history=self.history,
            collective=None if alone else self.collective,
            held_out=held_out,
        )
        self.metrics = MetricsWriter(Path(run.out) / "metrics.parquet")
        self.start_epoch = 0
        restored = restore_checkpoint(self.engine, self.collective, self.device, run)
        if restored is not None:
            self.start_epoch = restored.epoch
            # Rows written after this checkpoint (before the failure) are dropped and redone.
            self.metrics = MetricsWriter(Path(run.out) / "metrics.parquet", restored.metrics_rows)
            self.log(f"raysb: resumed from the checkpoint after epoch {self.start_epoch}")
        # Strategies that ask for one run on one worker alone (their cards refuse lockstep ranks).
        fit_irreducible_losses(self.engine, settings)
        self.chaos = ChaosRunner(settings.cluster.chaos, run.out, self.rank, self.world, run.checkpoint_every, print_line)

    def run(self) -> None:
        self.chaos.before_epoch(self.start_epoch + 1, self.poison_weights)
        run_epochs(self.engine, self.run_settings, self.test_data, self.flipped_ids, self.metrics, self.log,
                   callback=self)

    def after_epoch(self, epoch: int, row: dict | None, stopped: bool) -> None:
        """Every rank reports each epoch once (a Ray Train barrier), with a checkpoint when one is due."""
        finished = epoch + 1
        run = self.run_settings
        if stopped or finished == run.epochs or finished % run.checkpoint_every == 0:
            with self.engine.timer.phase("checkpointing"):
                save_checkpoint(self.engine, self.collective, finished, row, self.metrics.rows, self.chaos, run)
        else:
            ray.train.report({"epoch": finished, **(row or {})})
        self.chaos.before_epoch(finished + 1, self.poison_weights)

    def before_round(self, epoch: int, round_index: int) -> None:
        rounds_per_epoch = -(-(self.shard.num_examples // self.world) // self.engine.chunk_size)
        self.chaos.before_round(epoch + 1, round_index, rounds_per_epoch)

    def poison_weights(self) -> None:
        with torch.no_grad():
            next(self.engine.feed.scoring_model.parameters()).fill_(float("nan"))

    def summary_extras(self) -> dict:
        """Every rank's own figures, gathered: the loop asks every rank for its extras, so each reaches
        these collectives."""
        counts = self.engine.progress_counts()
        names = ("optimizer_steps", "examples_kept", "backprop_examples", "selection_forward_examples")
        values = [float(counts[n]) for n in names] + [float(self.engine.lr_checksum)]
        per_rank = torch.stack(self.collective.all_gather(torch.tensor(values, dtype=torch.float64)))
        steps = max(1, counts["optimizer_steps"])
        return {
            "workers": self.world,
            # The epoch this worker group started from: 0 unless it resumed from a checkpoint.
            "resumed_from_epoch": self.start_epoch,
            "per_rank_node": self.nodes,
            "per_rank_optimizer_steps": per_rank[:, 0].long().tolist(),
            "per_rank_kept": per_rank[:, 1].long().tolist(),
            "per_rank_backprop_examples": per_rank[:, 2].long().tolist(),
            "per_rank_selection_forward_examples": per_rank[:, 3].long().tolist(),
            # CRC-32 of the lr of every step this worker group took: equal on every rank in lockstep.
            "per_rank_lr_checksum": per_rank[:, 4].long().tolist(),
            **self._shared_cdf_summary(),
            **self._exchange_summary(steps),
        }

    def _shared_cdf_summary(self) -> dict:
        if self.alone:
            return {"histogram": "local (one worker)"}
        summary = {}
        table = self.engine.strategy.loss_table()
        if table is not None:
            # CRC-32 of each rank's loss table: equal when every rank holds every rank's records (a
            # sharded table's differ: each rank holds its own examples').
            summary["per_rank_loss_table_checksum"] = self._gathered_checksums(table.checksum())
            summary["loss_table"] = "sharded" if table.sharded else "replicated"
        selector = self.engine.strategy.selector
        if selector is None:
            return {**summary, "histogram": "none (the strategy ranks no losses)"}
        if not isinstance(selector.history, MergedLossHistogram):
            whose = "every rank's tables summed as each epoch starts" if table.sharded else "one table on every rank"
            return {**summary, "histogram": f"the loss table's recorded scores ({whose})"}
        return {
            **summary,
            "histogram": "merged at every exchange (bins in the exchange)",
            # CRC-32 of each rank's window: equal when every rank ranks against the same CDF_R.
            "per_rank_cdf_checksum": self._gathered_checksums(self.history.checksum()),
        }

    def _gathered_checksums(self, mine: int) -> list[int]:
        checksums = self.collective.all_gather(torch.tensor([mine], dtype=torch.float64))
        return [int(c) for c in torch.cat(checksums).tolist()]

    def _exchange_summary(self, steps: int) -> dict:
        if self.alone:
            return {"lockstep_exchange": "none (one worker)"}
        return self.engine.rounds.exchange.costs(steps)


def _memory_shard(data: DataSettings, batch_size: int, device: torch.device, rank: int, world: int):
    train_data, test_data, flipped_ids = prepare_data(data, batch_size)
    train_data, held_out = split_holdout(data, train_data, batch_size)
    per_rank = _examples_per_rank(len(train_data), world, batch_size)
    shard = MemoryShard(to_device(train_data, device), _sharding(data.shard_mode, rank, world, per_rank))
    return shard, test_data, flipped_ids, None if held_out is None else to_device(held_out, device)


def _stream_shard(data: DataSettings, batch_size: int, rank: int, world: int):
    """This rank's Ray Data shard; the driver split the dataset with equal=True (raysb.distributed.launch)."""
    iterator = ray.train.get_dataset_shard("train")

    def batches(chunk_size: int, seed: int):
        # Ray Data reads blocks in a new order each epoch; the buffer shuffles within them.
        return iterator.iter_torch_batches(
            batch_size=chunk_size,
            local_shuffle_buffer_size=data.stream_shuffle_buffer,
            local_shuffle_seed=seed,
        )

    shard, test_split = stream_shard(data, batches, rank, world)
    _examples_per_rank(shard.num_examples, world, batch_size)
    return shard, test_split, torch.empty(0, dtype=torch.int64)


def _examples_per_rank(examples: int, world: int, batch_size: int) -> int:
    per_rank = examples // world
    if per_rank < batch_size:
        raise ValueError(
            f"{examples} training examples over {world} workers leave {per_rank} per worker, "
            f"fewer than batch_size {batch_size}"
        )
    return per_rank


def _sharding(mode: str, rank: int, world: int, per_rank: int):
    """This rank's slice of an epoch's shared random order.

    Equal shard sizes give every rank the same number of selection rounds.
    "shuffled" deals a new random shard every epoch (the few examples left over
    change with the order); "contiguous" pins rank r to the same block of the
    dataset, visited in a new order each epoch, as file-based sharding would.
    """
    if mode == "shuffled":
        return lambda order: order[rank::world][:per_rank]
    low, high = rank * per_rank, (rank + 1) * per_rank
    return lambda order: order[(order >= low) & (order < high)]
