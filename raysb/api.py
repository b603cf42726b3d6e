"""`train(config)`: one run from config to output files, in this process or on Ray Train."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from raysb.config import ConfigError, TrainConfig
from raysb.data.prepare import prepare_data, to_device
from raysb.data.shards import MemoryShard
from raysb.distributed.cluster import check_paths_outlive_the_job
from raysb.resume import check_resume
from raysb.training.builders import build_engine, resolve_device
from raysb.training.checkpoint import CHECKPOINT_FILE, load_checkpoint_file, save_checkpoint_file
from raysb.training.loop import RunHooks, RunResult, print_line, run_epochs
from raysb.training.malloc_tuning import keep_freed_memory_for_reuse
from raysb.training.outputs import MetricsWriter, claim_out

__all__ = ["RunResult", "train"]


def train(
    config: TrainConfig,
    log: Callable[[str], None] | None = None,
    on_epoch: Callable[[dict], None] | None = None,
) -> RunResult:
    """Train one model as `config` says, writing metrics.parquet, summary.json and config.yaml.

    With `config.workers` set, the run goes to Ray Train (raysb.distributed.launch); otherwise
    it runs here, in this process, without Ray, checkpointing to OUT/checkpoint.pt every
    `checkpoint_every` epochs. An --out that holds a run is refused unless `config.resume`
    (continue it from its checkpoint, with only what raysb.resume allows changed) or
    `config.overwrite` (replace it). `on_epoch` receives each evaluated epoch's metrics row (a
    single-process Ray Tune trial reports them with it).
    """
    log = log or print_line
    out = Path(config.out)
    check_paths_outlive_the_job({"--out": config.out, "--storage-path": config.storage_path})
    if config.resume:
        check_resume(config, log)
    try:
        claim_out(out, config.resume, config.overwrite)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if config.workers is not None:
        from raysb.distributed.launch import train_distributed

        return train_distributed(config, log)
    if config.resume and not (out / CHECKPOINT_FILE).exists():
        raise ConfigError(f"--resume: --out {config.out} holds no checkpoint to continue from")
    keep_freed_memory_for_reuse()
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    train_data, test_data, flipped_ids = prepare_data(config)
    train_data = to_device(train_data, device)
    engine = build_engine(config, MemoryShard(train_data), device)
    restored = load_checkpoint_file(engine, out) if config.resume else None
    if restored is not None and restored.epoch >= config.epochs:
        raise ConfigError(
            f"--resume: --out {config.out} has finished {restored.epoch} of {config.epochs} epochs; "
            "give more --epochs to train on"
        )
    metrics = MetricsWriter(out / "metrics.parquet", restored.metrics_rows if restored else None)

    def after_epoch(epoch: int, row: dict | None, stopped: bool) -> None:
        finished = epoch + 1
        if stopped or finished == config.epochs or finished % config.checkpoint_every == 0:
            with engine.timer.phase("checkpointing"):
                save_checkpoint_file(engine, out, finished, metrics.rows)
        if on_epoch is not None and row is not None:
            on_epoch(row)

    hooks = RunHooks(start_epoch=restored.epoch if restored else 0, after_epoch=after_epoch)
    if restored is not None:
        log(f"raysb: resumed from the checkpoint after epoch {restored.epoch}")
    return run_epochs(engine, config, test_data, flipped_ids, metrics, log, hooks)
