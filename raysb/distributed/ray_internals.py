"""Every use of Ray's private API (`ray._private`, `ray.train.v2._internal`, private methods, the
format of errors), in one place, each where Ray offers no public way to do the same.

A new Ray release may move or change any of these without notice: tests/test_ray_internals.py
checks that the installed Ray still has each one as used here (names, signatures, the call that
reaches the overridden method), so an upgrade fails there, loudly, instead of somewhere in a run.
Ray is imported inside each function: `raysb.distributed` loads Ray only when a run needs it.
"""

from __future__ import annotations

from raysb.config import ConfigError
from raysb.core.errors import NonFiniteLossError

# Set by the Ray job supervisor in the environment of the driver it launches (`ray job submit`),
# and of no other process: the only sign a driver has that it runs as a Ray job
# (ray._private.runtime_env.constants.RAY_JOB_CONFIG_JSON_ENV_VAR).
JOB_CONFIG_VARIABLE = "RAY_JOB_CONFIG_JSON_ENV_VAR"

# How long Ray Train's controller waits for a worker group to be placed; no ScalingConfig or
# RunConfig field sets it (ray.train.v2._internal.constants.WORKER_GROUP_START_TIMEOUT_S_ENV_VAR).
# Read by the controller, which the driver's environment reaches when fit() starts.
WORKER_GROUP_START_TIMEOUT_VARIABLE = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


def address_of_started_cluster() -> str | None:
    """The address of the cluster `ray start` last started on this machine (the file
    /tmp/ray/ray_current_cluster names), or None: what Ray's own `address="auto"` reads,
    which Ray does not expose."""
    from ray._private.utils import read_ray_address

    return read_ray_address()


def canonical_address(address: str) -> str | None:
    """host:port of a cluster address, as `ray.init` resolves it before connecting (so a
    probe reaches the same GCS); raises ConnectionError or ValueError for one that names none."""
    from ray._private.services import canonicalize_bootstrap_address

    return canonicalize_bootstrap_address(address)


def this_node_endpoints() -> dict[str, str]:
    """host:port of the connected cluster's GCS and of this node's raylet, as this driver holds
    them (the raylet's only where it has a port, not under Ray Client): what a TCP probe watches
    to notice the cluster going away."""
    import ray

    node = ray._private.worker.global_worker.node
    endpoints = {"the GCS (head node)": node.gcs_address}
    if getattr(node, "node_manager_port", None):
        endpoints["this node's raylet"] = f"{node.node_ip_address}:{node.node_manager_port}"
    return endpoints


def autoscaler_limits() -> dict | None:
    """The most resources the connected cluster's autoscaler may grow it to, where Ray reports
    them (KubeRay does), else None: what Ray Train itself checks before it places a worker group.
    Ray has no public API for it."""
    from ray._private.state import state

    return state.get_max_resources_from_cluster_config()


def local_cpu_count() -> float:
    """The CPUs a new local Ray instance will have, known before it starts: Ray's own count, its
    cgroup quota included (os.cpu_count() ignores the quota)."""
    from ray._private.utils import get_num_cpus

    return float(get_num_cpus())


def trainer_leaving_sigint(train_loop, **options):
    """A TorchTrainer that leaves SIGINT to raysb (raysb.training.interrupt), keeping the Train
    controller that a Ctrl-C must abort as its `controller` (None in local mode, where the run is
    in this process).

    fit() registers Ray's own handler on the main thread, which prints its own line and ends the
    process from inside the handler, with no word of the checkpoint or how to continue. Ray has
    no option to leave SIGINT alone, so this overrides the private method fit() calls for it."""
    from ray.train.torch import TorchTrainer

    class Trainer(TorchTrainer):
        controller = None

        def _register_sigint_handler(self, controller) -> None:
            self.controller = controller

    return Trainer(train_loop, **options)


def worker_group_start_timed_out(error: Exception) -> bool:
    """Whether fit() failed because the worker group could not be placed in time (a
    ray.train.ControllerError whose cause is Ray's internal WorkerGroupStartupTimeoutError,
    which Ray Train does not export)."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    return isinstance(getattr(error, "controller_failure", None), WorkerGroupStartupTimeoutError)


def user_error_of(error: Exception) -> Exception | None:
    """The error a user can act on that a rank raised, from fit()'s ray.train.WorkerGroupError;
    None if no rank raised one.

    `worker_failures` holds each rank's exception, unwrapped by Ray Train where the training
    function raised it, but an error raised inside a Ray call of the rank's arrives wrapped in
    Ray's error, whose text alone carries it: the remote traceback, ending with the line
    `ErrorName: message`. So the error is recognized by its class where it survived and else by
    its name (or a NaN message's words) in that text, and its message is read from the last line.
    """
    failures = getattr(error, "worker_failures", None) or {}
    for failure in failures.values():
        text = str(failure)
        if isinstance(failure, ConfigError):  # refused on a worker (a resume's config against its checkpoint)
            return ConfigError(_message_of(text, ConfigError))
        if "NonFiniteLossError" in text or "NaN or infinite" in text or "not finite" in text:
            return NonFiniteLossError(_message_of(text, NonFiniteLossError))
        for kind in (ConfigError, ValueError):
            if kind.__name__ in text:
                return ConfigError(_message_of(text, kind))
    return None


def _message_of(text: str, kind: type) -> str:
    """The message of a `kind` error from a failure's text: its last line, less `ErrorName: `."""
    return text.strip().splitlines()[-1].split(f"{kind.__name__}: ")[-1]
