"""What every Ray Train worker runs: the shared epoch loop on one shard, in lockstep.

Each rank either holds the (small) training set in memory and takes its slice
`order[rank::world]` of each epoch's shared random order, or streams its Ray
Data shard of a Parquet split (data_mode=stream). It scores and selects on its
own device, ranks losses against the shared CDF_R of the loss-history actor, and
trains through `LockstepExchange` so all ranks run the same steps. Rank 0
evaluates, writes the output files and the checkpoints; every rank calls
`ray.train.report` exactly once per epoch.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from raysb.config import TrainConfig
from raysb.data.prepare import prepare_data, to_device
from raysb.data.shards import MemoryShard, StreamShard
from raysb.data.streaming import inspect_splits
from raysb.distributed.drills import DrillRunner
from raysb.distributed.loss_history import shared_loss_history
from raysb.training.builders import build_engine
from raysb.training.collective import Collective, TorchCollective
from raysb.training.loop import RunHooks, print_line, run_epochs
from raysb.training.malloc_tuning import keep_freed_memory_for_reuse
from raysb.training.outputs import MetricsWriter

CHECKPOINT_FILE = "raysb_state.pt"
# Counts that are the same step on every rank in lockstep: combined by max, not sum.
LOCKSTEP_COUNTS = ("optimizer_steps", "epoch_steps")


def worker_loop(config_values: dict) -> None:
    config = TrainConfig.from_dict(config_values)
    keep_freed_memory_for_reuse()
    torch.set_num_threads(max(1, int(config.cpus_per_worker)))
    collective = TorchCollective() if dist.is_available() and dist.is_initialized() else Collective()
    rank, world = collective.rank, collective.world_size
    device = ray.train.torch.get_device() if config.gpus_per_worker > 0 else torch.device("cpu")
    log = print_line if rank == 0 else (lambda line: None)

    torch.manual_seed(config.seed)
    if config.data_mode == "stream":
        shard, test_data, flipped_ids = _stream_shard(config, world)
    else:
        shard, test_data, flipped_ids = _memory_shard(config, device, rank, world)
    per_rank = shard.num_examples // world

    # The actor starts before the training clock does.
    history = shared_loss_history(
        collective,
        config.history_size,
        device,
        sync_interval=config.cdf_sync_interval,
        lag=config.cdf_lag,
        log=print_line,
        # A restart resumes the history exactly; without one, ranks go on alone.
        restart_on_loss=config.max_failures != 0,
    )
    actor = history.actor
    engine = build_engine(
        config,
        shard,
        device,
        wrap_model=ray.train.torch.prepare_model if world > 1 else (lambda model: model),
        history=history,
        collective=collective,
    )

    out = Path(config.out)
    metrics = MetricsWriter(out / "metrics.parquet")
    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / CHECKPOINT_FILE, map_location=device, weights_only=False)
        rank_states = state["rank_states"]
        if len(rank_states) != world:
            raise ValueError(
                f"the checkpoint was written by {len(rank_states)} workers; resume with --workers {len(rank_states)}"
            )
        engine.load_state_dict(state["engine"], rank_states[rank])
        # Rank 0 checkpointed the trace merged over all ranks; the others start theirs afresh.
        if engine.trace is not None and rank == 0:
            engine.trace.load_state_dict(state["trace"])
        start_epoch = state["epoch"]
        # Rows written after this checkpoint (before the failure) are dropped and redone.
        metrics = MetricsWriter(out / "metrics.parquet", state["metrics_rows"])
        log(f"raysb: resumed from the checkpoint after epoch {start_epoch}")

    def after_epoch(epoch: int, row: dict | None, stopped: bool) -> None:
        finished = epoch + 1
        saving = stopped or finished == config.epochs or finished % config.checkpoint_every == 0
        if not saving:
            ray.train.report({"epoch": finished, **(row or {})})
        else:
            if engine.trace is not None:
                engine.trace.merge_ranks()
            # Rank 0 writes the checkpoint, with every rank's own state (a collective).
            rank_states = collective.gather_object(engine.rank_state_dict())
            save_checkpoint(finished, row, rank_states)
        drills.before_epoch(finished + 1, poison_weights)

    def save_checkpoint(finished: int, row: dict | None, rank_states: list[dict] | None) -> None:
        report = {"epoch": finished, **(row or {})}
        if rank != 0:
            drills.while_checkpointing(finished)
            ray.train.report(report)
            return
        with tempfile.TemporaryDirectory() as folder:
            state = {
                "engine": engine.shared_state_dict(),
                "rank_states": rank_states,
                "trace": engine.trace.state_dict() if engine.trace is not None else None,
                "epoch": finished,
                "metrics_rows": metrics.rows,
            }
            torch.save(state, Path(folder) / CHECKPOINT_FILE)
            drills.while_checkpointing(finished)
            ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(folder))

    def totals_over_ranks(counts: dict[str, float]) -> dict[str, float]:
        keys = sorted(counts)
        gathered = collective.all_gather(torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64))
        stacked = torch.stack(gathered)
        combined = {k: float(stacked[:, i].sum()) for i, k in enumerate(keys)}
        for key in LOCKSTEP_COUNTS:
            combined[key] = float(stacked[:, keys.index(key)].max())
        combined["epoch_loss_sum"] = float(stacked[:, keys.index("epoch_loss_sum")].mean())
        return combined

    def summary_extras() -> dict:
        counts = engine.progress_counts()
        names = ("optimizer_steps", "examples_kept", "backprop_examples", "selection_forward_examples")
        per_rank = torch.stack(
            collective.all_gather(torch.tensor([float(counts[n]) for n in names], dtype=torch.float64))
        )
        cdf = history.stats()
        steps = max(1, counts["optimizer_steps"])
        chunk = engine.chunk_size
        return {
            "workers": world,
            # The epoch this worker group started from: 0 unless it resumed from a checkpoint.
            "resumed_from_epoch": start_epoch,
            "per_rank_optimizer_steps": per_rank[:, 0].long().tolist(),
            "per_rank_kept": per_rank[:, 1].long().tolist(),
            "per_rank_backprop_examples": per_rank[:, 2].long().tolist(),
            "per_rank_selection_forward_examples": per_rank[:, 3].long().tolist(),
            "histogram_staleness": {
                "mean_rounds": cdf["mean_staleness_rounds"],
                "mean_examples": cdf["mean_staleness_rounds"] * chunk * world,
                "sync_interval": config.cdf_sync_interval,
                "lag": config.cdf_lag,
            },
            "histogram_actor_seconds": cdf["actor_seconds"],
            "histogram_actor_ms_per_step": 1000 * cdf["actor_seconds"] / steps,
            "histogram_actor_failed_at_round": cdf["actor_failed_at_round"],
            "lockstep_rounds": engine.rounds.exchange.rounds,
            # Includes waiting for the slowest rank to reach the exchange.
            "lockstep_exchange_seconds": engine.rounds.exchange.exchange_seconds,
            "lockstep_exchange_ms_per_step": 1000 * engine.rounds.exchange.exchange_seconds / steps,
            "lockstep_exchange_kb_per_step": engine.rounds.exchange.exchanged_bytes / 1024 / steps,
        }

    drills = DrillRunner(config.chaos, config.out, rank, world, config.checkpoint_every, print_line)

    def poison_weights() -> None:
        with torch.no_grad():
            next(engine.scoring_model.parameters()).fill_(float("nan"))

    drills.before_epoch(start_epoch + 1, poison_weights)
    rounds_per_epoch = -(-per_rank // engine.chunk_size)
    run_epochs(
        engine,
        config,
        test_data,
        flipped_ids,
        metrics,
        log,
        RunHooks(
            writes_outputs=rank == 0,
            start_epoch=start_epoch,
            after_epoch=after_epoch,
            summary_extras=summary_extras,
            totals_over_ranks=totals_over_ranks,
            share_from_writer=collective.broadcast_object,
            before_round=lambda epoch, round_index: drills.before_round(
                epoch + 1, round_index, rounds_per_epoch, lambda: ray.kill(actor)
            ),
        ),
    )


def _memory_shard(config: TrainConfig, device: torch.device, rank: int, world: int):
    train_data, test_data, flipped_ids = prepare_data(config)
    per_rank = _examples_per_rank(len(train_data), world, config.batch_size)
    shard = MemoryShard(to_device(train_data, device), _sharding(config.shard_mode, rank, world, per_rank))
    return shard, test_data, flipped_ids


def _stream_shard(config: TrainConfig, world: int):
    """This rank's Ray Data shard; the driver split the dataset with equal=True (raysb.distributed.launch)."""
    train_split, test_split = inspect_splits(config.data_dir)
    _examples_per_rank(len(train_split), world, config.batch_size)
    iterator = ray.train.get_dataset_shard("train")
    # Ray Data hands out read-only NumPy buffers; raysb never writes to a chunk in place.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    def batches(chunk_size: int, seed: int):
        # Ray Data reads blocks in a new order each epoch; the buffer shuffles within them.
        return iterator.iter_torch_batches(
            batch_size=chunk_size,
            local_shuffle_buffer_size=config.stream_shuffle_buffer,
            local_shuffle_seed=seed,
        )

    return StreamShard(train_split, batches), test_split, torch.empty(0, dtype=torch.int64)


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
