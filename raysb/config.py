"""The run configuration: one flat, validated record shared by the CLI, YAML files and Tune."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raysb.chaos_spec import ChaosSpecError, parse_chaos
from raysb.core.schedules import SCHEDULE_KEYS, SCHEDULE_NAMES
from raysb.core.selectivity import (
    KEPT_FRACTION_SCHEDULES,
    SELECTION_STRENGTH_SCHEDULES,
    resolve_beta,
    selectivity_from_beta,
)
from raysb.core.errors import ConfigError, check_choice
from raysb.core.settings import (
    ClusterSettings,
    DataSettings,
    ModelSettings,
    OptimizationSettings,
    RunSettings,
    ScoringSettings,
    SelectionSettings,
    Settings,
)
from raysb.core.spec import SelectionSpec
from raysb.core.strategy_table import STRATEGIES, resolved_options, resolved_own_settings, strategy_card


# The other names a config accepts; the modules that implement them key their tables by these.
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
SELECTION_PRECISIONS = ("fp32", "bf16", "fp16", "int8")
SELECTION_BATCHNORMS = ("running", "batch", "running-after-warmup")
SELECTION_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
PIPELINE_MODES = ("inline", "thread", "actor")
STALE_SB_SCHEDULES = ("raysb", "authors")

OPTIMIZER_NAMES = ("sgd", "adam")
SHARD_MODES = ("shuffled", "contiguous")
DATA_MODES = ("memory", "stream")
LOSS_TABLES = ("replicated", "sharded")
# What raysb reads from a Parquet row (raysb.data.parquet.COLUMN_ROLES, which imports torch).
PARQUET_COLUMN_ROLES = ("image", "label", "sample_id")
# Where each epoch's metrics row can go besides metrics.parquet (raysb.training.metric_sinks).
METRIC_SINKS = ("tensorboard", "mlflow")
# Keys earlier versions took, with why they are gone (a run made with one cannot be resumed).
_MERGED_EVERY_ROUND = (
    "is gone: ranks now merge the shared CDF_R in every round's exchange (README, \"How it works\"); "
    "remove it (a distributed run made by an older raysb cannot be resumed)"
)
RETIRED_KEYS = {"cdf_sync_interval": _MERGED_EVERY_ROUND, "cdf_lag": _MERGED_EVERY_ROUND}


@dataclass
class TrainConfig:
    # data
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    download: bool = False
    subset: int | None = None
    test_subset: int | None = None
    label_noise: float = 0.0
    crop_padding: int = 0
    horizontal_flip: bool = False
    cutout: int = 0
    # memory: whole splits as tensors on every worker; stream: Parquet through Ray Data
    data_mode: str = "memory"
    # dataset parquet: the file's column for each of image, label, sample_id where it is not
    # named so, e.g. {image: pixels, label: target}
    parquet_columns: dict = field(default_factory=dict)
    stream_shuffle_buffer: int = 10_000
    # model
    model: str = "small-cnn"
    model_options: dict = field(default_factory=dict)
    # selection
    strategy: str = "sb"
    selectivity: float | None = None
    beta: float | None = None
    staleness: int | None = None
    history_size: int = 1024
    prime_epochs: int = 0
    # Safeguards (BENCHMARKS.md, "Stability"): plain SGD for the last k epochs, and a
    # least keep probability for every example.
    anneal_epochs: int = 0
    # The same for the last share of the run as its schedule measures it (epochs, or the time budget).
    anneal_share: float = 0.0
    keep_floor: float = 0.0
    # The kept fraction over the run: constant (the selectivity), or lr: rising from the selectivity
    # to 1 as the lr decays, set at each epoch's start (raysb.core.selectivity.scheduled_selectivity)
    kept_fraction_schedule: str = "constant"
    # How strongly SB's keep rule prefers high scores over the run: constant (its rule throughout),
    # or lr: fading to a uniform draw of the same kept fraction as the lr decays, set at each epoch's
    # start (raysb.core.selectivity.scheduled_strength).
    selection_strength_schedule: str = "constant"
    # Weight each kept example by (keep probability now) / (keep probability when
    # scored): selection on scores a step old otherwise collapses (BENCHMARKS.md).
    # auto: on where scores feed later steps (selection batch > b, pipelined, or N > 1 workers
    # scoring a few chunks between exchanges).
    staleness_correction: str = "auto"
    # How many of each selection chunk SB and Stale-SB keep: random (each example by its own draw,
    # the paper's rule: a GPU reads the count every round), fixed (exactly round(s n), inclusion
    # proportional to the keep probability: nothing to read), auto (fixed on a GPU, random elsewhere)
    kept_per_chunk: str = "auto"
    kath18_tau_threshold: float | None = None
    kath18_reweight: bool = False
    # free-sb: an example whose score (its last training loss) is older than this many epochs is
    # scored again by a selection forward (None: never)
    score_refresh_epochs: int | None = None
    # stale-sb: each trained example's training loss replaces its recorded score between
    # selection passes (BENCHMARKS.md, "Selection that pays")
    training_loss_refresh: bool = False
    # free-sb: none, or unbiased: each kept example's loss weighs mean(P) / P (at most 10), so a step's
    # gradient estimates the whole data's, as InfoBatch's rescaling does
    selection_weights: str = "none"
    # stale-sb: raysb (passes at epochs p, p + n, ... after p = prime_epochs unscored plain-SGD epochs)
    # or authors (angelajiang/SelectiveBackprop: a scored plain-SGD first epoch is the pass at epoch 0,
    # then passes at n, 2n, ..., each trained example's training loss replacing its recorded one)
    stale_sb_schedule: str = "raysb"
    # infobatch: the share of below-mean examples dropped each epoch, and the share of the run
    # (epochs, or the time budget) that prunes; the rest trains on everything (Qin et al.'s defaults)
    infobatch_prune_ratio: float = 0.5
    infobatch_delta: float = 0.875
    # A strategy's own options (its card's `options`: name -> default), the given ones over the
    # defaults; a name its card does not declare is refused.
    strategy_options: dict = field(default_factory=dict)
    # training precision (raysb.training.precision): fp32, bf16 or fp16 autocast (fp16 with a
    # gradient scaler); auto: bf16 on a GPU that has it, fp32 elsewhere
    precision: str = "auto"
    # selection passes (raysb.training.selection.scoring): auto (the training precision), fp32, bf16 or
    # fp16 autocast, or int8 (CPU: a quantized copy re-quantized every selection_refresh_steps steps)
    selection_precision: str = "auto"
    selection_refresh_steps: int = 1
    # BatchNorm in the selection forward: batch (the chunk's own statistics, as a training forward
    # normalizes; running ones untouched), running (eval-mode statistics, the authors'), or auto:
    # batch, except for int8 selection, which folds BatchNorm into its convolutions. Running
    # statistics lag the weights and come from hard-biased batches, which throws SB off at large b
    # (measured: BENCHMARKS.md, "SB at large b: BatchNorm in the selection forward")
    # running-after-warmup: batch until the lr warmup ends, running after it (eval-mode scoring once
    # the running statistics settle; BENCHMARKS.md, "Selection that pays")
    selection_batchnorm: str = "auto"
    # score inputs downsampled by this factor (bilinear; Composer's scale_factor): 0.5 costs about a
    # quarter of the forward on models that pool to a fixed size before their head
    selection_scale: float = 1.0
    # model and inputs in NHWC; None: on CUDA devices, where convolutions run faster so
    channels_last: bool | None = None
    # torch.compile with static shapes: the selection forward (an epoch's last chunk padded to
    # full size) and the training forward and backward (every step has exactly b examples)
    compile_selection: bool = False
    # torch.compile's mode for it: default, reduce-overhead (CUDA graphs at the fixed selection batch), max-autotune
    selection_compile_mode: str = "default"
    # None: on where the training step is captured (its compiled kernels inside the graph: ResNet-18 at
    # b512 on an H200, 6.46 ms a step against 8.69 captured uncompiled; BENCHMARKS.md, "Training at the
    # GPU's speed"); uncaptured, compiling made the step slower there
    compile_training: bool | None = None
    # The training step (forward, backward, update) and the selection forward replayed as CUDA graphs
    # at their fixed batches (raysb.training.cuda_graphs); None: on CUDA. A setting or model that cannot
    # be captured trains eagerly, saying why in one line. On a CPU, true runs the captured code path
    # without a graph (for checking it).
    capture_training: bool | None = None
    capture_selection: bool | None = None
    # decide an epoch whole as it starts where nothing needs a forward of its own (traditional, uniform,
    # free-sb, infobatch, stale-sb between passes, plain-SGD epochs) and the data is in memory, then train
    # it as a plain loop (raysb.training.selection.rounds); false: chunk by chunk, the same distribution
    plan_epochs: bool = True
    # pipelined selection (raysb.training.selection.pipeline): inline (off), thread or actor; chunks scored
    # ahead of training; optimizer steps between refreshes of the scorer's model copy
    pipeline_selection: str = "inline"
    pipeline_depth: int = 2
    pipeline_sync_every: int = 1
    pipeline_cpus: float = 1.0
    pipeline_gpus: float = 0.0
    # optimization
    epochs: int = 10
    batch_size: int = 128
    selection_batch_size: int | None = None
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    # Cosine by default: with a static lr, test error jumped about from one epoch to the next, so a
    # time to target landed on whichever epoch dipped (the figures: README, "Schedules").
    lr_schedule: str = "cosine"
    lr_milestones: list = field(default_factory=list)
    lr_factor: float = 0.2
    # auto: time (training seconds over time_budget) when a budget is given, else epoch
    lr_schedule_key: str = "auto"
    # Without warmup, lr 0.05 with momentum 0.9 threw the small CNN's first steps far
    # enough to kill its hidden units under label noise (BENCHMARKS.md, "Stability").
    lr_warmup_epochs: float = 1.0
    # clip each step's gradient to this norm (None: no clipping)
    grad_clip_norm: float | None = None
    # distributed (Ray Train); workers None = plain single process without Ray
    workers: int | None = None
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    address: str | None = None
    storage_path: str | None = None
    checkpoint_every: int = 1
    max_failures: int = 0
    # seconds a worker group may wait for its resources, at the start and after each restart
    # (long enough for an autoscaler to boot GPU nodes and pull their image); past it the run stops
    placement_timeout: float = 1800.0
    resume: bool = False
    # replace the run already in --out (its files only) instead of refusing to start
    overwrite: bool = False
    shard_mode: str = "shuffled"
    # lockstep ranks' loss table (free-sb, infobatch): replicated (every rank holds and updates every
    # example's score) or sharded (each rank the examples it owns, id mod ranks, and decides those)
    loss_table: str = "replicated"
    chaos: str | None = None
    # run
    time_budget: float | None = None
    # stop after this much work, in epochs of Traditional training: trained examples, plus scored
    # ones weighted by scoring_cost (raysb.core.work_units); the same seed and budget end the same under any load
    work_budget: float | None = None
    # a selection forward's cost per example relative to a training example's forward and backward;
    # None: measured at the run's start where the strategy scores (stored with the run), 0 where it does not
    scoring_cost: float | None = None
    eval_every: int = 1
    # a progress line inside an epoch every this many seconds (0: only the epoch lines)
    progress_seconds: float = 10.0
    # each epoch's metrics row also to: tensorboard (OUT/tensorboard), mlflow (MLFLOW_TRACKING_URI)
    log_to: list = field(default_factory=list)
    # show Ray's own console output (worker logs, per-report messages) besides raysb's lines
    verbose: bool = False
    # Evaluations in a row at chance that end a run as diverged (0: never).
    collapse_patience: int = 3
    eval_batch_size: int = 1024
    seed: int = 0
    device: str = "auto"
    out: str = "runs/latest"
    # Selection counts, CDF_R snapshots, tracked decisions, gradient probes and
    # the final model, for `raysb report` (raysb.training.trace).
    record_analysis: bool = True

    def __post_init__(self) -> None:
        self._resolve_and_validate()

    # -- derived values -------------------------------------------------------
    def selection_spec(self) -> SelectionSpec:
        """Every selection setting of this run, resolved (raysb.core.spec)."""
        return SelectionSpec(
            strategy=self.strategy,
            batch_size=self.batch_size,
            beta=self.beta,
            selection_batch_size=self.batch_size if self.selection_batch_size is None else self.selection_batch_size,
            staleness=self.staleness,
            history_size=self.history_size,
            keep_floor=self.keep_floor,
            staleness_correction=self.staleness_correction,
            pipelined=self.pipeline_selection != "inline",
            lockstep=(self.workers or 1) > 1,
            # Streams of a run: data order seed, augmentation seed + 1, selection seed + 2,
            # gradient probes seed + 3, tracked examples seed + 4.
            seed=self.seed + 2,
            # Stale-SB's first selection pass comes after the primed (plain-SGD) epochs.
            first_epoch=self.prime_epochs,
            kath18_tau_threshold=self.kath18_tau_threshold,
            kath18_reweight=self.kath18_reweight,
            score_refresh_epochs=self.score_refresh_epochs,
            training_loss_refresh=self.training_loss_refresh or self.stale_sb_schedule == "authors",
            scored_priming=self.stale_sb_schedule == "authors",
            selection_weights=self.selection_weights,
            infobatch_prune_ratio=self.infobatch_prune_ratio,
            infobatch_delta=self.infobatch_delta,
            kept_per_chunk=self.kept_per_chunk,
            options=dict(self.strategy_options),
        )

    def settings(self) -> Settings:
        """This run's settings in typed sections (raysb.core.settings), for the parts that run it."""
        reads_selectivity = "selectivity" in strategy_card(self.strategy).settings
        spec = self.selection_spec()
        return Settings(
            data=DataSettings(
                dataset=self.dataset, data_dir=self.data_dir, download=self.download, subset=self.subset,
                test_subset=self.test_subset, label_noise=self.label_noise, data_mode=self.data_mode,
                parquet_columns=dict(self.parquet_columns), stream_shuffle_buffer=self.stream_shuffle_buffer,
                shard_mode=self.shard_mode, crop_padding=self.crop_padding, horizontal_flip=self.horizontal_flip,
                cutout=self.cutout, seed=self.seed,
            ),
            model=ModelSettings(
                name=self.model, options=dict(self.model_options), precision=self.precision,
                channels_last=self.channels_last, compile=self.compile_training, capture=self.capture_training,
            ),
            scoring=ScoringSettings(
                precision=self.selection_precision, batchnorm=self.selection_batchnorm, scale=self.selection_scale,
                compile=self.compile_selection, compile_mode=self.selection_compile_mode, capture=self.capture_selection,
                refresh_steps=self.selection_refresh_steps, pipeline=self.pipeline_selection,
                pipeline_depth=self.pipeline_depth, pipeline_sync_every=self.pipeline_sync_every,
                pipeline_cpus=self.pipeline_cpus, pipeline_gpus=self.pipeline_gpus,
            ),
            optimization=OptimizationSettings(
                epochs=self.epochs, batch_size=self.batch_size, optimizer=self.optimizer, lr=self.lr,
                momentum=self.momentum, nesterov=self.nesterov, weight_decay=self.weight_decay,
                lr_schedule=self.lr_schedule, lr_milestones=tuple(self.lr_milestones), lr_factor=self.lr_factor,
                lr_schedule_key=self.lr_schedule_key, lr_warmup_epochs=self.lr_warmup_epochs,
                grad_clip_norm=self.grad_clip_norm, time_budget=self.time_budget, work_budget=self.work_budget,
            ),
            selection=SelectionSettings(
                spec=spec, anneal_epochs=self.anneal_epochs, anneal_share=self.anneal_share,
                kept_fraction_schedule=self.kept_fraction_schedule,
                selection_strength_schedule=self.selection_strength_schedule, plan_epochs=self.plan_epochs,
                loss_table=self.loss_table,
            ),
            run=RunSettings(
                out=self.out, epochs=self.epochs, eval_every=self.eval_every, eval_batch_size=self.eval_batch_size,
                checkpoint_every=self.checkpoint_every, progress_seconds=self.progress_seconds,
                log_to=tuple(self.log_to), collapse_patience=self.collapse_patience,
                record_analysis=self.record_analysis, time_budget=self.time_budget, work_budget=self.work_budget,
                scoring_cost=self.scoring_cost, runs_scoring_forwards=spec.runs_scoring_forwards,
                compiles=self.compile_selection or bool(self.compile_training), resume=self.resume, seed=self.seed,
                device=self.device, strategy=self.strategy, dataset=self.dataset, model=self.model,
                selectivity=self.selectivity if reads_selectivity else None, record=self.to_dict(),
                saved=self.saved_values(),
            ),
            cluster=ClusterSettings(
                workers=self.workers, cpus_per_worker=self.cpus_per_worker, gpus_per_worker=self.gpus_per_worker,
                address=self.address, storage_path=self.storage_path, max_failures=self.max_failures,
                placement_timeout=self.placement_timeout, chaos=self.chaos, verbose=self.verbose,
            ),
        )

    def _resolve_and_validate(self) -> None:
        card = strategy_card(self.strategy)
        check_choice("optimizer", self.optimizer, OPTIMIZER_NAMES)
        check_choice("lr_schedule", self.lr_schedule, SCHEDULE_NAMES)
        check_choice("lr_schedule_key", self.lr_schedule_key, ("auto", *SCHEDULE_KEYS))
        if self.lr_schedule_key == "auto":
            self.lr_schedule_key = ("work" if self.work_budget is not None
                                    else "time" if self.time_budget is not None else "epoch")
        if self.lr_schedule_key == "time" and self.time_budget is None:
            raise ConfigError("lr_schedule_key time keys the schedule to the time budget: give a time_budget")
        if self.lr_schedule_key == "work" and self.work_budget is None:
            raise ConfigError("lr_schedule_key work keys the schedule to the work budget: give a work_budget")
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("selection_batchnorm", self.selection_batchnorm, ("auto", *SELECTION_BATCHNORMS))
        check_choice("selection_precision", self.selection_precision, ("auto", *SELECTION_PRECISIONS))
        _require(0 < self.selection_scale <= 1, "selection_scale", self.selection_scale, "in (0, 1]")
        check_choice("selection_compile_mode", self.selection_compile_mode, SELECTION_COMPILE_MODES)
        _require(self.selection_refresh_steps >= 1, "selection_refresh_steps", self.selection_refresh_steps, ">= 1")
        if self.selection_refresh_steps != 1 and self.selection_precision != "int8":
            raise ConfigError(
                f"selection_refresh_steps={self.selection_refresh_steps} only applies to selection_precision int8, "
                f"not {self.selection_precision}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

        try:
            self.beta = resolve_beta(self.beta, self.selectivity)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if self.selectivity is None:
            self.selectivity = selectivity_from_beta(self.beta)

        for key, value in card.defaults.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        check_choice("stale_sb_schedule", self.stale_sb_schedule, STALE_SB_SCHEDULES)
        check_choice("selection_strength_schedule", self.selection_strength_schedule, SELECTION_STRENGTH_SCHEDULES)
        for key, value in resolved_own_settings(self.strategy, vars(self)).items():
            setattr(self, key, value)
        self.strategy_options = resolved_options(self.strategy, self.strategy_options)
        _require(self.prime_epochs >= 0, "prime_epochs", self.prime_epochs, ">= 0")
        _require(self.anneal_epochs >= 0, "anneal_epochs", self.anneal_epochs, ">= 0")
        _require(0 <= self.anneal_share < 1, "anneal_share", self.anneal_share, "in [0, 1)")
        check_choice("kept_fraction_schedule", self.kept_fraction_schedule, KEPT_FRACTION_SCHEDULES)
        if self.kept_fraction_schedule != "constant" and not card.keeps_fraction:
            keeping = [name for name, each in STRATEGIES.items() if each.keeps_fraction]
            raise ConfigError(f"kept_fraction_schedule {self.kept_fraction_schedule} applies to the strategies that keep "
                              f"a fraction ({', '.join(keeping)}), not {self.strategy}")
        _require(self.epochs >= 1, "epochs", self.epochs, ">= 1")
        if card.selects and self.prime_epochs + self.anneal_epochs >= self.epochs:
            raise ConfigError(
                f"prime_epochs={self.prime_epochs} and anneal_epochs={self.anneal_epochs} train on every example in "
                f"all {self.epochs} epochs: {self.strategy} would never select; give more epochs or fewer of those"
            )
        _require(self.lr > 0 and math.isfinite(self.lr), "lr", self.lr, "a finite number > 0")
        _require(0 <= self.momentum < 1, "momentum", self.momentum, "in [0, 1)")
        _require(self.weight_decay >= 0, "weight_decay", self.weight_decay, ">= 0")
        _require(
            self.lr_warmup_epochs >= 0 and math.isfinite(self.lr_warmup_epochs),
            "lr_warmup_epochs",
            self.lr_warmup_epochs,
            "a finite number >= 0",
        )
        _require(0 < self.lr_factor <= 1, "lr_factor", self.lr_factor, "in (0, 1]")
        if self.grad_clip_norm is not None:
            _require(self.grad_clip_norm > 0, "grad_clip_norm", self.grad_clip_norm, "> 0")
        if self.lr_schedule in ("step", "accelerated") and not self.lr_milestones:
            raise ConfigError(f"lr_schedule {self.lr_schedule} needs lr_milestones (epochs to decay at)")
        _require(0 <= self.label_noise < 1, "label_noise", self.label_noise, "in [0, 1)")
        for name in ("subset", "test_subset"):
            value = getattr(self, name)
            if value is not None:
                _require(value >= 1, name, value, ">= 1")
        for name in ("crop_padding", "cutout"):
            _require(getattr(self, name) >= 0, name, getattr(self, name), ">= 0")
        if self.time_budget is not None:
            _require(self.time_budget > 0, "time_budget", self.time_budget, "> 0 seconds")
        if self.work_budget is not None:
            _require(self.work_budget > 0 and math.isfinite(self.work_budget), "work_budget", self.work_budget,
                     "a finite number > 0 (epochs of training work)")
        if self.scoring_cost is not None:
            _require(self.scoring_cost >= 0 and math.isfinite(self.scoring_cost), "scoring_cost", self.scoring_cost,
                     "a finite number >= 0 (a scored example's cost over a trained one's)")
        _require(self.eval_every >= 1, "eval_every", self.eval_every, ">= 1")
        for sink in self.log_to:
            check_choice("log_to", sink, METRIC_SINKS)
        _require(self.progress_seconds >= 0, "progress_seconds", self.progress_seconds, ">= 0")
        _require(self.collapse_patience >= 0, "collapse_patience", self.collapse_patience, ">= 0")
        if self.workers is not None:
            _require(self.workers >= 0, "workers", self.workers, ">= 0 (0 runs Ray Train in-process)")
        _require(self.cpus_per_worker > 0, "cpus_per_worker", self.cpus_per_worker, "> 0")
        _require(self.gpus_per_worker >= 0, "gpus_per_worker", self.gpus_per_worker, ">= 0")
        if self.gpus_per_worker > 0 and self.device == "cpu":
            raise ConfigError("gpus_per_worker > 0 contradicts device=cpu")
        _require(self.checkpoint_every >= 1, "checkpoint_every", self.checkpoint_every, ">= 1")
        if self.resume and self.overwrite:
            raise ConfigError("--resume continues the run in --out and --overwrite replaces it: give one of them")
        _require(self.max_failures >= -1, "max_failures", self.max_failures, ">= 0, or -1 for unlimited")
        _require(self.placement_timeout > 0, "placement_timeout", self.placement_timeout, "> 0 seconds")
        check_choice("shard_mode", self.shard_mode, SHARD_MODES)
        self._validate_loss_table(card)
        self._validate_streaming()
        self._validate_pipeline()
        if self.chaos is not None:
            try:
                parse_chaos(self.chaos)
            except ChaosSpecError as error:
                raise ConfigError(str(error)) from None
        _require(self.eval_batch_size >= 1, "eval_batch_size", self.eval_batch_size, ">= 1")
        try:  # the selection settings' checks live with them (raysb.core.spec)
            self.selection_spec()
        except ValueError as error:
            raise ConfigError(str(error)) from None

    def _validate_loss_table(self, card) -> None:
        check_choice("loss_table", self.loss_table, LOSS_TABLES)
        if self.loss_table == "replicated":
            return
        if not card.shardable_table:
            sharding = [name for name, each in STRATEGIES.items() if each.shardable_table]
            raise ConfigError(f"loss_table sharded applies to the strategies that decide every epoch from their loss "
                              f"table as it starts ({', '.join(sharding)}), not {self.strategy}")
        if self.workers is None:
            raise ConfigError("loss_table sharded splits the table between Ray Train workers: set workers")
        # Each rank decides only the examples it owns, so no epoch may look another's up chunk by chunk.
        chunk_by_chunk = (["data_mode=stream"] if self.data_mode != "memory" else []) + \
            (["plan_epochs=false"] if not self.plan_epochs else []) + \
            (["score_refresh_epochs"] if self.score_refresh_epochs is not None else [])
        if chunk_by_chunk:
            raise ConfigError(f"loss_table sharded decides every epoch as it starts, which {', '.join(chunk_by_chunk)} "
                              "does not: use loss_table replicated")

    def _validate_streaming(self) -> None:
        check_choice("data_mode", self.data_mode, DATA_MODES)
        for role, name in self.parquet_columns.items():
            check_choice("parquet_columns key", role, PARQUET_COLUMN_ROLES)
            if not isinstance(name, str) or not name:
                raise ConfigError(f"parquet_columns.{role} must be a column name, got {name!r}")
        if self.parquet_columns and self.dataset != "parquet":
            raise ConfigError(f"parquet_columns names the columns of dataset parquet, not of {self.dataset!r}")
        _require(self.stream_shuffle_buffer >= 1, "stream_shuffle_buffer", self.stream_shuffle_buffer, ">= 1")
        if self.data_mode == "memory":
            return
        if self.dataset != "parquet":
            raise ConfigError(
                f"data_mode=stream reads the raysb Parquet format (dataset=parquet), not {self.dataset!r}; "
                "convert a dataset with raysb.data.write_parquet"
            )
        if self.workers is None:
            raise ConfigError("data_mode=stream runs on Ray Data: set workers (0 for Ray Train in this process)")
        in_memory_only = [
            name for name in ("subset", "test_subset") if getattr(self, name) is not None
        ] + (["label_noise"] if self.label_noise > 0 else [])
        if in_memory_only:
            raise ConfigError(f"{', '.join(in_memory_only)} work on in-memory data only, not with data_mode=stream")

    def _validate_pipeline(self) -> None:
        check_choice("pipeline_selection", self.pipeline_selection, PIPELINE_MODES)
        _require(self.pipeline_depth >= 1, "pipeline_depth", self.pipeline_depth, ">= 1 chunk")
        _require(self.pipeline_sync_every >= 1, "pipeline_sync_every", self.pipeline_sync_every, ">= 1 step")
        _require(self.pipeline_cpus > 0, "pipeline_cpus", self.pipeline_cpus, "> 0")
        _require(self.pipeline_gpus >= 0, "pipeline_gpus", self.pipeline_gpus, ">= 0")
        if self.pipeline_selection == "actor" and self.workers is None:
            raise ConfigError("pipeline_selection=actor scores on a Ray actor: set workers (0 for Ray Train in this process)")

    # -- serialization ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def saved_values(self) -> dict[str, Any]:
        """The resolved values as a run keeps them (config.yaml, its checkpoint).

        `resume` and `overwrite` say what one invocation does with its --out, not how the
        run trains: they are saved off, so running them again never replaces a run."""
        return {**self.to_dict(), "resume": False, "overwrite": False}

    def save(self, path: str | Path) -> None:
        """The resolved config as YAML that `raysb train --config` runs again as it ran."""
        write_config(self.saved_values(), path)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> "TrainConfig":
        known = {f.name: f for f in dataclasses.fields(cls)}
        retired = sorted(set(values) & set(RETIRED_KEYS))
        if retired:
            raise ConfigError(f"{source}: " + "; ".join(f"{key} {RETIRED_KEYS[key]}" for key in retired))
        unknown = sorted(set(values) - set(known))
        if unknown:
            guesses = [difflib.get_close_matches(key, known, n=1) for key in unknown]
            named = ", ".join(key + (f" (did you mean {guess[0]}?)" if guess else "") for key, guess in zip(unknown, guesses))
            raise ConfigError(f"unknown key(s) in {source}: {named}")
        try:
            return cls(**{k: _coerce(known[k], v, source) for k, v in values.items()})
        except TypeError as error:
            raise ConfigError(f"bad value in {source}: {error}") from None

    @classmethod
    def load(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "TrainConfig":
        return cls.from_dict(merge_overrides(read_config_file(path), overrides or {}), source=str(path))


_FIELDS = {spec.name: spec for spec in dataclasses.fields(TrainConfig)}


def write_config(saved_values: dict[str, Any], path: str | Path) -> None:
    """A run's saved values (`TrainConfig.saved_values`) as the YAML file `raysb train --config` reads."""
    Path(path).write_text(yaml.safe_dump(saved_values, sort_keys=False))


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The keys a YAML config file sets, as written (unvalidated)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{path} is not valid YAML{where}: {problem}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, got {type(values).__name__}")
    return values


def coerce_key(key: str, value: Any, source: str) -> Any:
    """`value` (a YAML or command-line scalar) in the type of config key `key`, as TrainConfig would hold it."""
    return _coerce(_FIELDS[key], value, source)


def parse_overrides(assignments: list[str]) -> dict[str, Any]:
    """`key=value` strings (values parsed as YAML) into a dict; `a.b=v` sets key b of dict a."""
    overrides: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {assignment!r}")
        value = yaml.safe_load(raw) if raw else None
        head, _, sub = key.partition(".")
        if sub:
            overrides.setdefault(head, {})[sub] = value
        else:
            overrides[head] = value
    return overrides


def merge_overrides(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Overrides win; a dict-valued key (model_options) is merged, not replaced; and an
    override of selectivity or beta replaces both, as they are two names for one setting."""
    merged = dict(values)
    if "selectivity" in overrides or "beta" in overrides:
        merged.pop("selectivity", None)
        merged.pop("beta", None)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _coerce(spec: dataclasses.Field, value: Any, source: str) -> Any:
    """Turn YAML/CLI scalars into the field's type, naming the key when that fails."""
    if value is None:
        return None
    kind = str(spec.type)
    try:
        if kind.startswith("bool"):
            if isinstance(value, str):
                lowered = value.lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return lowered in ("true", "1", "yes")
            return bool(value)
        if kind.startswith("int"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if kind.startswith("float"):
            return float(value)
        if kind == "dict" and not isinstance(value, dict):
            raise ValueError(value)
        if kind == "list":
            return list(value) if isinstance(value, (list, tuple)) else [value]
        if kind.startswith("str"):
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{spec.name} in {source} must be {_in_words(kind)}, got {value!r}") from None
    return value


# A field's annotation as a user would say it (the annotation itself read "float | None").
_KINDS_IN_WORDS = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "a string",
                   "dict": "a mapping (key: value, ...)", "list": "a list"}


def _in_words(kind: str) -> str:
    base, _, optional = kind.partition(" | ")
    words = _KINDS_IN_WORDS.get(base, base)
    return f"{words} (or left out)" if optional == "None" else words


def _require(ok: bool, name: str, value: Any, expectation: str) -> None:
    if not ok:
        raise ConfigError(f"{name} must be {expectation}, got {value!r}")
