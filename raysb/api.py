"""`train(config)`: one run from config to output files, in this process or on Ray Train."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from raysb.config import ConfigError, ConfigTypeError, TrainConfig
from raysb.core.settings import RunSettings
from raysb.data.prepare import prepare_data
from raysb.distributed.cluster import check_paths_outlive_the_job
from raysb.resume import CHECKPOINT_FILE, check_resume, checkpoint_header
from raysb.training.builders import check_own_model, resolve_device
from raysb.training.checkpoint import load_checkpoint_file, save_checkpoint_file
from raysb.training.engine import Engine
from raysb.training.interrupt import Interrupted, RunPosition, interrupts_deferred, signal_name
from raysb.training.irreducible_loss import fit_irreducible_losses
from raysb.training.loop import RunResult, run_epochs
from raysb.training.malloc_tuning import keep_freed_memory_for_reuse
from raysb.training.metric_sinks import check_sinks_installed
from raysb.training.outputs import MetricsWriter, claim_out, holding_out, holds_run
from raysb.training.run_callback import RunCallback
from raysb.training.run_engine import run_engine
from raysb.training.terminal import run_console

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
    `config.overwrite` (replace it). `log` receives the run's lines; without it they go to stdout,
    where a terminal also shows a progress bar inside each epoch (raysb.training.terminal).
    `on_epoch` receives each evaluated epoch's metrics row (a
    single-process Ray Tune trial reports them with it). A KeyboardInterrupt (Ctrl-C, or SIGTERM
    under raysb.training.interrupt.signals_interrupt) ends it as Interrupted, saying where.
    """
    started_at = time.time()  # the run's start-up is counted from here to its training clock's start
    if not isinstance(config, TrainConfig):
        raise ConfigTypeError(f"train() takes a TrainConfig (TrainConfig(dataset=..., epochs=...), or "
                              f"TrainConfig.from_dict(a dict)), got {type(config).__name__}")
    if not config.out.strip():
        # Path("") is the current folder: a run there fills a checkout's root with its files.
        raise ConfigError("--out is empty; name the folder for the run's files")
    out = Path(config.out)
    # Before anything loads: a missing package or module is one line now, not a crash once the data is in.
    check_sinks_installed(config.log_to)
    check_own_model(config.model)
    check_paths_outlive_the_job({"--out": config.out, "--storage-path": config.storage_path})
    # --verbose interleaves Ray's own lines with raysb's, which a bar redrawn in place would garble.
    with holding_out(out, create=not config.resume), run_console(log, bar=not config.verbose) as log:
        return _train_holding_out(config, log, on_epoch, started_at)


def _train_holding_out(
    config: TrainConfig, log: Callable[[str], None], on_epoch: Callable[[dict], None] | None, started_at: float
) -> RunResult:
    out = Path(config.out)
    if config.resume:
        settings = config.settings()
        check_resume(settings.run, settings.optimization, log)
    cleared = claim_out(out, config.resume, config.overwrite)
    if cleared:
        log(cleared)
    if config.workers is not None:
        from raysb.distributed.launch import train_distributed

        return train_distributed(config, log, started_at=started_at)
    position = RunPosition(config.epochs, checkpoint=_epochs_to_resume_after(config) if config.resume else None)
    try:
        return _train_in_process(config, log, on_epoch, position, started_at)
    except KeyboardInterrupt as stop:
        raise Interrupted(signal_name(stop), position.line(stop, config.out, str(out / CHECKPOINT_FILE))) from None


def _epochs_to_resume_after(config: TrainConfig) -> int:
    """The epoch the checkpoint in --out follows, checked before any data loads."""
    out = Path(config.out)
    header = checkpoint_header(out)
    if header is None:
        if holds_run(out):  # it ended, and its checkpoint was deleted since
            ending = "; its run ended, but its checkpoint.pt is gone: --overwrite trains it again from the start"
        elif (out / "config.yaml").exists():
            ending = "; its run stopped before its first checkpoint: run it again without --resume"
        else:
            ending = ""
        raise ConfigError(f"--resume: --out {config.out} holds no checkpoint to continue from{ending}")
    epoch = header[0]
    if config.epochs is not None and epoch >= config.epochs:
        raise ConfigError(
            f"--resume: --out {config.out} has finished {epoch} of {config.epochs} epochs; "
            "give more --epochs to train on"
        )
    return epoch


def _train_in_process(
    config: TrainConfig, log: Callable[[str], None], on_epoch: Callable[[dict], None] | None, position: RunPosition,
    started_at: float,
) -> RunResult:
    """A run in this process, begun at `started_at` (time.time()); `position` follows its epochs and checkpoints."""
    settings = config.settings()
    run = settings.run
    out = Path(run.out)
    keep_freed_memory_for_reuse()
    device = resolve_device(run.device)
    torch.manual_seed(run.seed)
    train_data, test_data, flipped_ids = prepare_data(settings.data, settings.optimization.batch_size)
    engine = run_engine(settings, train_data, device)
    restored = load_checkpoint_file(engine, out) if run.resume else None
    fit_irreducible_losses(engine, settings)
    metrics = MetricsWriter(out / "metrics.parquet", restored.metrics_rows if restored else None)
    start_epoch = restored.epoch if restored else 0
    if restored is not None:
        log(f"raysb: resumed from the checkpoint after epoch {start_epoch}")
    position.finished = start_epoch
    callback = _InProcessCheckpoints(engine, run, metrics, on_epoch, position, start_epoch, started_at)
    return run_epochs(engine, run, test_data, flipped_ids, metrics, log, callback)


class _InProcessCheckpoints(RunCallback):
    """A single process's part in the epoch loop: OUT/checkpoint.pt when one is due, each evaluated
    row to `on_epoch`, and `position` kept up with both."""

    def __init__(self, engine: Engine, run: RunSettings, metrics: MetricsWriter,
                 on_epoch: Callable[[dict], None] | None, position: RunPosition, start_epoch: int, started_at: float):
        self.engine, self.run, self.metrics, self.on_epoch, self.position = engine, run, metrics, on_epoch, position
        self.start_epoch, self.started_at = start_epoch, started_at

    def after_epoch(self, epoch: int, row: dict | None, stopped: bool) -> None:
        finished = epoch + 1
        run = self.run
        if stopped or finished == run.epochs or finished % run.checkpoint_every == 0:
            with self.engine.timer.phase("checkpointing"), interrupts_deferred():
                save_checkpoint_file(self.engine, Path(run.out), finished, self.metrics.rows, run.saved)
                self.position.checkpoint = finished
        if self.on_epoch is not None and row is not None:
            self.on_epoch(row)
        # Only now: an interrupt while its checkpoint was written stopped the run in this epoch.
        self.position.finished = finished
