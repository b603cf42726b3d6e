"""Each epoch's metrics row in TensorBoard and MLflow, under metrics.parquet's names, at step = epoch."""

import importlib.machinery
import struct
import sys
import types

import pytest
from tensorboardX.proto.event_pb2 import Event

from raysb.api import train
from raysb.cli import main
from raysb.config import ConfigError, TrainConfig
from raysb.training.metric_sinks import check_sinks_installed, numeric_columns

from conftest import needs_fashion_mnist

pytestmark = needs_fashion_mnist


def config(tmp_path, **overrides) -> TrainConfig:
    values = dict(
        dataset="fashion-mnist", subset=1000, test_subset=300, epochs=2, batch_size=50,
        model_options={"width": 4}, progress_seconds=0, record_analysis=False, out=str(tmp_path / "run"),
    )
    values.update(overrides)
    return TrainConfig.from_dict(values)


def tensorboard_scalars(folder) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from every TFRecord event file in `folder` (length, crc, event, crc)."""
    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_tensorboard_gets_every_metrics_column_at_each_epoch(tmp_path):
    result = train(config(tmp_path, log_to=["tensorboard"]), log=lambda _: None)
    scalars = tensorboard_scalars(result.out_dir / "tensorboard")
    assert set(scalars) == set(numeric_columns(result.metrics[0]))
    for row in result.metrics:
        for name, value in numeric_columns(row).items():
            assert scalars[name][row["epoch"]] == pytest.approx(value, rel=1e-6)


class FakeMlflow(types.ModuleType):
    """The part of MLflow's fluent API the sink calls, recording each call (mlflow itself is an
    optional install, heavy for CI; the same test passed against mlflow-skinny 3.17 with a
    sqlite tracking store when this sink was written)."""

    def __init__(self):
        super().__init__("mlflow")
        self.__spec__ = importlib.machinery.ModuleSpec("mlflow", None)
        self.experiment, self.runs, self.params, self.metrics, self.ended = None, [], {}, {}, 0

    def set_experiment(self, name):
        self.experiment = name

    def start_run(self, run_name, tags):
        self.runs.append((run_name, tags))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id="run-1"))

    def log_params(self, params):
        self.params.update(params)

    def log_metrics(self, values, step, run_id):
        assert run_id == "run-1"
        for name, value in values.items():
            self.metrics.setdefault(name, {})[step] = value

    def end_run(self):
        self.ended += 1


def test_mlflow_gets_the_same_rows_and_the_config(tmp_path, monkeypatch):
    mlflow = FakeMlflow()
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    result = train(config(tmp_path, log_to=["mlflow"]), log=lambda _: None)
    assert mlflow.experiment == "raysb" and mlflow.runs[0][0] == "run" and mlflow.ended == 1
    assert mlflow.params["strategy"] == "sb" and mlflow.params["log_to"] == "['mlflow']"
    assert set(mlflow.metrics) == set(numeric_columns(result.metrics[0]))
    assert mlflow.metrics["test_error"] == {row["epoch"]: pytest.approx(row["test_error"]) for row in result.metrics}


def test_an_unknown_or_missing_sink_is_a_clear_error(monkeypatch):
    with pytest.raises(ConfigError, match="log_to"):
        TrainConfig(log_to=["neptune"])
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="log_to mlflow needs the mlflow package: pip install mlflow-skinny"):
        check_sinks_installed(["mlflow"])


def test_overwrite_replaces_the_tensorboard_events_too(tmp_path):
    first = train(config(tmp_path, log_to=["tensorboard"], epochs=1), log=lambda _: None)
    again = train(config(tmp_path, log_to=["tensorboard"], epochs=2, overwrite=True), log=lambda _: None)
    # One event file, of the second run only: a dashboard must not show the replaced run beside it.
    assert len(list((again.out_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert set(tensorboard_scalars(again.out_dir / "tensorboard")["test_error"]) == {1, 2}
    assert first.out_dir == again.out_dir


@pytest.mark.parametrize("sink, module, package", [("mlflow", "mlflow", "mlflow-skinny"),
                                                   ("tensorboard", "tensorboardX", "tensorboardX")])
@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["process", "workers"])
def test_a_missing_sink_package_fails_before_any_data_loads(tmp_path, monkeypatch, capsys, sink, module, package,
                                                           workers):
    """`--log-to mlflow` without mlflow once failed only after the data had loaded."""
    monkeypatch.setitem(sys.modules, module, None)  # not installed, as find_spec sees it
    monkeypatch.setattr("raysb.api.prepare_data", lambda config: pytest.fail("the data was loaded"))
    out = tmp_path / "run"
    assert main(["train", "--log-to", sink, "--out", str(out), *workers]) == 2
    assert capsys.readouterr().err == f"raysb: error: log_to {sink} needs the {module} package: pip install {package}\n"
    assert not out.exists()
