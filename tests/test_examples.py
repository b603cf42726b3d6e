"""The examples under examples/ run as README.md shows them, at small sizes."""

import importlib
import sys
from pathlib import Path

import pytest

from conftest import needs_fashion_mnist

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str):
    """Import examples/NAME.py; Ray workers get its functions by value, as they would from a script."""
    import ray.cloudpickle

    sys.path.insert(0, str(EXAMPLES))
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))
    ray.cloudpickle.register_pickle_by_value(module)
    return module


def test_tabular_mlp_on_two_ray_train_workers_reads_parquet_through_ray_data(ray_session, tmp_path, capsys):
    pytest.importorskip("sklearn")
    tabular = example("tabular_ray_train")
    metrics = tabular.main(["--workers", "2", "--epochs", "3", "--lr", "0.03", "--out", str(tmp_path)])
    # Predicting the mean gives an RMSE of one target standard deviation (about 77 here).
    assert metrics["test_rmse"] < 65
    assert metrics["backprop_examples"] == 16 * metrics["optimizer_steps"] > 0
    assert 0.2 < metrics["kept_fraction"] < 0.6  # beta 1: about half, fewer while losses fall
    assert "final test RMSE" in capsys.readouterr().out


@needs_fashion_mnist
def test_own_cnn_with_label_smoothing_in_one_process(tmp_path):
    cnn = example("fashion_mnist_cnn")
    metrics = cnn.main(["--workers", "0", "--epochs", "2", "--subset", "4000", "--out", str(tmp_path)])
    assert metrics["test_error"] < 0.3
    assert metrics["kept_fraction"] < 0.45 and metrics["backprop_examples"] == 64 * metrics["optimizer_steps"]


@needs_fashion_mnist
def test_own_cnn_with_label_smoothing_on_two_workers(ray_session, tmp_path):
    cnn = example("fashion_mnist_cnn")
    metrics = cnn.main(["--workers", "2", "--epochs", "1", "--subset", "3000", "--batch-size", "32",
                        "--out", str(tmp_path)])
    assert metrics["test_error"] < 0.45
    # Rank 0 trained on a full batch of 32 at every step, whatever it kept itself.
    assert metrics["backprop_examples"] == 32 * metrics["optimizer_steps"] > 0


@needs_fashion_mnist
def test_tune_sweep_over_beta_and_staleness_of_a_users_trainable(ray_session, tmp_path, capsys):
    sweep = example("tune_sweep")
    rows = sweep.main(["--betas", "1", "3", "--staleness", "1", "2", "--epochs", "2", "--subset", "3000",
                       "--out", str(tmp_path)])
    by_setting = {(row["beta"], row["staleness"]): row for row in rows}
    assert sorted(by_setting) == [(1, 1), (1, 2), (3, 1), (3, 2)]
    for beta in (1, 3):
        # Stale-SB(2) scored its first epoch only; SB scored both.
        assert by_setting[(beta, 2)]["selection_forward_examples"] == 3000
        assert by_setting[(beta, 1)]["selection_forward_examples"] == 6000
    for n in (1, 2):  # a larger beta keeps fewer examples
        assert by_setting[(3, n)]["backprop_examples"] < by_setting[(1, n)]["backprop_examples"]
    assert all(row["test_error"] < 0.7 for row in rows) and min(row["test_error"] for row in rows) < 0.45
    assert "Pareto" in capsys.readouterr().out
