"""The Ray cluster a run uses: connect to it, watch that it stays up, check it can hold the run."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from raysb.config import ConfigError
from raysb.core.settings import Settings
from raysb.distributed.ray_internals import (
    JOB_CONFIG_VARIABLE, address_of_started_cluster, autoscaler_limits, canonical_address, local_cpu_count,
    this_node_endpoints,
)

# The exit status of a driver whose Ray cluster went away under it (raysb.distributed.launch.watch_cluster).
CLUSTER_LOST_EXIT_CODE = 3


class ClusterError(RuntimeError):
    """Ray cannot be reached, or cannot ever give the resources a run asks for."""


def connect_ray(address: str | None, log_to_driver: bool = True) -> None:
    """Join the cluster at `address`, or start a private local Ray instance.

    Without an address, `ray.init()` would join whatever cluster
    /tmp/ray/ray_current_cluster names, even one whose processes are long gone,
    and wait on it for minutes. So no address means a private instance, unless
    RAY_ADDRESS names a cluster (as Ray Jobs does for the driver it launches).
    A named cluster is resolved and probed first, so a dead one fails in seconds.
    `log_to_driver=False` keeps Ray's worker output in Ray's log files (`raysb train`
    without --verbose: rank 0's lines come through raysb.distributed.console), Ray's own
    lines in this process below errors (its token-auth warning, the dashboard's address), and
    Ray Data's progress bars and info lines off this console (`_ray_data_off_the_console`).
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
        ray.init(address=address, log_to_driver=log_to_driver,
                 logging_level=logging.INFO if log_to_driver else logging.ERROR)
    except (ConnectionError, RuntimeError, ValueError) as error:
        where = "a new local Ray instance" if address == "local" else address
        raise ClusterError(f"cannot connect to Ray at {where}: {error}") from None
    if not log_to_driver:
        _ray_data_off_the_console()


def _ray_data_off_the_console() -> None:
    """No Ray Data progress bars, and its lines below errors, as Ray's own: its info lines (each
    execution's plan and progress, 13 lines for the tabular example's one read) would outnumber a
    run's own. Ray Data logs through a logger of its own, which ray.init's `logging_level` does not reach."""
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.ERROR)


def _resolve(address: str) -> str | None:
    """host:port of the cluster `address` names; None for a ray:// client address.

    `auto` is the cluster `ray start` last started here (RAY_ADDRESS, else
    /tmp/ray/ray_current_cluster), and only without either any Ray instance
    found running on this machine, as Ray's own `auto` would pick. A stale file
    is then an error, not a silent switch to some other instance.
    """
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or address_of_started_cluster() or "auto"
    if address.startswith("ray://"):
        return None
    try:
        return canonical_address(address)
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
    endpoints = this_node_endpoints()
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


def cluster_capacity() -> tuple[float, float]:
    """The connected Ray cluster's CPUs and GPUs now, all nodes together."""
    import ray

    resources = ray.cluster_resources()
    return resources.get("CPU", 0.0), resources.get("GPU", 0.0)


def autoscaler_ceiling(now: tuple[float, float]) -> tuple[float, float] | None:
    """The CPUs and GPUs the connected cluster can grow to from `now` (its `cluster_capacity()`),
    where Ray reports its autoscaler's limits (KubeRay does); None where it does not, as for VM
    launcher clusters and clusters of `ray start` nodes."""
    most = autoscaler_limits()
    if not most:
        return None
    cpus, gpus = now
    return max(cpus, float(most.get("CPU", 0))), max(gpus, float(most.get("GPU", 0)))


def local_capacity() -> tuple[float, float]:
    """The CPUs and GPUs a new local Ray instance will have, known before it starts (Ray counts
    CPUs so, its cgroup quota included; the GPUs are those CUDA shows this process)."""
    import torch

    return local_cpu_count(), float(torch.cuda.device_count())


def check_resources(settings: Settings, capacity: tuple[float, float] | None = None) -> str | None:
    """Refuse a run that can never be scheduled instead of letting it wait forever; the line
    to print when it must wait for nodes an autoscaler may add (None when it fits now).
    `capacity`: the CPUs and GPUs to check against instead of the connected cluster's."""
    cluster, scoring = settings.cluster, settings.scoring
    actor = scoring.pipeline == "actor"
    # Each worker's scoring actor (raysb.training.selection.pipeline) holds its own resources.
    return check_worker_resources(
        max(cluster.workers, 1),
        cluster.cpus_per_worker + (scoring.pipeline_cpus if actor else 0.0),
        cluster.gpus_per_worker + (scoring.pipeline_gpus if actor else 0.0),
        reads_ray_data=settings.data.data_mode == "stream",
        per_worker=" (its scoring actor included)" if actor else "",
        may_grow=cluster.address is not None or "RAY_ADDRESS" in os.environ,
        placement_timeout=cluster.placement_timeout,
        capacity=capacity,
    )


def check_worker_resources(
    workers: int,
    cpus_per_worker: float,
    gpus_per_worker: float = 0.0,
    reads_ray_data: bool = False,
    per_worker: str = "",
    may_grow: bool = False,
    placement_timeout: float | None = None,
    capacity: tuple[float, float] | None = None,
) -> str | None:
    """Refuse, in one line and at once, a Ray Train worker group the connected cluster can never
    hold, and one that would leave Ray Data no CPU: its read tasks would then wait for a CPU
    the workers never free, and the run would hang at 0 rows. Call it before `fit()` in your
    own Ray Train loop as `raysb train` does (examples/ do).

    A cluster can hold what it has now, or what its autoscaler reports it can grow to. Where
    the autoscaler reports nothing, `may_grow` (an existing cluster was joined: clusters/'
    launcher configs start with no GPU node) lets a group larger than the cluster wait for
    nodes instead of being refused; the line returned says so, for the caller to print.
    `capacity` (CPUs, GPUs) stands for the cluster's before Ray starts (`local_capacity`).
    """
    now_cpus, now_gpus = capacity or cluster_capacity()
    need_cpus, need_gpus = workers * cpus_per_worker, workers * gpus_per_worker
    short = need_cpus > now_cpus or need_gpus > now_gpus
    waits = f"up to --placement-timeout {placement_timeout:g}s" if placement_timeout else "until they are added"
    waiting = (
        f"raysb: the workers need {need_cpus:g} CPUs and {need_gpus:g} GPUs, the Ray cluster has {now_cpus:g} "
        f"and {now_gpus:g} now: waiting {waits} for its autoscaler to add nodes"
    )
    ceiling = autoscaler_ceiling((now_cpus, now_gpus)) if capacity is None else None
    if ceiling is None and may_grow and short:
        # Nothing says how far the cluster can grow: the placement timeout bounds the wait.
        return waiting
    cpus, gpus = ceiling or (now_cpus, now_gpus)
    if need_cpus > cpus:
        raise ClusterError(
            f"{workers} worker(s) x {cpus_per_worker:g} CPU{per_worker} need {need_cpus:g} CPUs; "
            f"the Ray cluster has {cpus:g}. Lower the workers or the CPUs per worker (fractions are allowed)"
        )
    if need_gpus > gpus:
        raise ClusterError(
            f"{workers} worker(s) x {gpus_per_worker:g} GPU{per_worker} need {need_gpus:g} GPUs; "
            f"the Ray cluster has {gpus:g}"
        )
    if reads_ray_data and cpus - need_cpus < 1:
        raise ClusterError(
            f"Ray Data reads and decodes in tasks beside the workers, which need at least 1 CPU the "
            f"workers do not take; the workers take {need_cpus:g} of {cpus:g}. Lower the workers or "
            "the CPUs per worker (fractions are allowed)"
        )
    return waiting if short else None


def check_paths_outlive_the_job(paths: dict[str, str | None]) -> None:
    """Inside a Ray job, refuse any of `paths` (flag -> path, e.g. --out, --storage-path) that
    would be written into Ray's temporary copy of the working directory, which goes with the job.

    A relative path lands there (the job's driver runs in that copy), and so does an
    absolute one below the driver's working directory. Data read from the working
    directory is fine: only what the run writes must outlive it.
    """
    if JOB_CONFIG_VARIABLE not in os.environ:
        return
    here = Path.cwd().resolve()
    for flag, value in paths.items():
        if value is None or "://" in value:
            continue
        path = Path(value).expanduser()
        if not path.is_absolute() or path.resolve().is_relative_to(here):
            raise ConfigError(
                f"{flag} {value}: inside a Ray job this is written into Ray's temporary copy of the working "
                f"directory ({here}), which is deleted with the job; give an absolute path on storage every "
                f'node shares (e.g. {flag} "$PWD/runs/NAME" on one machine, {flag} /mnt/shared/runs/NAME on a cluster)'
            )
