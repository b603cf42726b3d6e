"""Settings -> the parts of a run: device, model, optimizer, strategy, pipeline, and the Engine that holds them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from raysb.core.errors import ConfigError
from raysb.core.settings import ModelSettings, OptimizationSettings, ScoringSettings, Settings
from raysb.data import BatchTransform, ImageDataset
from raysb.data.shards import MemoryShard, StreamShard
from raysb.models import MODEL_NAMES, build_model, check_outputs, user_factory
from raysb.training.collective import Collective
from raysb.training.chunk_feed import ChunkFeed
from raysb.training.engine import GPU_LOSS_READ_EVERY, Engine
from raysb.training.evaluation import Evaluation
from raysb.training.held_out import HeldOutSplit
from raysb.training.run_schedule import RunSchedule, Schedule, SelectionSchedules
from raysb.training.cuda_graphs import replay_mode
from raysb.training.selection.keep_rule_graph import capture_keep_rule
from raysb.training.selection.round_graph import capture_rounds
from raysb.training.selection.rounds import SelectionRounds
from raysb.training.timing import PhaseTimer
from raysb.training.train_step import TrainingStep, image_loss
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
    settings: Settings,
    shard: MemoryShard | StreamShard,
    device: torch.device,
    wrap_model: Callable[[torch.nn.Module], torch.nn.Module] = lambda model: model,
    history=None,
    collective: Collective | None = None,
    held_out: ImageDataset | None = None,
) -> Engine:
    """The engine a run's `settings` describe on `device`. `wrap_model` (e.g. DDP), `history` (a
    shared CDF_R) and `collective` are the distributed hooks: with a collective, the ranks form
    batches in lockstep over it. `held_out`: the training data's held-out split, where the
    strategy's card asks for one (raysb.data.prepare.split_holdout)."""
    on_device = device_settings(settings.model, settings.scoring, device)
    model_settings, selection, optimization = settings.model, settings.selection, settings.optimization
    model = build_network(model_settings.name, model_settings.options, shard.num_classes, shard.image_shape)
    model = model.to(device)
    if on_device.channels_last:
        model = model.to(memory_format=torch.channels_last)
    uncompiled = wrap_model(model)
    spec = selection.spec
    not_captured = uncapturable_training(on_device, spec, collective)
    captured = on_device.capture_training and not not_captured
    compiled = compiles_training(model_settings, captured, device)
    # Training batches always hold exactly b examples: one graph, compiled once.
    trained = torch.compile(uncompiled, dynamic=False) if compiled else uncompiled
    options = scorer_options(settings.scoring, on_device, warmup_steps(optimization, shard.num_examples))
    try:
        scorer = SelectionScorer(model, device, **options)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    data = settings.data
    transform = BatchTransform(
        shard.mean,
        shard.std,
        crop_padding=data.crop_padding,
        horizontal_flip=data.horizontal_flip,
        cutout_length=data.cutout,
    )
    schedule = Schedule(
        optimization.lr_schedule,
        optimization.lr,
        optimization.schedule_epochs,
        list(optimization.lr_milestones),
        optimization.lr_factor,
        optimization.lr_schedule_key,
        optimization.lr_warmup_epochs,
        optimization.time_budget,
        optimization.work_budget,
        optimization.epochs,
    )
    if (collective is not None) != spec.lockstep:
        raise ValueError(
            f"the selection spec says lockstep={spec.lockstep} but a collective was "
            f"{'given' if collective is not None else 'not given'}: ranks in lockstep need one, one process none"
        )
    strategy = build_strategy(spec, history=history, sample_ids=shard.all_sample_ids, device=device)
    if on_device.capture_selection:
        capture_keep_rule(strategy, spec.chunk_size, device, replay_mode(device))
    if selection.loss_table == "sharded":
        # Checked by the config: a lockstep run of a strategy that decides every epoch from its table.
        strategy.loss_table().shard(collective.rank, collective.world_size)
    timer = PhaseTimer(device)
    rounds = SelectionRounds(spec, strategy, image_loss(_keeps_margins(strategy)), collective or Collective(), timer,
                             loss_read_every=GPU_LOSS_READ_EVERY if device.type == "cuda" else 1)
    feed = ChunkFeed(shard, transform, settings.run.seed, device, scorer, model, timer, rounds.counters,
                     build_pipeline(settings.scoring, model, device, options))
    if on_device.capture_selection:
        rounds.round_graph = capture_rounds(strategy, shard, transform, scorer, feed.augment_generator,
                                            spec.chunk_size, spec.batch_size, rounds.staleness_selector is not None,
                                            device, replay_mode(device), feed.pipeline is not None, spec.lockstep)
    if spec.lockstep:
        rounds.use_lockstep(feed.load_ids, feed.carried())
    step = TrainingStep(
        trained, build_optimizer(optimization, trained, fused=captured), on_device.precision, device,
        optimization.grad_clip_norm, capture=captured,
        # Compiled only because it is captured: where capture refuses the compiled module, the plain one is tried.
        uncompiled_model=uncompiled if compiled and model_settings.compile is None else None,
        capture_refused=not_captured if on_device.capture_training else None,
    )
    # Selection and evaluation run on the bare module: no DDP hooks, no collectives.
    evaluation = Evaluation(model, transform, on_device.precision, device, timer)
    schedules = SelectionSchedules(selection.anneal_epochs, selection.anneal_share, selection.kept_fraction_schedule,
                                   selection.selection_strength_schedule)
    trace = None
    if settings.run.record_analysis:
        trace = SelectionTrace(shard.all_sample_ids, device, settings.run.seed, collective or Collective())
    return Engine(rounds, feed, step, RunSchedule(schedule, schedules, rounds, shard.num_examples), evaluation,
                  trace=trace, held_out=None if held_out is None else HeldOutSplit(held_out, rounds, evaluation),
                  plan_epochs=selection.plan_epochs)


def _keeps_margins(strategy) -> bool:
    table = strategy.loss_table()
    return table is not None and table.tracks_margins

def build_network(name: str, options: dict, num_classes: int, image_shape: tuple[int, int, int]) -> torch.nn.Module:
    """The network `name` (raysb's, or a user's package.module:factory) for images of `image_shape` (C, H, W)
    in `num_classes` classes. What raysb.models refuses (a name, an option, a factory or its outputs) is a
    ConfigError: refused before training, as the config's own refusals are."""
    channels, height, _ = image_shape
    try:
        network = build_model(name, num_classes, channels, height, **options)
        if name not in MODEL_NAMES:  # a user's own network: raysb's own give one logit per class
            check_outputs(name, network, num_classes, image_shape)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    except TypeError as error:  # an option of the wrong kind, met by the model's own code
        raise ConfigError(f"model {name!r} with model_options {dict(options)}: {error}") from None
    return network


def check_own_model(name: str) -> None:
    """Refuse a user's package.module:factory that does not import or is no callable, before any data
    loads (and before a Ray Train run starts its workers)."""
    if ":" not in name:
        return
    try:
        user_factory(name)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def compiles_training(model: ModelSettings, captured: bool, device: torch.device) -> bool:
    """Whether the training forward and backward are compiled: as told, else where the step is captured
    as a CUDA graph (inductor's kernels inside it; a CPU replays no graph, and would only wait for the compile)."""
    return captured and device.type == "cuda" if model.compile is None else model.compile


def uncapturable_training(on_device: DeviceSettings, spec, collective: Collective | None) -> str | None:
    """Why a run's training step cannot be one CUDA graph, or None. A captured step replays the same
    kernels every time, so nothing in it may wait on the host's word."""
    if collective is not None:
        return "DDP's gradient all-reduce across ranks runs outside the graph"
    if on_device.precision == "fp16":
        return "fp16's gradient scaler decides on the host whether each step is applied"
    if spec.correct_staleness:
        return "staleness_correction weighs each batch by CDF_R at its training forward, on the host's history"
    return None


@dataclass(frozen=True)
class DeviceSettings:
    """What the per-device settings (`auto`, None) mean on the run's device, resolved once."""

    precision: str
    selection_precision: str
    channels_last: bool
    capture_training: bool
    capture_selection: bool
    compile_selection: bool


def device_settings(model: ModelSettings, scoring: ScoringSettings, device: torch.device) -> DeviceSettings:
    precision = resolve_precision(model.precision, device)
    # Selection scores in the training precision unless told otherwise.
    selection_precision = precision if scoring.precision == "auto" else scoring.precision
    on_cuda = device.type == "cuda"
    # Not where the selection forward already replays torch.compile's own CUDA graphs.
    capture_selection = ((on_cuda and not (scoring.compile and scoring.compile_mode == "reduce-overhead"))
                         if scoring.capture is None else scoring.capture)
    return DeviceSettings(
        precision=precision,
        selection_precision=selection_precision,
        capture_training=on_cuda if model.capture is None else model.capture,
        capture_selection=capture_selection,
        # Compiled where captured on a GPU, as the training step is: inductor's kernels inside the graph.
        compile_selection=(capture_selection and on_cuda and selection_precision != "int8")
        if scoring.compile is None else scoring.compile,
        # NHWC convolutions are faster on GPUs (ResNet18 at b128 on an H100: 4.1-5.0 s an epoch, 6.5-7.0
        # without); on CPUs it depends on the model (small-cnn sets it for itself).
        channels_last=device.type == "cuda" if model.channels_last is None else model.channels_last,
    )


def device_resolved_keys(settings: Settings, device: torch.device) -> dict:
    """The config keys whose value (None, auto) leaves the choice to the device, as `device` resolves them:
    two records equal in these and in every other key train alike there, whatever their raw values."""
    on_device = device_settings(settings.model, settings.scoring, device)
    return {
        "precision": on_device.precision,
        "selection_precision": on_device.selection_precision,
        "channels_last": on_device.channels_last,
        "capture_training": on_device.capture_training,
        "capture_selection": on_device.capture_selection,
        "compile_selection": on_device.compile_selection,
        "compile_training": compiles_training(settings.model, on_device.capture_training, device),
    }


def warmup_steps(optimization: OptimizationSettings, train_size: int) -> int:
    """The lr warmup's length in steps, for a rank that trains on `train_size` examples an epoch."""
    return math.ceil(optimization.lr_warmup_epochs * train_size / optimization.batch_size)


def scorer_options(scoring: ScoringSettings, on_device: DeviceSettings, warmup: int) -> dict:
    """The SelectionScorer keyword arguments `scoring` asks for on its device, `warmup` the lr
    warmup's steps (raysb.training.selection.scoring: BatchNorm may change after it)."""
    return dict(
        precision=on_device.selection_precision,
        channels_last=on_device.channels_last,
        compile=on_device.compile_selection,
        compile_mode=scoring.compile_mode,
        refresh_steps=scoring.refresh_steps,
        batchnorm=_selection_batchnorm(scoring.batchnorm, on_device.selection_precision),
        warmup_steps=warmup,
        scale=scoring.scale,
        capture=on_device.capture_selection,
    )


def _selection_batchnorm(setting: str, selection_precision: str) -> str:
    if setting != "auto":
        return setting
    # An int8 copy has BatchNorm folded into its convolutions: it can only score with running statistics.
    return "running" if selection_precision == "int8" else "batch"


def build_pipeline(
    scoring: ScoringSettings, model: torch.nn.Module, device: torch.device, options: dict
) -> PipelinedSelection | None:
    """Selection scored ahead of training where `scoring` asks for it; `options` are the scorer's."""
    if scoring.pipeline == "inline":
        return None
    # Pipelined scorers score on their own copies and threads, where capturing a graph would race the trainer's.
    options = {**options, "capture": False}
    if scoring.pipeline == "thread":
        backend = ThreadBackend(model, device, lambda copy: SelectionScorer(copy, device, **options))
    else:
        backend = ActorBackend(model, device, options, scoring.pipeline_cpus, scoring.pipeline_gpus)
    return PipelinedSelection(backend, scoring.pipeline_depth, scoring.pipeline_sync_every)


def build_optimizer(optimization: OptimizationSettings, model: torch.nn.Module,
                    fused: bool = False) -> torch.optim.Optimizer:
    """`fused`: one kernel an update that reads its lr from a device tensor, as a captured step's must
    (raysb.training.cuda_graphs); the default, foreach, reads a float on the host."""
    if optimization.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=optimization.lr, weight_decay=optimization.weight_decay,
                                fused=fused or None)
    return torch.optim.SGD(
        model.parameters(),
        lr=optimization.lr,
        momentum=optimization.momentum,
        nesterov=optimization.nesterov and optimization.momentum > 0,
        weight_decay=optimization.weight_decay,
        fused=fused or None,
    )
