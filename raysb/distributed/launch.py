"""The driver side of a distributed run: where its checkpoints go, resume checks, fit a TorchTrainer."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Sequence


from raysb.config import ConfigError, TrainConfig
from raysb.core.settings import ClusterSettings, RunSettings, Settings
from raysb.data.sources import is_uri
from raysb.distributed.cluster import (
    ClusterError, check_resources, cluster_capacity, connect_ray, local_capacity, watch_cluster,
)
from raysb.distributed.console import relayed_console
from raysb.distributed.chaos import COMMITTED_FILE, committed_epoch
from raysb.distributed.ray_internals import (
    WORKER_GROUP_START_TIMEOUT_VARIABLE, abort_train_run, trainer_leaving_sigint, user_error_of,
    worker_group_start_timed_out,
)
from raysb.training.interrupt import Interrupted, RunPosition, sigterm_kept, signal_name
from raysb.training.outputs import read_metrics

# How long an interrupted run waits for its workers to stop before the driver exits anyway.
ABORT_TIMEOUT_S = 30.0


def _resume_hint(out: str, when: str = "once a cluster is up again") -> str:
    epoch = committed_epoch(out)
    saved = f"the checkpoint after epoch {epoch} is intact" if epoch else "no checkpoint had been committed yet"
    return f"Metrics written so far and {saved}; {when}, rerun with --resume to continue."


@contextlib.contextmanager
def _ray_train_logs(verbose: bool):
    """Ray Train's info lines (every report's metrics) only with --verbose, here in the driver too:
    with --workers 0 the training function runs in this process, where LoggingConfig, which
    quiets the workers, does not reach."""
    logger = logging.getLogger("ray.train")
    level = logger.level
    if not verbose:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _absolute(location: str | None) -> str | None:
    """A local path made absolute (from this process's folder); a URI (s3://...) or None as it is."""
    if location is None or is_uri(location):
        return location
    return str(Path(location).expanduser().resolve())


def storage_location(out: str, storage_path: str | None) -> tuple[str, str]:
    """(storage_path, run name) of the run in `out`: checkpoints go to storage_path/name."""
    storage = _absolute(storage_path or str(Path(out).resolve().parent / "ray_storage"))
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(out).resolve().name) or "raysb"
    return storage, name


def train_distributed(config: TrainConfig, log: Callable[[str], None], callbacks: Sequence = (),
                      started_at: float | None = None):
    """`callbacks`: Ray Train callbacks, e.g. Tune's TuneReportCallback when a Tune trial drives this run.
    `started_at`: when the run began (time.time(); None: now), its start-up counted from there.
    A KeyboardInterrupt (Ctrl-C, or SIGTERM under raysb.training.interrupt.signals_interrupt) stops
    the workers and ends it as Interrupted, saying where."""
    # Workers start in folders of their own (on other nodes too): every path they are handed is
    # made absolute here, the driver's, so they write where it reads and read where the user meant.
    config.out = _absolute(config.out)
    config.data_dir = _absolute(config.data_dir)
    settings = config.settings()
    storage, name = storage_location(config.out, config.storage_path)
    run_folder = Path(storage) / name
    committed = committed_epoch(config.out) > 0
    if config.resume and not committed:
        raise ConfigError(f"--resume: --out {config.out} holds no checkpoint to continue from")
    if "://" not in storage:
        # Ray Train would resume a run folder it finds: one replaced, or one whose run stopped
        # before its first committed checkpoint (nothing to continue: claim_out's rule), goes.
        if run_folder.exists() and (config.overwrite or not committed):
            shutil.rmtree(run_folder)
        if run_folder.exists() and not config.resume:
            raise ConfigError(
                f"--out {config.out}: its checkpoints at {run_folder} hold a run; pass --resume to continue it, "
                "--overwrite to replace it, or choose another --out"
            )
    try:
        return _fit(settings, log, callbacks, storage, name, time.time() if started_at is None else started_at)
    except KeyboardInterrupt as stop:
        raise _interrupted(stop, settings.run) from None


def _fit(settings: Settings, log: Callable[[str], None], callbacks: Sequence, storage: str, name: str,
         started_at: float):
    import ray.train
    from ray.train.torch import TorchConfig

    from raysb.distributed.worker import worker_loop
    from raysb.training.loop import RunResult

    cluster, data, run = settings.cluster, settings.data, settings.run
    if not ray.is_initialized() and cluster.address is None and "RAY_ADDRESS" not in os.environ:
        # A new local instance: a worker group this machine cannot hold is refused before Ray's
        # start-up (~16 s on 2 CPUs), not after it.
        check_resources(settings, capacity=local_capacity())
    with sigterm_kept():
        connect_ray(cluster.address, log_to_driver=cluster.verbose)
    waiting = check_resources(settings)
    if waiting:
        log(waiting)
    datasets, dataset_config = {}, None
    if data.data_mode == "stream":
        from ray.data import ExecutionOptions

        from raysb.data.streaming import inspect_split, ray_dataset

        # Inspected here too so that a bad file fails before any worker starts.
        split = inspect_split("train", data.data_dir, columns=data.parquet_columns)
        datasets["train"] = ray_dataset(split).randomize_block_order(seed=data.seed)
        # An ordered execution deals the same blocks to the same rank in the same
        # order every epoch and after a restart, which exact resume needs; each
        # rank's shuffle buffer, seeded per epoch from checkpointed state, varies
        # the order within them.
        dataset_config = ray.train.DataConfig(execution_options=ExecutionOptions(preserve_order=True))

    use_gpu = cluster.gpus_per_worker > 0
    resources = {"CPU": cluster.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = cluster.gpus_per_worker
    b = settings.optimization.batch_size
    log(f"raysb: Ray Train with {cluster.workers} worker(s) of b {b} ({cluster.workers * b} examples a step); "
        f"checkpoints in {Path(storage) / name}")
    with relayed_console(log) as console, _ray_train_logs(cluster.verbose):
        trainer = trainer_leaving_sigint(
            worker_loop,
            train_loop_config={
                "config": dict(run.record),
                "console": console,
                "model_factory": _user_model_factory(settings.model.name),
                "strategy": _user_strategy(run.strategy),
                "started_at": started_at,
            },
            datasets=datasets,
            dataset_config=dataset_config,
            scaling_config=ray.train.ScalingConfig(
                num_workers=cluster.workers, use_gpu=use_gpu, resources_per_worker=resources,
                placement_strategy=cluster.placement_strategy,
            ),
            torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
            run_config=ray.train.RunConfig(
                storage_path=storage,
                name=name,
                # Ray Train would retry a worker group it cannot place forever (controller
                # failures are unlimited by default): one wait of placement_timeout, then an error.
                failure_config=ray.train.FailureConfig(max_failures=cluster.max_failures, controller_failure_limit=0),
                checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
                callbacks=[*callbacks, _commit_recorder(Path(run.out))],
                # Ray Train's info lines (worker-group set-up, every report's metrics) only with --verbose.
                logging_config=ray.train.LoggingConfig(log_level="INFO" if cluster.verbose else "WARNING"),
            ),
        )
        try:
            with watch_cluster(f"the run in {run.out}", lambda: _resume_hint(run.out)), _environment(
                {WORKER_GROUP_START_TIMEOUT_VARIABLE: str(cluster.placement_timeout)}
            ):
                trainer.fit()
        except ray.train.TrainingFailedError as error:
            raise _root_cause(error, cluster, run.out) from None
        except KeyboardInterrupt:
            # Stop the worker group now; without this it trains on until the driver's exit ends its owner.
            abort_train_run(trainer.controller, ABORT_TIMEOUT_S)
            raise

    out = Path(run.out)
    summary = json.loads((out / "summary.json").read_text())
    return RunResult(out, read_metrics(out / "metrics.parquet"), summary)


def _interrupted(stop: KeyboardInterrupt, run: RunSettings) -> Interrupted:
    """Where an interrupted run stopped, from what it left: rank 0's metrics rows and the record of
    the last committed checkpoint (the driver does not follow the epochs itself)."""
    out = Path(run.out)
    committed = committed_epoch(out)
    evaluated = 0
    if (out / "metrics.parquet").exists():
        evaluated = max((row["epoch"] for row in read_metrics(out / "metrics.parquet", ["epoch"])), default=0)
    position = RunPosition(run.epochs, finished=max(committed, evaluated), checkpoint=committed or None)
    location = json.loads((out / COMMITTED_FILE).read_text())["path"] if committed else ""
    return Interrupted(signal_name(stop), position.line(stop, run.out, location))


def _user_model_factory(model: str):
    """A `package.module:factory` model, resolved here so that a bad name fails before any worker
    starts, and sent to the workers (by value where it is not installed, `_sent_by_value`)."""
    if ":" not in model:
        return None
    from raysb.models import user_factory

    factory = user_factory(model)
    _sent_by_value(model)
    return factory


def _user_strategy(strategy: str):
    """A user's own `package.module:CARD` strategy as (card, class), sent to the workers as an own
    model's factory is; None for a built-in."""
    if ":" not in strategy:
        return None
    from raysb.core.strategy_table import strategy_card
    from raysb.training.selection.strategies import strategy_class

    card = strategy_card(strategy)
    implementation = strategy_class(card)
    _sent_by_value(strategy)
    _sent_by_value(card.implementation)
    return card, implementation


def _sent_by_value(name: str) -> None:
    """Pickle what `package.module:attribute`'s package defines by value, unless it is installed:
    the workers start in Ray's session folder, where the driver's working directory is not on their path."""
    import sys
    import sysconfig

    from ray import cloudpickle

    top = sys.modules[name.partition(":")[0].split(".")[0]]
    installed = [Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")]
    if not any(Path(top.__file__).resolve().is_relative_to(path) for path in installed):
        cloudpickle.register_pickle_by_value(top)


def _commit_recorder(out: Path):
    """A callback on the Train controller that writes out/last_checkpoint.json once Ray Train
    has committed a checkpoint: the one `--resume` or a restart continues from."""
    import ray.train

    from raysb.training.outputs import write_json

    class CommitRecorder(ray.train.UserCallback):
        def after_report(self, run_context, metrics, checkpoint) -> None:
            if checkpoint is not None:
                write_json(out / COMMITTED_FILE, {"epoch": metrics[0]["epoch"], "path": checkpoint.path})

    return CommitRecorder()


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _root_cause(error: Exception, cluster: ClusterSettings, out: str) -> Exception:
    """Turn a worker-group failure of the run in `out` back into the error a user can act on."""
    if worker_group_start_timed_out(error):
        cpus, gpus = cluster_capacity()
        gpu_need = f" and {cluster.gpus_per_worker:g} GPU" if cluster.gpus_per_worker else ""
        return ClusterError(
            f"Ray could not place the {cluster.workers} workers ({cluster.cpus_per_worker:g} CPU{gpu_need} each) "
            f"within --placement-timeout {cluster.placement_timeout:g}s; the cluster now has {cpus:g} CPUs and "
            f"{gpus:g} GPUs (a node lost, or resources held by other work). "
            + _resume_hint(out, when="once the cluster has room for them")
        )
    return user_error_of(error) or error
