"""Each evaluated epoch's metrics row, also sent where users look: TensorBoard, MLflow
(the names in raysb.core.settings.METRIC_SINKS).

Written only by the rank that writes metrics.parquet, under the same column names,
at step = epoch, so a dashboard and `metrics.parquet` never disagree.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from raysb.config import ConfigError
from raysb.training.outputs import TENSORBOARD_FOLDER

# Where each sink writes: TensorBoard event files in OUT/tensorboard (TENSORBOARD_FOLDER);
# MLflow wherever MLFLOW_TRACKING_URI points, in experiment "raysb".
MLFLOW_EXPERIMENT = "raysb"
# The Python package each sink needs: tensorboardX comes with ray[tune].
SINK_PACKAGES = {"tensorboard": ("tensorboardX", "tensorboardX"), "mlflow": ("mlflow", "mlflow-skinny")}


def numeric_columns(row: dict) -> dict[str, float]:
    """The row's values a dashboard can plot, under metrics.parquet's names."""
    return {
        name: float(value)
        for name, value in row.items()
        if name != "epoch" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class TensorBoardSink:
    def __init__(self, out: Path, first_epoch: int):
        from tensorboardX import SummaryWriter

        # A resumed run drops what a killed run had logged after its checkpoint.
        self.writer = SummaryWriter(str(out / TENSORBOARD_FOLDER), purge_step=first_epoch + 1 if first_epoch else None)

    def write(self, epoch: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=epoch)
        self.writer.flush()  # an epoch is minutes apart: a dashboard should not wait for the buffer

    def close(self) -> None:
        self.writer.close()


class MLflowSink:
    def __init__(self, out: Path, record: dict):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(MLFLOW_EXPERIMENT)
        self.run = mlflow.start_run(run_name=out.name, tags={"raysb.out": str(out.resolve())})
        mlflow.log_params({key: str(value) for key, value in record.items()})

    def write(self, epoch: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=epoch, run_id=self.run.info.run_id)

    def close(self) -> None:
        self.mlflow.end_run()


def check_sinks_installed(names: list[str]) -> None:
    """Before training starts: a missing package is a clear error, not a crash after epoch 1."""
    for name in names:
        module, package = SINK_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"log_to {name} needs the {module} package: pip install {package}")


class MetricSinks:
    """The sinks `names` (a run's `log_to`, on the rank that writes outputs; none elsewhere);
    `record`: the run's resolved config (MLflow logs it as the run's parameters)."""

    def __init__(self, names: list[str], record: dict, out: Path, first_epoch: int):
        check_sinks_installed(names)
        builders = {"tensorboard": lambda: TensorBoardSink(out, first_epoch), "mlflow": lambda: MLflowSink(out, record)}
        self.sinks = [builders[name]() for name in names]

    def write(self, row: dict) -> None:
        values = numeric_columns(row)
        for sink in self.sinks:
            sink.write(row["epoch"], values)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
