"""`train(config)`: one single-process run from config to output files."""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from raysb.config import ConfigError, TrainConfig
from raysb.data import BatchTransform, ImageDataset, flip_labels, load_dataset, stratified_subset
from raysb.engine import Engine, Schedule
from raysb.malloc_tuning import keep_freed_memory_for_reuse
from raysb.models import build_model
from raysb.outputs import MetricsWriter, versions, write_json
from raysb.selection import NonFiniteLossError, Selector
from raysb.strategies import Kath18, LossTable, SelectiveBackprop, StaleSelectiveBackprop, Strategy


@dataclass
class RunResult:
    out_dir: Path
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def final_test_error(self) -> float:
        return self.summary["final_test_error"]


def train(config: TrainConfig, log: Callable[[str], None] | None = None) -> RunResult:
    """Train one model as `config` says, writing metrics.parquet, summary.json and config.yaml."""
    log = log or _print
    keep_freed_memory_for_reuse()
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    train_data, test_data, flipped_ids = prepare_data(config)
    train_data = to_device(train_data, device)

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    config.save(out / "config.yaml")

    engine = build_engine(config, train_data, device)
    metrics = MetricsWriter(out / "metrics.parquet")
    log(
        f"raysb: {config.strategy} on {config.dataset} ({len(train_data)} train / {len(test_data)} test), "
        f"model {config.model}, selectivity {config.selectivity:.3f}, device {device}, out {out}"
    )

    summary: dict[str, Any] = {
        "status": "running",
        "config": config.to_dict(),
        "versions": versions(),
        "device": str(device),
        "train_examples": len(train_data),
        "test_examples": len(test_data),
        "label_noise_flipped_ids": flipped_ids.tolist(),
    }
    budget_hit = False
    try:
        for epoch in range(config.epochs):
            budget_hit = engine.train_epoch(epoch, should_stop=_budget_check(engine, config.time_budget))
            last = budget_hit or epoch == config.epochs - 1
            if (epoch + 1) % config.eval_every == 0 or last:
                row = epoch_row(engine, epoch, test_data, config.eval_batch_size)
                metrics.append(row)
                log(progress_line(row, config.epochs))
            if budget_hit:
                log(f"time budget of {config.time_budget:g}s reached in epoch {epoch + 1}; stopping")
                break
    except NonFiniteLossError as error:
        summary.update(status="failed", error=str(error))
        _finish_summary(summary, engine, metrics)
        write_json(out / "summary.json", summary)
        raise
    summary["status"] = "budget_reached" if budget_hit else "completed"
    _finish_summary(summary, engine, metrics)
    write_json(out / "summary.json", summary)
    return RunResult(out, metrics.rows, summary)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name} requested but no CUDA device is available")
    return device


def prepare_data(config: TrainConfig) -> tuple[ImageDataset, ImageDataset, torch.Tensor]:
    train_data = load_dataset(config.dataset, "train", config.data_dir, config.download)
    test_data = load_dataset(config.dataset, "test", config.data_dir, config.download)
    if config.subset is not None:
        train_data = stratified_subset(train_data, config.subset, config.seed)
    if config.test_subset is not None:
        test_data = stratified_subset(test_data, config.test_subset, config.seed)
    flipped = torch.empty(0, dtype=torch.int64)
    if config.label_noise > 0:
        train_data, flipped = flip_labels(train_data, config.label_noise, config.seed)
    if config.batch_size > len(train_data):
        raise ConfigError(
            f"batch_size {config.batch_size} is larger than the {len(train_data)} training examples"
        )
    return train_data, test_data, flipped


def to_device(data: ImageDataset, device: torch.device) -> ImageDataset:
    """Small-image datasets live on the device, so a batch is an index, not a copy over PCIe."""
    return dataclasses.replace(
        data,
        images=data.images.to(device),
        labels=data.labels.to(device),
        sample_ids=data.sample_ids.to(device),
    )


def build_engine(config: TrainConfig, train_data: ImageDataset, device: torch.device) -> Engine:
    channels, height, _ = train_data.images.shape[1:]
    model = build_model(
        config.model, train_data.num_classes, channels, height, **config.model_options
    ).to(device)
    transform = BatchTransform(
        train_data.mean,
        train_data.std,
        crop_padding=config.crop_padding,
        horizontal_flip=config.horizontal_flip,
        cutout_length=config.cutout,
    )
    schedule = Schedule(
        config.lr_schedule,
        config.lr,
        config.epochs,
        list(config.lr_milestones),
        config.lr_factor,
        config.lr_schedule_key,
    )
    return Engine(
        model=model,
        optimizer=build_optimizer(config, model),
        strategy=build_strategy(config, train_data, device),
        train_data=train_data,
        transform=transform,
        schedule=schedule,
        batch_size=config.batch_size,
        selection_batch_size=config.resolved_selection_batch_size,
        prime_epochs=config.prime_epochs,
        seed=config.seed,
        device=device,
    )


def build_optimizer(config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if config.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(
        model.parameters(),
        lr=config.lr,
        momentum=config.momentum,
        nesterov=config.nesterov and config.momentum > 0,
        weight_decay=config.weight_decay,
    )


def build_strategy(config: TrainConfig, train_data: ImageDataset, device: torch.device) -> Strategy:
    if config.strategy == "traditional":
        return Strategy()
    if config.strategy == "kath18":
        return Kath18(
            config.batch_size,
            config.selectivity,
            seed=config.seed + 2,
            tau_threshold=config.kath18_tau_threshold,
            reweight=config.kath18_reweight,
            device=device,
        )
    selector = Selector(
        selectivity=config.selectivity,
        history_size=config.history_size,
        seed=config.seed + 2,
        device=device,
    )
    if config.strategy == "stale-sb":
        table = LossTable(train_data.sample_ids, device)
        return StaleSelectiveBackprop(selector, config.staleness, table, first_epoch=config.prime_epochs)
    return SelectiveBackprop(selector)


def epoch_row(engine: Engine, epoch: int, test_data: ImageDataset, eval_batch_size: int) -> dict:
    wall = engine.timer.training_seconds()
    split = engine.timer.breakdown()
    test_error, test_loss = engine.evaluate(test_data, eval_batch_size)
    stats = engine.epoch_stats()
    return {
        "epoch": epoch + 1,
        "wall_s": wall,
        "test_error": test_error,
        "test_loss": test_loss,
        "train_loss": stats["train_loss"],
        **engine.counters_dict(),
        "kept_fraction": stats["kept_fraction"],
        "epoch_steps": stats["epoch_steps"],
        "lr": engine.current_lr(),
        "time_selection_s": split["selection"],
        "time_train_forward_s": split["train_forward"],
        "time_backward_s": split["backward"],
        "time_data_s": split["data"],
        "time_other_s": split["other"],
    }


def progress_line(row: dict, epochs: int) -> str:
    return (
        f"epoch {row['epoch']:>3}/{epochs}  test_err {row['test_error']:.2%}  "
        f"train_loss {row['train_loss']:.3f}  kept {row['kept_fraction']:.1%}  "
        f"steps {row['optimizer_steps']}  lr {row['lr']:.4g}  wall {row['wall_s']:.1f}s "
        f"(sel {row['time_selection_s']:.1f} fwd {row['time_train_forward_s']:.1f} "
        f"bwd {row['time_backward_s']:.1f} data {row['time_data_s']:.1f} "
        f"other {row['time_other_s']:.1f})"
    )


def _budget_check(engine: Engine, budget: float | None):
    if budget is None:
        return lambda: False
    return lambda: engine.timer.training_seconds() >= budget


def _finish_summary(summary: dict, engine: Engine, metrics: MetricsWriter) -> None:
    rows = metrics.rows
    counters = engine.counters_dict()
    summary.update(
        final_test_error=rows[-1]["test_error"] if rows else None,
        best_test_error=min(r["test_error"] for r in rows) if rows else None,
        epochs_completed=rows[-1]["epoch"] if rows else 0,
        training_wall_s=engine.timer.training_seconds(),
        evaluation_s=engine.timer.seconds["evaluation"],
        time_breakdown_s=engine.timer.breakdown(),
        kept_fraction=counters["examples_kept"] / counters["examples_considered"]
        if counters["examples_considered"]
        else 0.0,
        unused_kept_examples=len(engine.former),
        finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **counters,
    )


def _print(line: str) -> None:
    print(line, file=sys.stdout, flush=True)
