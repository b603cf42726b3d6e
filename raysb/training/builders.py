"""Config -> the parts of a run: device, model, optimizer, strategy, pipeline, and the Engine that holds them."""

from __future__ import annotations

from typing import Callable

import torch

from raysb.config import ConfigError, TrainConfig
from raysb.core.selectivity import resolve_beta
from raysb.data import BatchTransform
from raysb.data.shards import MemoryShard, StreamShard
from raysb.models import build_model
from raysb.training.collective import Collective
from raysb.training.engine import Engine, Schedule
from raysb.training.pipeline import ActorBackend, PipelinedSelection, ThreadBackend
from raysb.training.scoring import SelectionScorer
from raysb.training import strategies
from raysb.training.strategies import Strategy
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
    channels, height, _ = shard.image_shape
    model = build_model(config.model, shard.num_classes, channels, height, **config.model_options).to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    trained = wrap_model(model)
    options = scorer_options(config)
    try:
        scorer = SelectionScorer(model, device, **options)
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
    )
    return Engine(
        model=trained,
        optimizer=build_optimizer(config, trained),
        strategy=build_strategy(config, shard.all_sample_ids, device, history),
        shard=shard,
        transform=transform,
        schedule=schedule,
        batch_size=config.batch_size,
        selection_batch_size=config.resolved_selection_batch_size,
        prime_epochs=config.prime_epochs,
        anneal_epochs=config.anneal_epochs,
        staleness_correction=config.corrects_stale_scores,
        seed=config.seed,
        device=device,
        lockstep=collective,
        scoring_model=model,
        scorer=scorer,
        trace=SelectionTrace(shard.all_sample_ids, device, config.seed, collective or Collective())
        if config.record_analysis
        else None,
        pipeline=build_pipeline(config, model, device),
    )


def scorer_options(config: TrainConfig) -> dict:
    """The SelectionScorer keyword arguments a config asks for."""
    return dict(
        precision=config.selection_precision,
        channels_last=config.channels_last,
        compile=config.compile_selection,
        refresh_steps=config.selection_refresh_steps,
    )


def build_pipeline(
    config: TrainConfig, model: torch.nn.Module, device: torch.device
) -> PipelinedSelection | None:
    if config.pipeline_selection == "inline":
        return None
    if config.pipeline_selection == "thread":
        backend = ThreadBackend(model, device, lambda copy: SelectionScorer(copy, device, **scorer_options(config)))
    else:
        backend = ActorBackend(model, device, scorer_options(config), config.pipeline_cpus, config.pipeline_gpus)
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


def build_strategy(
    config: TrainConfig, sample_ids: torch.Tensor, device: torch.device, history=None
) -> Strategy:
    """The strategy `config.strategy` names (raysb.config.STRATEGIES); `history` is a shared CDF_R."""
    return strategies.build_strategy(
        config.strategy,
        config.batch_size,
        beta=resolve_beta(None, config.selectivity),
        seed=config.seed + 2,
        device=device,
        history=history,
        history_size=config.history_size,
        keep_floor=config.keep_floor,
        staleness=config.staleness,
        sample_ids=sample_ids,
        first_epoch=config.prime_epochs,
        kath18_tau_threshold=config.kath18_tau_threshold,
        kath18_reweight=config.kath18_reweight,
    )
