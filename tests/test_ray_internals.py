"""What raysb.distributed.ray_internals relies on is still in the installed Ray: each private name,
signature and behaviour it uses. A Ray upgrade that changes one fails here, naming it, instead
of silently in a run (Ctrl-C printing Ray's line, a placement timeout or a worker's ConfigError
reported as Ray's error, the cluster watch or the capacity checks reading nothing)."""

import inspect

import ray
import ray.train
from ray.train.torch import TorchTrainer

from raysb.config import ConfigError
from raysb.core.errors import NonFiniteLossError
from raysb.distributed import ray_internals


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_the_private_functions_used_are_there_with_their_signatures():
    from ray._private.services import canonicalize_bootstrap_address
    from ray._private.state import state
    from ray._private.utils import get_num_cpus, read_ray_address

    assert parameters(canonicalize_bootstrap_address)[0] == "addr"
    assert parameters(read_ray_address) == ["temp_dir"]
    assert parameters(state.get_max_resources_from_cluster_config) == []
    assert ray_internals.local_cpu_count() == float(get_num_cpus()) > 0
    assert ray_internals.canonical_address("127.0.0.1:6379").endswith(":6379")  # localhost as this node's IP


def test_the_driver_node_has_the_addresses_the_cluster_watch_probes():
    # Set when a driver connects; read by this_node_endpoints, checked here on the class so no
    # Ray instance need start.
    worker = ray._private.worker.Worker()
    assert hasattr(worker, "node")
    from ray._private.node import Node

    for attribute in ("gcs_address", "node_ip_address", "node_manager_port"):
        assert isinstance(getattr(Node, attribute, None), property), attribute


def test_the_environment_variables_are_the_ones_ray_reads():
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
    from ray.train.v2._internal.constants import WORKER_GROUP_START_TIMEOUT_S_ENV_VAR

    assert ray_internals.JOB_CONFIG_VARIABLE == RAY_JOB_CONFIG_JSON_ENV_VAR
    assert ray_internals.WORKER_GROUP_START_TIMEOUT_VARIABLE == WORKER_GROUP_START_TIMEOUT_S_ENV_VAR


def test_fit_still_registers_its_sigint_handler_through_the_overridden_method():
    assert parameters(TorchTrainer._register_sigint_handler) == ["self", "controller"]
    # The override is only a hook while fit() reaches Ray's handler through it.
    assert "self._register_sigint_handler(controller)" in inspect.getsource(TorchTrainer._initialize_and_run_controller)
    trainer = ray_internals.trainer_leaving_sigint(lambda: None, scaling_config=ray.train.ScalingConfig(num_workers=1))
    assert isinstance(trainer, TorchTrainer) and trainer.controller is None
    trainer._register_sigint_handler("the controller")
    assert trainer.controller == "the controller"


def test_a_placement_timeout_is_recognized():
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    timed_out = ray.train.ControllerError(WorkerGroupStartupTimeoutError(num_workers=2))
    assert ray_internals.worker_group_start_timed_out(timed_out)
    assert not ray_internals.worker_group_start_timed_out(ray.train.ControllerError(RuntimeError("other")))


def test_a_ranks_error_is_found_in_the_worker_group_error():
    def failed(failure: Exception) -> Exception:
        return ray.train.WorkerGroupError("rank 1 failed", {1: failure})

    refused = ray_internals.user_error_of(failed(ConfigError("--resume: the checkpoint was written by another config")))
    assert isinstance(refused, ConfigError) and str(refused) == "--resume: the checkpoint was written by another config"
    # An error that reaches the driver only as a remote traceback's text.
    wrapped = RuntimeError("Traceback (most recent call last):\n  ...\nraysb.core.errors.NonFiniteLossError: loss is NaN or infinite")
    lost = ray_internals.user_error_of(failed(wrapped))
    assert isinstance(lost, NonFiniteLossError) and str(lost) == "loss is NaN or infinite"
    assert ray_internals.user_error_of(failed(RuntimeError("a crash"))) is None
    assert ray_internals.user_error_of(ray.train.ControllerError(RuntimeError("other"))) is None
