"""Every use of Ray's private API (`ray._private`, `ray.train.v2._internal`, private methods, the
format of errors), in one place, each where Ray offers no public way to do the same.

A new Ray release may move or change any of these without notice: tests/test_ray_internals.py
checks that the installed Ray still has each one as used here (names, signatures, the call that
reaches the overridden method), so an upgrade fails there, loudly, instead of somewhere in a run.
Ray is imported inside each function: `raysb.distributed` loads Ray only when a run needs it.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

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

# "0" picks Tune's older console output, which keeps quiet at verbose=0; the newer one prints the
# experiment's table, folder and TensorBoard command even there. No TuneConfig or RunConfig field
# picks it (read by ray.tune.experimental.output.get_air_verbosity when the Tuner's fit() starts).
TUNE_NEW_OUTPUT_VARIABLE = "RAY_AIR_NEW_OUTPUT"


def tune_older_output():
    """Within this context, a Tuner's fit() in this process prints Tune's older console output."""
    return mock.patch.dict(os.environ, {TUNE_NEW_OUTPUT_VARIABLE: "0"})


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
    in this process), and that restarts a worker group whose worker died as it started
    (`failure_policy_restarting_failed_starts`).

    fit() registers Ray's own handler on the main thread, which prints its own line and ends the
    process from inside the handler, with no word of the checkpoint or how to continue. Ray has
    no option to leave SIGINT alone, so this overrides the private method fit() calls for it; and
    no option to choose a failure policy, so this replaces the one fit() hands its controller."""
    from ray.train.torch import TorchTrainer

    class Trainer(TorchTrainer):
        controller = None

        def _register_sigint_handler(self, controller) -> None:
            self.controller = controller

        def _initialize_and_run_controller(self, **controller_options):
            controller_options["failure_policy"] = failure_policy_restarting_failed_starts(
                self.run_config.failure_config)
            return super()._initialize_and_run_controller(**controller_options)

    return Trainer(train_loop, **options)


def failure_policy_restarting_failed_starts(failure_config):
    """Ray Train's default failure policy, except that a worker group one of whose workers died while
    the group started (Ray's WorkerGroupStartupFailedError) is a worker-group failure, restarted from
    the last checkpoint while `max_failures` allows, as the death of a running worker is.

    Ray counts it as a controller failure, and raysb allows none of those (`controller_failure_limit=0`,
    so that a group Ray cannot place ends the run after one --placement-timeout instead of being
    retried forever). A worker can die as its group starts, and a lost node's group is restarted at
    once: in one CI run of tests/test_two_nodes.py the restart after a node loss had a worker die
    while it started (Ray's log said only that its connection ended; the cause was not found), and a
    job with a failure to spare ended. Whatever kills a starting worker, its group deserves the same
    restart as a running one's. The policy is pickled to the controller actor, so it is a class
    built here from Ray's, not one defined at import."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
    from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

    class RestartingFailedStarts(DefaultFailurePolicy):
        def make_decision(self, training_failed_error):
            if isinstance(training_failed_error, ControllerError) and isinstance(
                    training_failed_error.controller_failure, WorkerGroupStartupFailedError):
                training_failed_error = WorkerGroupError(str(training_failed_error), {})
            return super().make_decision(training_failed_error)

    return RestartingFailedStarts(failure_config)


def abort_train_run(controller, timeout_s: float) -> None:
    """End the run of a trainer_leaving_sigint's `controller` now (nothing to do for None, local
    mode): its worker group stops and the controller actor exits, waiting up to `timeout_s`.

    What Ray's own SIGINT handler does, which that trainer keeps from running: Ray Train has no
    public way to stop a run that fit() started, only the internal controller's `abort` method."""
    import ray

    if controller is None:
        return
    # abort() ends the controller actor, so its call fails once it has done its work.
    with contextlib.suppress(ray.exceptions.RayError):
        ray.get(controller.abort.remote(), timeout=timeout_s)


def worker_group_start_timed_out(error: Exception) -> bool:
    """Whether fit() failed because the worker group could not be placed in time (a
    ray.train.ControllerError whose cause is Ray's internal WorkerGroupStartupTimeoutError,
    which Ray Train does not export)."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    return isinstance(getattr(error, "controller_failure", None), WorkerGroupStartupTimeoutError)


def user_error_of(error: Exception) -> Exception | None:
    """The error a user can act on that a rank raised, from fit()'s ray.train.WorkerGroupError;
    None if no rank raised one.

    `worker_failures` holds each rank's exception as the training function raised it, unwrapped
    by Ray Train, so raysb's errors are recognized by their class. One raised inside a Ray call of
    the rank's arrives as Ray's error for that call (ray.exceptions.RayTaskError), whose text is the
    remote traceback and whose class need not survive: there the error is the one Python names on
    the line after the traceback's last frame, and nothing else in the text (a frame's source line,
    an earlier error of a chain, a message's words) counts.
    """
    from ray.exceptions import RayTaskError

    failures = getattr(error, "worker_failures", None) or {}
    for failure in failures.values():
        if isinstance(failure, RayTaskError):
            name, message = _raised(str(failure))
            kind = _WRAPPED_USER_ERRORS.get(name)
        else:
            kind = next((kind for kind in (ConfigError, NonFiniteLossError) if isinstance(failure, kind)), None)
            message = str(failure)
        if kind is not None:
            return kind(message)
    return None


def _traceback_name(kind: type) -> str:
    """How a Python traceback names an error of class `kind`: module and class, a builtin's bare."""
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


# A Ray call's error, by the name its traceback gives it: raysb's own as themselves, and a plain
# ValueError (a value the rank's code could not use) as a ConfigError.
_WRAPPED_USER_ERRORS = {
    _traceback_name(NonFiniteLossError): NonFiniteLossError,
    _traceback_name(ConfigError): ConfigError,
    _traceback_name(ValueError): ConfigError,
}


def _raised(traceback_text: str) -> tuple[str, str]:
    """The name and message of the error a Python traceback ends with: the first unindented line
    after its last frame (`  File ...` and the frame's indented lines) is `name: message`, and the
    message goes on over any lines that follow."""
    lines = traceback_text.strip().splitlines()
    last_frame = max((index for index, line in enumerate(lines) if line.startswith("  File ")), default=0)
    after = lines[last_frame + 1:]
    for index, line in enumerate(after):
        if not line.startswith(" "):
            name, _, message = line.partition(": ")
            return name, "\n".join([message, *after[index + 1:]])
    return "", ""
