"""A run's settings in typed sections, each value final: what every part of a run reads.

`raysb.config.TrainConfig` is the flat record users write (YAML, `--set KEY=VALUE`, Tune's
search spaces); it reads, defaults and validates it once and hands out these sections
(`TrainConfig.settings()`). Each part of the run receives the section it needs: the data
pipeline `DataSettings`, the model builder `ModelSettings`, the scorer `ScoringSettings`, the
optimizer and lr schedule `OptimizationSettings`, selection `SelectionSettings`, the epoch loop
`RunSettings`, Ray `ClusterSettings`. Pure Python, frozen, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from raysb.core.spec import SelectionSpec


@dataclass(frozen=True)
class DataSettings:
    """Which data, how much of it, how it reaches the ranks and how it is augmented."""

    dataset: str
    data_dir: str | None
    download: bool
    subset: int | None
    test_subset: int | None
    label_noise: float
    # memory: whole splits as tensors on every rank; stream: Parquet through Ray Data
    data_mode: str
    parquet_columns: dict
    stream_shuffle_buffer: int
    shard_mode: str
    crop_padding: int
    horizontal_flip: bool
    cutout: int
    # Seeds the subsets, the label noise and the shards' order.
    seed: int


@dataclass(frozen=True)
class ModelSettings:
    """The network and how the training forward and backward run it."""

    name: str
    options: dict
    # auto: bf16 on a GPU that has it, fp32 elsewhere (raysb.training.precision)
    precision: str
    # None: NHWC on CUDA devices
    channels_last: bool | None
    # None: compiled where the step is captured
    compile: bool | None
    # None: the training step captured as a CUDA graph on CUDA
    capture: bool | None


@dataclass(frozen=True)
class ScoringSettings:
    """The selection forward: its precision, BatchNorm, input scale, compilation and pipelining."""

    # auto: the training precision
    precision: str
    batchnorm: str
    scale: float
    compile: bool
    compile_mode: str
    # None: the selection forward captured as a CUDA graph on CUDA
    capture: bool | None
    refresh_steps: int
    pipeline: str
    pipeline_depth: int
    pipeline_sync_every: int
    pipeline_cpus: float
    pipeline_gpus: float


@dataclass(frozen=True)
class OptimizationSettings:
    """The optimizer and its learning-rate schedule, and the budget a time- or work-keyed one ends at."""

    epochs: int
    batch_size: int
    optimizer: str
    lr: float
    momentum: float
    nesterov: bool
    weight_decay: float
    lr_schedule: str
    lr_milestones: tuple
    lr_factor: float
    # epoch, time or work (resolved from auto)
    lr_schedule_key: str
    lr_warmup_epochs: float
    grad_clip_norm: float | None
    time_budget: float | None
    work_budget: float | None


@dataclass(frozen=True)
class SelectionSettings:
    """What selects, and how it moves over the run."""

    spec: SelectionSpec
    anneal_epochs: int
    anneal_share: float
    kept_fraction_schedule: str
    selection_strength_schedule: str
    plan_epochs: bool
    loss_table: str


@dataclass(frozen=True)
class RunSettings:
    """The epoch loop around training: where it writes, when it evaluates, checkpoints and stops."""

    out: str
    epochs: int
    eval_every: int
    eval_batch_size: int
    checkpoint_every: int
    progress_seconds: float
    log_to: tuple
    collapse_patience: int
    record_analysis: bool
    time_budget: float | None
    work_budget: float | None
    # A scored example's cost over a trained one's; None: measured at the start where it scores.
    scoring_cost: float | None
    # The strategy spends forwards of its own on scoring (a work budget counts them).
    runs_scoring_forwards: bool
    # torch.compile is on for the selection or the training forward (the summary counts its graphs).
    compiles: bool
    resume: bool
    seed: int
    device: str
    # The run's headline: its strategy, data and model, and the selectivity where the strategy reads one.
    strategy: str
    dataset: str
    model: str
    selectivity: float | None
    # The resolved config: as given (summary.json), and as the run keeps it to run again (config.yaml,
    # its checkpoints: resume and overwrite off; raysb.config.TrainConfig.saved_values).
    record: dict = field(repr=False)
    saved: dict = field(repr=False)


@dataclass(frozen=True)
class ClusterSettings:
    """Ray: how many workers, their resources, where the cluster and the run's storage are."""

    workers: int | None
    cpus_per_worker: float
    gpus_per_worker: float
    address: str | None
    storage_path: str | None
    max_failures: int
    placement_timeout: float
    chaos: str | None
    verbose: bool


@dataclass(frozen=True)
class Settings:
    """Every section of one run."""

    data: DataSettings
    model: ModelSettings
    scoring: ScoringSettings
    optimization: OptimizationSettings
    selection: SelectionSettings
    run: RunSettings
    cluster: ClusterSettings
