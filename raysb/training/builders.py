"""Config -> the parts of a run: device, model, optimizer, strategy, pipeline, and the Engine that holds them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from raysb.config import ConfigError, TrainConfig
from raysb.data import BatchTransform
from raysb.data.shards import MemoryShard, StreamShard
from raysb.models import MODEL_NAMES, build_model, check_outputs
from raysb.training.collective import Collective
from raysb.training.engine import Engine, Schedule
from raysb.training.selection.pipeline import ActorBackend, PipelinedSelection, ThreadBackend
from raysb.training.precision import resolve_precision
from raysb.training.selection.scoring import SelectionScorer
from raysb.training.selection.strategies import build_strategy
from raysb.training.trace import SelectionTrace


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name} requested but no CUDA device is available")
    return device


def build_engine(
    config: TrainConfig,
    shard: MemoryShard | StreamShard,
    device: torch.device,
    wrap_model: Callable[[torch.nn.Module], torch.nn.Module] = lambda model: model,
    history=None,
    collective: Collective | None = None,
) -> Engine:
    """`wrap_model` (e.g. DDP), `history` (a shared CDF_R) and `collective` are the distributed hooks:
    with a collective, the ranks form batches in lockstep over it."""
    settings = device_settings(config, device)
    channels, height, _ = shard.image_shape
    model = build_model(config.model, shard.num_classes, channels, height, **config.model_options)
    if config.model not in MODEL_NAMES:  # a user's own network: raysb's own give one logit per class
        check_outputs(config.model, model, shard.num_classes, shard.image_shape)
    model = model.to(device)
    if settings.channels_last:
        model = model.to(memory_format=torch.channels_last)
    trained = wrap_model(model)
    if config.compile_training:
        # Training batches always hold exactly b examples: one graph, compiled once.
        trained = torch.compile(trained, dynamic=False)
    try:
        scorer = SelectionScorer(model, device, **scorer_options(config, settings, shard.num_examples))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    transform = BatchTransform(
        shard.mean,
        shard.std,
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
        config.lr_warmup_epochs,
        config.time_budget,
        config.work_budget,
    )
    spec = config.selection_spec()
    strategy = build_strategy(spec, history=history, sample_ids=shard.all_sample_ids, device=device)
    if config.loss_table == "sharded":
        # Checked by the config: a lockstep run of a strategy that decides every epoch from its table.
        strategy.loss_table().shard(collective.rank, collective.world_size)
    return Engine(
        model=trained,
        optimizer=build_optimizer(config, trained),
        spec=spec,
        strategy=strategy,
        shard=shard,
        transform=transform,
        schedule=schedule,
        anneal_epochs=config.anneal_epochs,
        anneal_share=config.anneal_share,
        kept_fraction_schedule=config.kept_fraction_schedule,
        selection_strength_schedule=config.selection_strength_schedule,
        seed=config.seed,
        device=device,
        collective=collective,
        scoring_model=model,
        scorer=scorer,
        trace=SelectionTrace(shard.all_sample_ids, device, config.seed, collective or Collective())
        if config.record_analysis
        else None,
        pipeline=build_pipeline(config, model, device, settings, shard.num_examples),
        precision=settings.precision,
        grad_clip_norm=config.grad_clip_norm,
        plan_epochs=config.plan_epochs,
    )


@dataclass(frozen=True)
class DeviceSettings:
    """What a config's per-device settings (`auto`, None) mean on the run's device, resolved once."""

    precision: str
    selection_precision: str
    channels_last: bool


def device_settings(config: TrainConfig, device: torch.device) -> DeviceSettings:
    precision = resolve_precision(config.precision, device)
    return DeviceSettings(
        precision=precision,
        # Selection scores in the training precision unless told otherwise.
        selection_precision=precision if config.selection_precision == "auto" else config.selection_precision,
        # NHWC convolutions are faster on GPUs (ResNet18 at b128 on an H100: 4.1-5.0 s an epoch, 6.5-7.0
        # without); on CPUs it depends on the model (small-cnn sets it for itself).
        channels_last=device.type == "cuda" if config.channels_last is None else config.channels_last,
    )


def scorer_options(config: TrainConfig, settings: DeviceSettings, train_size: int) -> dict:
    """The SelectionScorer keyword arguments a config asks for on its device, for a rank that
    trains on `train_size` examples an epoch (the lr warmup's length in steps)."""
    return dict(
        precision=settings.selection_precision,
        channels_last=settings.channels_last,
        compile=config.compile_selection,
        compile_mode=config.selection_compile_mode,
        refresh_steps=config.selection_refresh_steps,
        batchnorm=_selection_batchnorm(config.selection_batchnorm, settings.selection_precision),
        warmup_steps=math.ceil(config.lr_warmup_epochs * train_size / config.batch_size),
        scale=config.selection_scale,
    )


def _selection_batchnorm(setting: str, selection_precision: str) -> str:
    if setting != "auto":
        return setting
    # An int8 copy has BatchNorm folded into its convolutions: it can only score with running statistics.
    return "running" if selection_precision == "int8" else "batch"


def build_pipeline(
    config: TrainConfig, model: torch.nn.Module, device: torch.device, settings: DeviceSettings, train_size: int
) -> PipelinedSelection | None:
    if config.pipeline_selection == "inline":
        return None
    options = scorer_options(config, settings, train_size)
    if config.pipeline_selection == "thread":
        backend = ThreadBackend(model, device, lambda copy: SelectionScorer(copy, device, **options))
    else:
        backend = ActorBackend(model, device, options, config.pipeline_cpus, config.pipeline_gpus)
    return PipelinedSelection(backend, config.pipeline_depth, config.pipeline_sync_every)


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
