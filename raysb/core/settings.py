"""A run's settings in typed sections, each value final: what every part of a run reads, and where
every config key is declared, once (raysb.core.config_keys: its name, type, default and check).

`raysb.config.TrainConfig` is the flat record users write (YAML, `--set KEY=VALUE`, Tune's
search spaces): its fields are derived from the keys declared here (and from the built-in
strategies' options, raysb.core.strategy_options); it reads, defaults and validates them once and
builds these sections from them (`TrainConfig.settings()`). Each part of the run receives the
section it needs: the data pipeline `DataSettings`, the model builder `ModelSettings`, the scorer
`ScoringSettings`, the optimizer and lr schedule `OptimizationSettings`, selection
`SelectionSettings`, the epoch loop `RunSettings`, Ray `ClusterSettings`. Pure Python, frozen, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from raysb.chaos_spec import ChaosSpecError, parse_chaos
from raysb.core.config_keys import copy_of, derived, each_one_of, key, must, one_of
from raysb.core.errors import ConfigError, check_choice
from raysb.core.schedules import SCHEDULE_KEYS, SCHEDULE_NAMES
from raysb.core.selectivity import KEPT_FRACTION_SCHEDULES, SELECTION_STRENGTH_SCHEDULES
from raysb.core.spec import SelectionSpec
from raysb.core.strategy_table import strategy_card

# The names the keys accept besides; the modules that implement them key their tables by these.
DATASET_NAMES = ("fashion-mnist", "mnist", "cifar10", "cifar100", "svhn", "parquet", "imagefolder", "numpy")
DATA_MODES = ("memory", "stream")
SHARD_MODES = ("shuffled", "contiguous")
# What raysb reads from a Parquet row (raysb.data.parquet.COLUMN_ROLES, which imports torch).
PARQUET_COLUMN_ROLES = ("image", "label", "sample_id")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
SELECTION_PRECISIONS = ("fp32", "bf16", "fp16", "int8")
SELECTION_BATCHNORMS = ("running", "batch", "running-after-warmup")
SELECTION_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
PIPELINE_MODES = ("inline", "thread", "actor")
OPTIMIZER_NAMES = ("sgd", "adam")
LOSS_TABLES = ("replicated", "sharded")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Where each epoch's metrics row can go besides metrics.parquet (raysb.training.metric_sinks).
METRIC_SINKS = ("tensorboard", "mlflow")
# The epochs of a run that gives neither epochs nor a budget.
DEFAULT_EPOCHS = 10
# One process's b; N workers split it unless the run gives batch_size (each worker's) or global_batch_size.
DEFAULT_BATCH_SIZE = 128

_AT_LEAST_0 = must(lambda value: value >= 0, ">= 0")
_AT_LEAST_1 = must(lambda value: value >= 1, ">= 1")
_ABOVE_0 = must(lambda value: value > 0, "> 0")
_BELOW_1 = must(lambda value: 0 <= value < 1, "in [0, 1)")
_EPOCH_LIST = must(lambda values: all(isinstance(value, (int, float)) and not isinstance(value, bool)
                                       for value in values), "a list of epochs (numbers)")


def _known_strategy(name: str, value: str) -> None:
    strategy_card(value)


def _parquet_columns(name: str, columns: dict) -> None:
    for role, column in columns.items():
        check_choice("parquet_columns key", role, PARQUET_COLUMN_ROLES)
        if not isinstance(column, str) or not column:
            raise ConfigError(f"parquet_columns.{role} must be a column name, got {column!r}")


def _chaos(name: str, spec: str) -> None:
    try:
        parse_chaos(spec)
    except ChaosSpecError as error:
        raise ConfigError(str(error)) from None


@dataclass(frozen=True, kw_only=True)
class DataSettings:
    """Which data, how much of it, how it reaches the ranks and how it is augmented."""

    dataset: str = key("fashion-mnist", check=one_of(DATASET_NAMES))
    data_dir: str | None = key(None)
    # every image resized to image_size x image_size as it is read (raysb.data.image_size), so images of
    # mixed sizes train; None: as they are, all of one size
    image_size: int | None = key(None, check=_AT_LEAST_1)
    download: bool = key(False)
    subset: int | None = key(None, check=_AT_LEAST_1)
    test_subset: int | None = key(None, check=_AT_LEAST_1)
    label_noise: float = key(0.0, check=_BELOW_1)
    # a Parquet or CSV file with a sample_id column (a run's label_suspects.parquet): those examples are
    # left out of training (raysb.data.prepare)
    exclude_samples: str | None = key(None)
    # augmentation of the training images (raysb.data.transforms), each seeded: a random crop after zero
    # padding by this many pixels on every side (0: none)
    crop_padding: int = key(0, check=_AT_LEAST_0)
    # mirror each training image left-right with probability 1/2
    horizontal_flip: bool = key(False)
    # zero a square of this side at a random place in each training image (DeVries & Taylor, 2017; 0: none)
    cutout: int = key(0, check=_AT_LEAST_0)
    # memory: whole splits as tensors on every rank; stream: Parquet through Ray Data
    data_mode: str = key("memory", check=one_of(DATA_MODES))
    # dataset parquet: the file's column for each of image, label, sample_id where it is not
    # named so, e.g. {image: pixels, label: target}
    parquet_columns: dict = key(factory=dict, check=_parquet_columns)
    # data_mode stream: the rows Ray Data's local shuffle draws each batch from, on each worker
    stream_shuffle_buffer: int = key(10_000, check=_AT_LEAST_1)
    # in-memory data on several workers: shuffled deals each rank a new random shard every epoch; contiguous
    # pins each rank to one block of the data, visited in a new order each epoch, as file-based sharding would
    shard_mode: str = key("shuffled", check=one_of(SHARD_MODES))
    # Seeds the subsets, the held-out split (seed + 5), the label noise (seed + 6) and the shards' order.
    seed: int = copy_of("seed")
    # The share of the training data held out of training, as the strategy's card asks
    # (SelectionSpec.holdout_share): RHO-LOSS's irreducible-loss model trains on it, free-sb's guard reads it.
    held_out_share: float = derived()


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    """The network and how the training forward and backward run it."""

    # small-cnn, resnet18, wideresnet, mobilenetv2, densenet, or your own network as package.module:factory
    name: str = key("small-cnn", name="model")
    # keyword arguments of the model's builder, e.g. {depth: 16, widen_factor: 8} for wideresnet
    options: dict = key(name="model_options", factory=dict)
    # training precision (raysb.training.precision): fp32, bf16 or fp16 autocast (fp16 with a
    # gradient scaler); auto: bf16 on a GPU that has it, fp32 elsewhere
    precision: str = key("auto", check=one_of(PRECISIONS))
    # model and inputs in NHWC; None: on CUDA devices, where convolutions run faster so
    channels_last: bool | None = key(None)
    # torch.compile of the training forward and backward with static shapes (every step has exactly b
    # examples). None: on where the training step is captured (its compiled kernels inside the graph:
    # ResNet-18 at b512 on an H200, 6.46 ms a step against 8.69 captured uncompiled; BENCHMARKS.md,
    # "Training at the GPU's speed"); uncaptured, compiling made the step slower there
    compile: bool | None = key(None, name="compile_training")
    # The training step (forward, backward, update) replayed as a CUDA graph at its fixed batch
    # (raysb.training.cuda_graphs); None: on CUDA. A setting or model that cannot be captured trains
    # eagerly, saying why in one line. On a CPU, true runs the captured code path without a graph.
    capture: bool | None = key(None, name="capture_training")


@dataclass(frozen=True, kw_only=True)
class ScoringSettings:
    """The selection forward: its precision, BatchNorm, input scale, compilation and pipelining."""

    # auto (the training precision), fp32, bf16 or fp16 autocast, or int8 (CPU: a quantized copy
    # re-quantized every selection_refresh_steps steps; raysb.training.selection.scoring)
    precision: str = key("auto", name="selection_precision", check=one_of(("auto", *SELECTION_PRECISIONS)))
    # BatchNorm in the selection forward: batch (the chunk's own statistics, as a training forward
    # normalizes; running ones untouched), running (eval-mode statistics, the authors'), or auto:
    # batch, except for int8 selection, which folds BatchNorm into its convolutions. Running
    # statistics lag the weights and come from hard-biased batches, which throws SB off at large b
    # (measured: BENCHMARKS.md, "SB at large b: BatchNorm in the selection forward").
    # running-after-warmup: batch until the lr warmup ends, running after it (eval-mode scoring once
    # the running statistics settle; BENCHMARKS.md, "Selection that pays")
    batchnorm: str = key("auto", name="selection_batchnorm", check=one_of(("auto", *SELECTION_BATCHNORMS)))
    # score inputs downsampled by this factor (bilinear; Composer's scale_factor): 0.5 costs about a
    # quarter of the forward on models that pool to a fixed size before their head
    scale: float = key(1.0, name="selection_scale", check=must(lambda scale: 0 < scale <= 1, "in (0, 1]"))
    # torch.compile of the selection forward with static shapes (an epoch's last chunk padded to full size).
    # None: on where the selection forward is captured as a CUDA graph (inductor's kernels inside it, as the
    # training step has them); a CPU replays no graph, and would only wait for the compile
    compile: bool | None = key(None, name="compile_selection")
    # torch.compile's mode for it: default, reduce-overhead (CUDA graphs at the fixed selection batch), max-autotune
    compile_mode: str = key("default", name="selection_compile_mode", check=one_of(SELECTION_COMPILE_MODES))
    # The selection forward replayed as a CUDA graph at its fixed batch, SB's fixed-count keep decision as
    # another (raysb.training.selection.keep_rule_graph), and SB's whole round as one where its data is on
    # the device (raysb.training.selection.round_graph); None: on CUDA
    capture: bool | None = key(None, name="capture_selection")
    # selection_precision int8: optimizer steps between re-quantizations of the scoring copy
    refresh_steps: int = key(1, name="selection_refresh_steps", check=_AT_LEAST_1)
    # pipelined selection (raysb.training.selection.pipeline): inline (off), thread (a background thread)
    # or actor (a Ray actor per worker, with pipeline_cpus and pipeline_gpus of its own)
    pipeline: str = key("inline", name="pipeline_selection", check=one_of(PIPELINE_MODES))
    # pipelined selection: chunks scored ahead of training
    pipeline_depth: int = key(2, check=must(lambda depth: depth >= 1, ">= 1 chunk"))
    # pipelined selection: optimizer steps between refreshes of the scorer's model copy
    pipeline_sync_every: int = key(1, check=must(lambda steps: steps >= 1, ">= 1 step"))
    # pipeline_selection actor: the CPUs of each scoring actor
    pipeline_cpus: float = key(1.0, check=_ABOVE_0)
    # pipeline_selection actor: the GPUs of each scoring actor (a second GPU scores beside the trainer's)
    pipeline_gpus: float = key(0.0, check=_AT_LEAST_0)


@dataclass(frozen=True, kw_only=True)
class OptimizationSettings:
    """The optimizer and its learning-rate schedule, and the budget a time- or work-keyed one ends at."""

    # the run's epochs. None: DEFAULT_EPOCHS (10) where no time or work budget is given (resolved by the
    # config); beside a budget, none: the budget alone ends the run. Given with a budget, whichever ends
    # first ends it.
    epochs: int | None = key(None, check=_AT_LEAST_1)
    # b: the examples of every training step (checked with selection's settings, raysb.core.spec), on
    # each worker: given, N workers train N x b a step. None: DEFAULT_BATCH_SIZE (128) over the workers
    # (resolved by the config; rounded down where they do not split it), so N workers take one
    # process's steps at the same lr: at the same work, N x b a step ended 2-11 points of test error
    # above one process on 2 and 4 workers, one process's step split over them where one process ends
    # (docs/guides/ray-cluster.md, "Batch size and lr on many workers")
    batch_size: int | None = key(None, check=_AT_LEAST_1)
    # The examples of a step on all workers together: given, each worker's b is this over the workers
    # (resolved by the config; it must split evenly), whatever batch_size says
    global_batch_size: int | None = key(None, check=_AT_LEAST_1)
    optimizer: str = key("sgd", check=one_of(OPTIMIZER_NAMES))
    lr: float = key(0.05, check=must(lambda lr: lr > 0 and math.isfinite(lr), "a finite number > 0"))
    # SGD's momentum (Adam's beta1)
    momentum: float = key(0.9, check=_BELOW_1)
    # SGD with Nesterov momentum
    nesterov: bool = key(False)
    # L2 penalty on the weights, as the optimizer applies it
    weight_decay: float = key(5e-4, check=_AT_LEAST_0)
    # the lr's schedule after warmup: cosine, linear (to 0), static, step (x lr_factor at each of
    # lr_milestones) or accelerated (the same at 0.8x the milestones). Cosine by default: with a static lr,
    # test error jumped about from one epoch to the next, so a time to target landed on whichever epoch
    # dipped (the figures: docs/concepts/budgets.md, "Schedules that end at the budget").
    lr_schedule: str = key("cosine", check=one_of(SCHEDULE_NAMES))
    # lr_schedule step or accelerated: the epochs at which the lr decays
    lr_milestones: tuple = key(factory=tuple, check=_EPOCH_LIST)
    # lr_schedule step or accelerated: the lr is multiplied by this at each milestone
    lr_factor: float = key(0.2, check=must(lambda factor: 0 < factor <= 1, "in (0, 1]"))
    # epoch, backprop, time (training seconds over time_budget) or work (over work_budget); auto: work
    # under a work budget, time under a time budget, else epoch (resolved by the config)
    lr_schedule_key: str = key("auto", check=one_of(("auto", *SCHEDULE_KEYS)))
    # the lr ramps up linearly over this many epochs' worth of backpropagated examples. Without warmup,
    # lr 0.05 with momentum 0.9 threw the small CNN's first steps far enough to kill its hidden units
    # under label noise (BENCHMARKS.md, "Stability").
    lr_warmup_epochs: float = key(1.0, check=must(lambda epochs: epochs >= 0 and math.isfinite(epochs),
                                                  "a finite number >= 0"))
    # clip each step's gradient to this norm (None: no clipping)
    grad_clip_norm: float | None = key(None, check=_ABOVE_0)
    # stop after this many seconds of training
    time_budget: float | None = key(None, check=must(lambda seconds: seconds > 0, "> 0 seconds"))
    # stop after this much work, in epochs of Traditional training: trained examples, plus scored
    # ones weighted by scoring_cost (raysb.core.work_units); the same seed and budget end the same under any load
    work_budget: float | None = key(None, check=must(lambda work: work > 0 and math.isfinite(work),
                                                     "a finite number > 0 (epochs of training work)"))

    @property
    def schedule_epochs(self) -> int:
        """The lr schedule's length in epochs, the unit of its milestones: the run's epochs, or where a
        budget alone ends the run, DEFAULT_EPOCHS stretched over the budget."""
        return self.epochs or DEFAULT_EPOCHS


@dataclass(frozen=True, kw_only=True)
class SelectionSettings:
    """What selects, and how it moves over the run. The keys that only the strategy and its rounds
    read come resolved in `spec`; a built-in strategy's own options are its card's
    (raysb.core.strategy_table), and reach it in `spec.options`."""

    strategy: str = key("sb", check=_known_strategy)
    # the expected kept fraction s, or beta (s = 1 / (beta + 1)): two names for one setting
    selectivity: float | None = key(None)
    beta: float | None = key(None)
    # the examples each selection round scores; None: the batch size b
    selection_batch_size: int | None = key(None)
    # R, the recent losses CDF_R ranks against
    history_size: int = key(1024)
    # plain SGD for the first k epochs (the strategy selects from then on)
    prime_epochs: int = key(0, check=_AT_LEAST_0)
    # a safeguard (BENCHMARKS.md, "Stability"): plain SGD on all the data for the last k epochs
    anneal_epochs: int = key(0, check=_AT_LEAST_0)
    # a safeguard: plain SGD on all the data for the last share of the run as its schedule measures it
    # (epochs, or the budget, whose epochs are not known in advance)
    anneal_share: float = key(0.0, check=_BELOW_1)
    # a safeguard: the least keep probability of any example (0: the paper's CDF_R ^ beta)
    keep_floor: float = key(0.0)
    # The kept fraction over the run, for the strategies that keep a fraction: constant (the selectivity),
    # or lr: rising from the selectivity to 1 as the lr decays, s(t) = s + (1 - s)(1 - lr(t) / lr_peak),
    # set at each epoch's start (raysb.core.selectivity.scheduled_selectivity)
    kept_fraction_schedule: str = key("constant", check=one_of(KEPT_FRACTION_SCHEDULES))
    # How strongly SB's keep rule prefers high scores over the run: constant (its rule throughout),
    # or lr: fading to a uniform draw of the same kept fraction as the lr decays, P = w CDF ^ beta + (1 - w) s
    # with w = lr(t) / lr_peak, set at each epoch's start (raysb.core.selectivity.scheduled_strength).
    selection_strength_schedule: str = key("constant", check=one_of(SELECTION_STRENGTH_SCHEDULES))
    # Weight each kept example by (keep probability now) / (keep probability when scored), so that
    # selection on scores some steps old does not amplify what the last steps did: without it SB on
    # scores one step old collapsed to chance (BENCHMARKS.md, "Stability"). auto: on where scores feed
    # later steps (selection batch > b, pipelined, or N > 1 workers scoring a few chunks between
    # exchanges); always (it also helped SB on noisy labels: 20% flipped, 10.1% against 10.6% on full
    # Fashion-MNIST); never.
    staleness_correction: str = key("auto")
    # How many of each selection chunk SB and Stale-SB keep: random (each example by its own draw,
    # the paper's rule: a GPU learns the count of SB's captured round two rounds late, and reads it
    # each round where the round runs eagerly), fixed (exactly round(s n), inclusion proportional to
    # the keep probability: nothing to read), auto (fixed on a GPU, random elsewhere)
    kept_per_chunk: str = key("auto")
    # A strategy's own options (its card's `options`), the given ones over the defaults; a name its
    # card does not declare is refused. A built-in's options are config keys of their own names too.
    strategy_options: dict = key(factory=dict)
    # decide an epoch whole as it starts where nothing needs a forward of its own (traditional, uniform,
    # free-sb, infobatch, stale-sb between passes, plain-SGD epochs), then train it as a plain loop
    # (raysb.training.selection.rounds); streamed, read and decode only the rows it keeps
    # (docs/guides/data.md); false: chunk by chunk, the same distribution, every row read
    plan_epochs: bool = key(True)
    # lockstep ranks' loss table (free-sb, infobatch): replicated (every rank holds and updates every
    # example's score) or sharded (each rank the examples it owns, id mod ranks, and decides those)
    loss_table: str = key("replicated", check=one_of(LOSS_TABLES))
    spec: SelectionSpec = derived()


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """The epoch loop around training: where it writes, when it evaluates, checkpoints and stops."""

    out: str = key("runs/latest")
    # continue the run in out from its last checkpoint (raysb.resume) instead of refusing to start
    resume: bool = key(False)
    # replace the run in out (its files only) instead of refusing to start
    overwrite: bool = key(False)
    epochs: int | None = copy_of("epochs")
    # evaluate on the test set every k epochs, and after the last
    eval_every: int = key(1, check=_AT_LEAST_1)
    # examples per forward of the evaluation
    eval_batch_size: int = key(1024, check=_AT_LEAST_1)
    checkpoint_every: int = key(1, check=_AT_LEAST_1)
    # a progress line inside an epoch every this many seconds (0: only the epoch lines)
    progress_seconds: float = key(10.0, check=_AT_LEAST_0)
    # each epoch's metrics row also to: tensorboard (OUT/tensorboard), mlflow (MLFLOW_TRACKING_URI)
    log_to: tuple = key(factory=tuple, check=each_one_of(METRIC_SINKS))
    # Evaluations in a row at chance that end a run as diverged (0: never).
    collapse_patience: int = key(3, check=_AT_LEAST_0)
    # Selection counts, CDF_R snapshots, tracked decisions, gradient probes and the final model, for
    # `raysb report`'s figures of the paper (raysb.training.trace). Off by default: an evaluated epoch's
    # probes cost a fixed few training steps, 4% of a free-sb epoch on all of Fashion-MNIST and more than
    # the training itself on 2,000 examples (BENCHMARKS.md, "Budgets that end at the budget").
    record_analysis: bool = key(False)
    time_budget: float | None = copy_of("time_budget")
    work_budget: float | None = copy_of("work_budget")
    # A selection forward's cost per example relative to a training example's forward and backward;
    # None: measured at the run's start where the strategy scores (stored with the run), 0 where it does not.
    scoring_cost: float | None = key(None, check=must(lambda cost: cost >= 0 and math.isfinite(cost),
                                                      "a finite number >= 0 (a scored example's cost over a "
                                                      "trained one's)"))
    # the run's random seed. Streams of a run: data order seed, augmentation seed + 1, selection seed + 2,
    # gradient probes seed + 3, tracked examples seed + 4, the held-out split seed + 5,
    # the label noise seed + 6 (raysb.data.prepare).
    seed: int = key(0)
    # auto (CUDA where there is one), cpu, cuda or cuda:N
    device: str = key("auto", check=must(lambda device: device in ("auto", "cpu", "cuda") or device.startswith("cuda:"),
                                         "auto, cpu, cuda or cuda:N"))
    # The strategy spends forwards of its own on scoring (a work budget counts them).
    runs_scoring_forwards: bool = derived()
    # torch.compile is on for the selection or the training forward (the summary counts its graphs).
    compiles: bool = derived()
    # The run's headline: its strategy, data and model, and the selectivity where the strategy reads one.
    strategy: str = copy_of("strategy")
    dataset: str = copy_of("dataset")
    model: str = copy_of("model")
    selectivity: float | None = derived()
    # The resolved config: as given (summary.json), and as the run keeps it to run again (config.yaml,
    # its checkpoints: resume and overwrite off; raysb.config.TrainConfig.saved_values).
    record: dict = derived(repr=False)
    saved: dict = derived(repr=False)


@dataclass(frozen=True, kw_only=True)
class ClusterSettings:
    """Ray: how many workers, their resources, where the cluster and the run's storage are."""

    # Ray Train workers; None: a plain single process without Ray
    workers: int | None = key(None, check=must(lambda workers: workers >= 0, ">= 0 (0 runs Ray Train in-process)"))
    cpus_per_worker: float = key(1.0, check=_ABOVE_0)
    gpus_per_worker: float = key(0.0, check=_AT_LEAST_0)
    address: str | None = key(None)
    storage_path: str | None = key(None)
    max_failures: int = key(0, check=must(lambda failures: failures >= -1, ">= 0, or -1 for unlimited"))
    # seconds a worker group may wait for its resources, at the start and after each restart
    # (long enough for an autoscaler to boot GPU nodes and pull their image); past it the run stops
    placement_timeout: float = key(1800.0, check=must(lambda seconds: seconds > 0, "> 0 seconds"))
    # how Ray places the workers on nodes (Ray's placement group strategies): PACK fills as few
    # nodes as it can, SPREAD uses as many, so that a lost node takes fewer workers with it and
    # the group fits again on the nodes that are left
    placement_strategy: str = key("PACK", check=one_of(PLACEMENT_STRATEGIES))
    # faults to inject (raysb.chaos_spec)
    chaos: str | None = key(None, check=_chaos)
    # show Ray's own console output (worker logs, per-report messages) besides raysb's lines
    verbose: bool = key(False)


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
