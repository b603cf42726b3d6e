"""What raysb.distributed.ray_internals relies on is still in the installed Ray: each private name,
signature and behaviour it uses. A Ray upgrade that changes one fails here, naming it, instead
of silently in a run (Ctrl-C printing Ray's line or leaving the workers training, a placement
timeout or a worker's ConfigError reported as Ray's error, the cluster watch or the capacity checks
reading nothing, Tune's tables in a quiet sweep)."""

import inspect
import traceback

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
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE, WORKER_GROUP_START_TIMEOUT_S_ENV_VAR

    assert ray_internals.JOB_CONFIG_VARIABLE == RAY_JOB_CONFIG_JSON_ENV_VAR
    assert ray_internals.WORKER_GROUP_START_TIMEOUT_VARIABLE == WORKER_GROUP_START_TIMEOUT_S_ENV_VAR
    # The driver sets it around fit(); it reaches the controller, which reads it, only because fit()
    # sends the variables of this set to the controller's environment.
    assert ray_internals.WORKER_GROUP_START_TIMEOUT_VARIABLE in ENV_VARS_TO_PROPAGATE
    assert "get_env_vars_to_propagate()" in inspect.getsource(TorchTrainer._initialize_and_run_controller)


def test_tune_prints_its_older_output_under_the_variable(monkeypatch):
    from ray.tune.experimental.output import get_air_verbosity
    from ray.tune.tune import run

    monkeypatch.delenv(ray_internals.TUNE_NEW_OUTPUT_VARIABLE, raising=False)
    assert get_air_verbosity(0) is not None  # the newer output
    with ray_internals.tune_older_output():
        assert get_air_verbosity(0) is None
    # Read as a Tuner's fit() starts: it runs tune.run in this process, which asks for the output.
    assert "get_air_verbosity(verbose)" in inspect.getsource(run)


def test_fit_still_registers_its_sigint_handler_through_the_overridden_method():
    assert parameters(TorchTrainer._register_sigint_handler) == ["self", "controller"]
    # The override is only a hook while fit() reaches Ray's handler through it.
    assert "self._register_sigint_handler(controller)" in inspect.getsource(TorchTrainer._initialize_and_run_controller)
    trainer = ray_internals.trainer_leaving_sigint(lambda: None, scaling_config=ray.train.ScalingConfig(num_workers=1))
    assert isinstance(trainer, TorchTrainer) and trainer.controller is None
    trainer._register_sigint_handler("the controller")
    assert trainer.controller == "the controller"


def test_the_controller_still_aborts_a_run_as_rays_own_sigint_handler_does():
    from ray.train.v2._internal.execution.controller import TrainController
    from ray.train.v2.api import data_parallel_trainer

    # The controller handed to the overridden method is an actor of this class...
    assert data_parallel_trainer.TrainController is TrainController
    assert "(TrainController)" in inspect.getsource(TorchTrainer._initialize_and_run_controller)
    # ...whose abort is an actor method that abort_train_run calls with no arguments, as Ray does.
    assert inspect.iscoroutinefunction(TrainController.abort)
    methods = ray.remote(TrainController).__ray_metadata__.method_meta
    assert "abort" in methods.methods
    inspect.Signature(methods.signatures["abort"]).bind()
    assert "ray.get(controller.abort.remote())" in inspect.getsource(TorchTrainer._register_sigint_handler)
    ray_internals.abort_train_run(None, timeout_s=1.0)  # local mode: no controller, nothing to do


def test_a_worker_that_dies_as_its_group_starts_is_restarted_within_max_failures():
    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError, WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.failure_handling import FailureDecision

    policy = ray_internals.failure_policy_restarting_failed_starts(
        ray.train.FailureConfig(max_failures=2, controller_failure_limit=0))
    died_starting = ray.train.ControllerError(WorkerGroupStartupFailedError("a worker died as the group started"))
    died_running = ray.train.WorkerGroupError("a worker died", {0: RuntimeError("lost")})
    # A death as a group starts and one while it runs draw on the one budget of max_failures.
    assert policy.make_decision(died_running) == FailureDecision.RETRY
    assert policy.make_decision(died_starting) == FailureDecision.RETRY
    assert policy.make_decision(died_starting) == FailureDecision.RAISE
    # A group that cannot be placed stays a controller failure, of which none is allowed.
    fresh = ray_internals.failure_policy_restarting_failed_starts(
        ray.train.FailureConfig(max_failures=2, controller_failure_limit=0))
    assert fresh.make_decision(ray.train.ControllerError(WorkerGroupStartupTimeoutError(num_workers=2))) \
        == FailureDecision.RAISE


def test_fit_hands_its_controller_the_failure_policy_the_trainer_puts_in_its_place(monkeypatch):
    from ray.train.v2.api import data_parallel_trainer

    # fit() builds the policy and passes it by this keyword to the method the trainer overrides.
    assert "failure_policy=create_failure_policy(" in inspect.getsource(data_parallel_trainer.DataParallelTrainer.fit)
    keywords = inspect.signature(TorchTrainer._initialize_and_run_controller).parameters.values()
    assert [parameter.kind for parameter in keywords][-1] is inspect.Parameter.VAR_KEYWORD
    handed = {}
    monkeypatch.setattr(TorchTrainer, "_initialize_and_run_controller", lambda self, **options: handed.update(options))
    trainer = ray_internals.trainer_leaving_sigint(
        lambda: None, scaling_config=ray.train.ScalingConfig(num_workers=1),
        run_config=ray.train.RunConfig(failure_config=ray.train.FailureConfig(max_failures=3)))
    trainer._initialize_and_run_controller(failure_policy="Ray's default", train_fn_ref=None)
    assert type(handed["failure_policy"]).__name__ == "RestartingFailedStarts"
    assert handed["failure_policy"].failure_config.max_failures == 3 and handed["train_fn_ref"] is None


def test_a_placement_timeout_is_recognized():
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    timed_out = ray.train.ControllerError(WorkerGroupStartupTimeoutError(num_workers=2))
    assert ray_internals.worker_group_start_timed_out(timed_out)
    assert not ray_internals.worker_group_start_timed_out(ray.train.ControllerError(RuntimeError("other")))


def ray_call_failure(raise_error) -> Exception:
    """The error ray.get raises on a rank when `raise_error` failed in the Ray call it waits for,
    built as Ray builds it (ray.dag.compiled_dag_node._wrap_exception, ray.get's
    as_instanceof_cause) but without starting Ray: its text is the remote traceback."""
    from ray._private.utils import format_error_message
    from ray.exceptions import RayTaskError

    try:
        raise_error()
    except Exception as raised:
        cause = raised
    remote_traceback = format_error_message("".join(traceback.format_exception(cause)), task_exception=True)
    error = RayTaskError("score", remote_traceback, cause, proctitle="ray::ScoringActor.score", pid=7, ip="10.0.0.2")
    return error.as_instanceof_cause()


def fit_error(failures: dict[int, Exception]) -> Exception:
    """fit()'s error when these ranks raised these errors and the others finished, built as Ray
    Train's controller builds it from its workers' statuses and sent to the driver."""
    from ray import cloudpickle
    from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus
    from ray.train.v2._internal.util import construct_user_exception_with_traceback

    statuses = {0: WorkerStatus(running=False)}
    for rank, failure in failures.items():
        try:
            raise failure
        except Exception as raised:  # as a worker's training thread catches it
            statuses[rank] = WorkerStatus(running=False, error=construct_user_exception_with_traceback(raised))
    error = WorkerGroupPollStatus(statuses).get_worker_group_error()
    return cloudpickle.loads(cloudpickle.dumps(error))


def raises(error: Exception):
    def raise_error():
        raise error

    return raise_error


def test_a_ranks_error_is_found_in_the_worker_group_error():
    # Raised by the training function: Ray Train hands it over as raised.
    other_config = "--resume: the checkpoint was written by another config"
    refused = ray_internals.user_error_of(fit_error({1: ConfigError(other_config)}))
    assert type(refused) is ConfigError and str(refused) == other_config
    lost = ray_internals.user_error_of(fit_error({1: NonFiniteLossError("training loss is not finite at step 3")}))
    assert type(lost) is NonFiniteLossError and str(lost) == "training loss is not finite at step 3"

    # Raised inside a Ray call of the rank's: named by its remote traceback after the last frame.
    wrapped = fit_error({1: ray_call_failure(raises(NonFiniteLossError("2 of 8 losses are NaN or infinite")))})
    lost = ray_internals.user_error_of(wrapped)
    assert type(lost) is NonFiniteLossError and str(lost) == "2 of 8 losses are NaN or infinite"
    wrapped = fit_error({1: ray_call_failure(raises(ConfigError("bad split\nname one of train, test")))})
    refused = ray_internals.user_error_of(wrapped)
    assert type(refused) is ConfigError and str(refused) == "bad split\nname one of train, test"
    refused = ray_internals.user_error_of(fit_error({1: ray_call_failure(lambda: int("ten"))}))
    assert type(refused) is ConfigError and str(refused) == "invalid literal for int() with base 10: 'ten'"

    # A ValueError or a NaN's words elsewhere in the text are not the rank's error.
    def chained():
        try:
            raise ValueError("a retried read")
        except ValueError as error:
            raise RuntimeError("the scoring actor crashed") from error

    crashed = fit_error({1: ray_call_failure(chained)})
    assert "\nValueError: a retried read\n" in str(crashed.worker_failures[1])
    assert ray_internals.user_error_of(crashed) is None
    assert ray_internals.user_error_of(fit_error({1: RuntimeError("ValueError: loss is NaN or infinite")})) is None
    assert ray_internals.user_error_of(ray.train.ControllerError(RuntimeError("other"))) is None
