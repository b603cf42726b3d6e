from pathlib import Path

import pytest

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fashion_mnist = pytest.mark.skipif(
    not FASHION_MNIST.is_dir(), reason="needs Debian's dataset-fashion-mnist package"
)


@pytest.fixture(scope="session")
def ray_session():
    """One Ray instance for the whole test session (starting one costs seconds)."""
    import ray

    # More logical CPUs than the 2 cores so the Train controller, two workers
    # and the histogram actor can all be scheduled at once.
    # address="local": never join a cluster that /tmp/ray/ray_current_cluster names.
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=256 * 1024**2)
    yield ray
    ray.shutdown()
