"""No deprecated call of raysb's own, and a suite that fails on one (pyproject.toml's filterwarnings)."""

import warnings

import pytest
import torch

from raysb.data import ImageDataset, load_splits, write_parquet
from raysb.data.streaming import inspect_splits


def warn_deprecated_from(module: str, stacklevel: int = 1) -> None:
    """A DeprecationWarning that Python attributes to `module`, as if raised in its code."""
    code = f"import warnings\nwarnings.warn('old thing', DeprecationWarning, stacklevel={stacklevel})"
    exec(compile(code, module.replace(".", "/") + ".py", "exec"), {"__name__": module})


def test_parquet_images_round_trip_without_deprecation_warnings(tmp_path):
    # The user's case: torchvision.io's decode_image/encode_png warned at every image (4,980 times a suite).
    data = ImageDataset(
        images=torch.randint(0, 256, (12, 3, 8, 8), dtype=torch.uint8),
        labels=torch.arange(12) % 3,
        sample_ids=torch.arange(12),
        num_classes=3,
        mean=(0.5,) * 3,
        std=(0.25,) * 3,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        write_parquet(data, tmp_path / "train.parquet")
        write_parquet(data, tmp_path / "test.parquet")
        train, _ = load_splits("parquet", str(tmp_path))
        streamed = list(inspect_splits(str(tmp_path))[1].batches(5))
    assert torch.equal(train.images, data.images) and len(streamed) == 3
    assert [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)] == []


@pytest.mark.parametrize("module", ["raysb", "raysb.data.parquet"])
def test_a_deprecation_warning_from_raysb_fails_the_suite(module):
    with pytest.raises(DeprecationWarning, match="old thing"):
        warn_deprecated_from(module)


@pytest.mark.parametrize("module", ["ray.data.context", "raysbx", "tests.test_data"])
def test_other_modules_deprecation_warnings_only_warn(module):
    # Ray's own deprecations (Ray Data warns about its defaults) are Ray's to fix, not a failure here.
    with pytest.warns(DeprecationWarning, match="old thing"):
        warn_deprecated_from(module)
