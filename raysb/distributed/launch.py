"""The driver side of a distributed run: connect to Ray, check resources, fit a TorchTrainer."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import pyarrow.parquet as pq

from raysb.config import ConfigError, TrainConfig
from raysb.core.errors import NonFiniteLossError

# The exit status of a driver whose Ray cluster went away under it (raysb.distributed.launch.watch_cluster).
CLUSTER_LOST_EXIT_CODE = 3


class ClusterError(RuntimeError):
    """Ray cannot be reached, or cannot ever give the resources a run asks for."""


def connect_ray(address: str | None) -> None:
    """Join the cluster at `address`, or start a private local Ray instance.

    Without an address, `ray.init()` would join whatever cluster
    /tmp/ray/ray_current_cluster names, even one whose processes are long gone,
    and wait on it for minutes. So no address means a private instance, unless
    RAY_ADDRESS names a cluster (as Ray Jobs does for the driver it launches).
    A named cluster is resolved and probed first, so a dead one fails in seconds.
    """
    import ray

    if ray.is_initialized():
        return
    if address is None:
        address = os.environ.get("RAY_ADDRESS") or "local"
    if address != "local":
        resolved = _resolve(address)
        _check_reachable(address, resolved)
        if address == "auto":
            address = resolved  # so Ray joins the cluster probed, not another it finds
    try:
        ray.init(address=address)
    except (ConnectionError, RuntimeError, ValueError) as error:
        where = "a new local Ray instance" if address == "local" else address
        raise ClusterError(f"cannot connect to Ray at {where}: {error}") from None


def _resolve(address: str) -> str | None:
    """host:port of the cluster `address` names; None for a ray:// client address.

    `auto` is the cluster `ray start` last started here (RAY_ADDRESS, else
    /tmp/ray/ray_current_cluster), and only without either any Ray instance
    found running on this machine, as Ray's own `auto` would pick. A stale file
    is then an error, not a silent switch to some other instance.
    """
    from ray._private.services import canonicalize_bootstrap_address
    from ray._private.utils import read_ray_address

    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or read_ray_address() or "auto"
    if address.startswith("ray://"):
        return None
    try:
        return canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError) as error:
        raise ClusterError(
            f"--address {address}: {error}. Start a cluster with `ray start --head`, "
            "or drop --address to train on a private local Ray instance"
        ) from None


def _check_reachable(address: str, target: str | None, timeout_s: float = 5.0) -> None:
    """Ray retries an unreachable GCS for minutes; a plain TCP connect answers in seconds."""
    host, sep, port = (target or "").rpartition(":")
    if not sep or not port.isdigit():
        return
    error = _connect_error(target, timeout_s)
    if error is not None:
        named_by = " (named in /tmp/ray/ray_current_cluster or RAY_ADDRESS)" if address == "auto" else ""
        raise ClusterError(
            f"cannot reach the Ray cluster at {target}{named_by}: {error.strerror or error}. "
            "If that cluster was stopped without `ray stop`, run `ray stop` to clear it; start one with "
            "`ray start --head`, or drop --address to train on a private local Ray instance"
        ) from None


@contextlib.contextmanager
def watch_cluster(what: str, hint: Callable[[], str], interval_s: float = 2.0, grace_s: float = 10.0):
    """While the block runs, end this process with a clear message if the Ray cluster goes away.

    When the head node or this node's raylet dies, the driver's `ray.get` on the
    Train controller would wait on Ray's own reconnection (a minute or more) and
    then die without a word. A TCP probe of the GCS and of this node's raylet
    every `interval_s` notices within `grace_s`; the process then exits, since a
    thread cannot wake a main thread blocked inside Ray. Files already written
    (metrics, summary, committed checkpoints) are complete: each is written
    whole and then renamed into place.
    """
    import ray

    node = ray._private.worker.global_worker.node
    endpoints = {"the GCS (head node)": node.gcs_address}
    if getattr(node, "node_manager_port", None):
        endpoints["this node's raylet"] = f"{node.node_ip_address}:{node.node_manager_port}"
    finished = threading.Event()

    def watch() -> None:
        lost_since: dict[str, float] = {}
        while not finished.wait(interval_s):
            for name, address in endpoints.items():
                if _connect_error(address) is None:
                    lost_since.pop(name, None)
                    continue
                since = lost_since.setdefault(name, time.monotonic())
                if time.monotonic() - since >= grace_s and not finished.is_set():
                    sys.stderr.write(
                        f"raysb: lost the Ray cluster: {name} at {address} has not answered for "
                        f"{time.monotonic() - since:.0f}s; stopping {what}. {hint()}\n"
                    )
                    sys.stderr.flush()
                    os._exit(CLUSTER_LOST_EXIT_CODE)

    thread = threading.Thread(target=watch, name="raysb-cluster-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        finished.set()


def _connect_error(address: str, timeout_s: float = 2.0) -> OSError | None:
    """Why a TCP connection to host:port fails, or None if it opens."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        return None
    except OSError as error:
        return error


def _resume_hint(config: TrainConfig) -> str:
    from raysb.distributed.drills import committed_epoch

    epoch = committed_epoch(config.out)
    saved = f"the checkpoint after epoch {epoch} is intact" if epoch else "no checkpoint had been committed yet"
    return f"Metrics written so far and {saved}; once a cluster is up again, rerun with --resume to continue."


def cluster_capacity() -> tuple[float, float]:
    """The connected Ray cluster's CPUs and GPUs, all nodes together."""
    import ray

    resources = ray.cluster_resources()
    return resources.get("CPU", 0.0), resources.get("GPU", 0.0)


def check_resources(config: TrainConfig) -> None:
    """Refuse a run that can never be scheduled instead of letting it wait forever."""
    workers = max(config.workers, 1)
    cpus, gpus = cluster_capacity()
    need_cpus, need_gpus = workers * config.cpus_per_worker, workers * config.gpus_per_worker
    if config.pipeline_selection == "actor":
        # Each worker's scoring actor (raysb.training.pipeline) holds its own resources.
        need_cpus += workers * config.pipeline_cpus
        need_gpus += workers * config.pipeline_gpus
    if need_cpus > cpus:
        raise ClusterError(
            f"{workers} worker(s) x {config.cpus_per_worker:g} CPU{_pipeline_share(config, 'cpus')} "
            f"need {need_cpus:g} CPUs; "
            f"the Ray cluster has {cpus:g}. Lower --workers or --cpus-per-worker (fractions are allowed)"
        )
    if need_gpus > gpus:
        raise ClusterError(
            f"{workers} worker(s) x {config.gpus_per_worker:g} GPU{_pipeline_share(config, 'gpus')} "
            f"need {need_gpus:g} GPUs; "
            f"the Ray cluster has {gpus:g}"
        )
    if config.data_mode == "stream" and cpus - need_cpus < 1:
        raise ClusterError(
            f"data_mode=stream decodes Parquet in Ray Data tasks beside the workers, which need at least "
            f"1 CPU the workers do not take; the workers take {need_cpus:g} of {cpus:g}. "
            "Lower --workers or --cpus-per-worker"
        )


def _pipeline_share(config: TrainConfig, resource: str) -> str:
    if config.pipeline_selection != "actor":
        return ""
    return f" (+ {getattr(config, 'pipeline_' + resource):g} for its scoring actor)"


def storage_location(config: TrainConfig) -> tuple[str, str]:
    """(storage_path, run name): checkpoints go to storage_path/name."""
    storage = config.storage_path or str(Path(config.out).resolve().parent / "ray_storage")
    if "://" not in storage:
        storage = str(Path(storage).expanduser().resolve())
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(config.out).resolve().name) or "raysb"
    return storage, name


def _check_resume_world_size(config: TrainConfig) -> None:
    """Each rank resumes its own counters, so a run continues with the worker count that wrote it."""
    saved = Path(config.out) / "config.yaml"
    if not saved.exists():
        return
    written_by = TrainConfig.load(saved).workers
    # --workers 0 (the in-process debug mode) and 1 both train as one rank.
    if max(written_by, 1) != max(config.workers, 1):
        raise ConfigError(f"--resume: {config.out} was trained with --workers {written_by}; resume it with the same")


def train_distributed(config: TrainConfig, log: Callable[[str], None], callbacks: Sequence = ()):
    """`callbacks`: Ray Train callbacks, e.g. Tune's TuneReportCallback when a Tune trial drives this run."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from raysb.distributed.worker import worker_loop
    from raysb.training.loop import RunResult

    # Workers on other nodes must write where this driver reads.
    config.out = str(Path(config.out).resolve()) if "://" not in config.out else config.out
    storage, name = storage_location(config)
    run_folder = Path(storage) / name
    if "://" not in storage:
        if run_folder.exists() and not config.resume:
            raise ConfigError(
                f"{run_folder} already holds a run; pass --resume to continue it or choose another --out"
            )
        if config.resume and not run_folder.exists():
            raise ConfigError(f"--resume: no earlier run at {run_folder}")
    if config.resume:
        _check_resume_world_size(config)
    connect_ray(config.address)
    check_resources(config)
    datasets, dataset_config = {}, None
    if config.data_mode == "stream":
        from ray.data import ExecutionOptions

        from raysb.data.streaming import inspect_split, ray_dataset

        # Inspected here too so that a bad file fails before any worker starts.
        split = inspect_split("train", config.data_dir)
        datasets["train"] = ray_dataset(split).randomize_block_order(seed=config.seed)
        # An ordered execution deals the same blocks to the same rank in the same
        # order every epoch and after a restart, which exact resume needs; each
        # rank's shuffle buffer, seeded per epoch from checkpointed state, varies
        # the order within them.
        dataset_config = ray.train.DataConfig(execution_options=ExecutionOptions(preserve_order=True))

    use_gpu = config.gpus_per_worker > 0
    resources = {"CPU": config.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = config.gpus_per_worker
    trainer = TorchTrainer(
        worker_loop,
        train_loop_config=config.to_dict(),
        datasets=datasets,
        dataset_config=dataset_config,
        scaling_config=ray.train.ScalingConfig(
            num_workers=config.workers, use_gpu=use_gpu, resources_per_worker=resources
        ),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=ray.train.RunConfig(
            storage_path=storage,
            name=name,
            failure_config=ray.train.FailureConfig(max_failures=config.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            callbacks=[*callbacks, _commit_recorder(Path(config.out))],
        ),
    )
    log(f"raysb: Ray Train with {config.workers} worker(s); checkpoints in {run_folder}")
    try:
        with watch_cluster(f"the run in {config.out}", lambda: _resume_hint(config)):
            trainer.fit()
    except ray.train.TrainingFailedError as error:
        raise _root_cause(error) from None

    out = Path(config.out)
    summary = json.loads((out / "summary.json").read_text())
    metrics = pq.read_table(out / "metrics.parquet").to_pylist()
    return RunResult(out, metrics, summary)


def _commit_recorder(out: Path):
    """A callback on the Train controller that writes out/last_checkpoint.json once Ray Train
    has committed a checkpoint: the one `--resume` or a restart continues from."""
    import ray.train

    from raysb.distributed.drills import COMMITTED_FILE
    from raysb.training.outputs import write_json

    class CommitRecorder(ray.train.UserCallback):
        def after_report(self, run_context, metrics, checkpoint) -> None:
            if checkpoint is not None:
                write_json(out / COMMITTED_FILE, {"epoch": metrics[0]["epoch"], "path": checkpoint.path})

    return CommitRecorder()


def _root_cause(error: Exception) -> Exception:
    """Turn a worker-group failure back into the error a user can act on."""
    failures = getattr(error, "worker_failures", None) or {}
    for failure in failures.values():
        text = str(failure)
        if "NonFiniteLossError" in text or "NaN or infinite" in text or "not finite" in text:
            message = text.strip().splitlines()[-1]
            return NonFiniteLossError(message.split("NonFiniteLossError: ")[-1])
        for kind in (ConfigError, ValueError):
            if kind.__name__ in text:
                return ConfigError(text.strip().splitlines()[-1].split(f"{kind.__name__}: ")[-1])
    return error
