import os
from pathlib import Path

import pytest

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fashion_mnist = pytest.mark.skipif(
    not FASHION_MNIST.is_dir(), reason="needs Debian's dataset-fashion-mnist package"
)


# Every Ray the suite starts, its own and those of the clusters, jobs and examples it runs in
# subprocesses (they pass this on), gets these:
# - Ray Train's controller polls its workers every 2 s by default; each fit waits on that poll to
#   start, to commit checkpoints and to end, and a worker's next ray.train.report blocks until the
#   poll has taken its last one (measured: 2.0 s a report at 2 s, 0.2 s at 0.2 s). A run of short
#   epochs, as every test's is, waits ~2 s an epoch.
# - Each fit's controller starts a preemption watcher, an actor process of its own (about 2.6 s of
#   CPU a fit on this machine, of the ~40 s a 2-worker fit costs), for spot instances that tests do
#   not have.
RAY_TRAIN_TEST_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
for _name, _value in RAY_TRAIN_TEST_ENV.items():
    os.environ.setdefault(_name, _value)


def environment_for_a_new_ray() -> dict[str, str]:
    """This process's environment for a subprocess that starts a Ray of its own: none of the
    RAY_ settings that would point it at another Ray, the suite's Ray Train ones."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | RAY_TRAIN_TEST_ENV


@pytest.fixture(scope="session")
def ray_session():
    """One Ray instance for the whole test session (starting one costs seconds)."""
    import ray

    # More logical CPUs than the 2 cores so the Train controller, two workers
    # and a pipeline's scoring actors can all be scheduled at once.
    # address="local": never join a cluster that /tmp/ray/ray_current_cluster names.
    # log_to_driver=False as raysb joins Ray without --verbose: otherwise an earlier test's
    # leftover Train actor (a PlacementGroupCleaner whose controller had ended) printed onto a
    # later test's stderr, and a check that a CLI error is one line failed in CI.
    # A test that ran the CLI before this fixture existed may have left the CLI's own Ray running in
    # this process (fewer logical CPUs than the suite's): "ray.init twice" when files ran in another order.
    if ray.is_initialized():
        ray.shutdown()
    start_test_ray(ray)
    yield ray
    ray.shutdown()


def start_test_ray(ray) -> None:
    """The test session's Ray instance; a test that shuts it down starts it again with this."""
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=256 * 1024**2,
             log_to_driver=False)


@pytest.fixture(scope="session")
def cifar_shaped_dir(tmp_path_factory):
    """Small learnable CIFAR-shaped images as raysb Parquet (train and test), written here: a lent GPU has
    no data sets."""
    from raysb.bench.gpu import synthetic_cifar
    from raysb.data import write_parquet

    folder = tmp_path_factory.mktemp("cifar-shaped")
    for split, data in zip(("train", "test"), synthetic_cifar(320, 64, 16, seed=0)):
        write_parquet(data, folder / f"{split}.parquet", encoding="raw")
    return str(folder)
