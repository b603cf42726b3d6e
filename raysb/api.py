"""`train(config)`: one run from config to output files, in this process or on Ray Train."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from raysb.config import TrainConfig
from raysb.data.prepare import prepare_data, to_device
from raysb.data.shards import MemoryShard
from raysb.training.builders import build_engine, resolve_device
from raysb.training.loop import RunHooks, RunResult, print_line, run_epochs
from raysb.training.malloc_tuning import keep_freed_memory_for_reuse
from raysb.training.outputs import MetricsWriter

__all__ = ["RunResult", "train"]


def train(
    config: TrainConfig,
    log: Callable[[str], None] | None = None,
    on_epoch: Callable[[dict], None] | None = None,
) -> RunResult:
    """Train one model as `config` says, writing metrics.parquet, summary.json and config.yaml.

    With `config.workers` set, the run goes to Ray Train (raysb.distributed.launch); otherwise
    it runs here, in this process, without Ray. `on_epoch` receives each
    evaluated epoch's metrics row (a single-process Ray Tune trial reports
    them with it).
    """
    log = log or print_line
    if config.workers is not None:
        from raysb.distributed.launch import train_distributed

        return train_distributed(config, log)
    keep_freed_memory_for_reuse()
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    train_data, test_data, flipped_ids = prepare_data(config)
    train_data = to_device(train_data, device)
    engine = build_engine(config, MemoryShard(train_data), device)
    hooks = RunHooks()
    if on_epoch is not None:
        hooks.after_epoch = lambda epoch, row, stopped: on_epoch(row) if row is not None else None
    metrics = MetricsWriter(Path(config.out) / "metrics.parquet")
    return run_epochs(engine, config, test_data, flipped_ids, metrics, log, hooks)
