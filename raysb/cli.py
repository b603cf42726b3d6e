"""`raysb` command line: `raysb train --config FILE --set key=value --epochs 3 ...`,
`raysb tune SWEEP.yaml --out DIR`, `raysb pareto DIR [DIR ...] --out OUT`,
`raysb report RUN_DIR [RUN_DIR ...] --out OUT`, `raysb to-parquet --dataset NAME --out DIR`,
`raysb predict RUN --data-dir SOURCE --out predictions.csv`."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from pathlib import Path

from raysb.config import (
    ConfigError, TrainConfig, merge_overrides, parse_overrides, read_config_file, refuse_unknown_keys,
)
from raysb.core.settings import DataSettings
from raysb.core.strategy_table import STRATEGIES
from raysb.resume import resumed_values
from raysb.version import __version__
from raysb.core.errors import NonFiniteLossError
from raysb.data.unlabelled import SOURCES
from raysb.distributed.cluster import ClusterError
from raysb.training.interrupt import Interrupted, signals_interrupt
from raysb.training.outputs import BEST_MODEL_FILE, OutputWriteError

# Explicit flags: (flag, config key, type, help). Each overrides the config file and --set.
TRAIN_FLAGS = (
    ("--dataset", "dataset", str, "fashion-mnist, mnist, cifar10, cifar100, svhn, parquet, imagefolder "
     "(--data-dir FOLDER with train/CLASS/IMAGE and test/CLASS/IMAGE) or numpy (--data-dir FOLDER with "
     "train.npz and test.npz of images and labels)"),
    ("--data-dir", "data_dir", str, "where dataset files are (or are downloaded to); for parquet also an s3:// "
     "or gs:// URI, its columns named with --set parquet_columns.image=COLUMN (label, sample_id)"),
    ("--model", "model", str, "small-cnn, resnet18, wideresnet, mobilenetv2, densenet, or your own network as "
     "package.module:factory"),
    ("--strategy", "strategy", str, f"{', '.join(STRATEGIES)}, or your own as package.module:CARD"),
    ("--selectivity", "selectivity", float, "expected kept fraction s in (0, 1]; s = 1/(beta+1)"),
    ("--beta", "beta", float, "selection exponent beta >= 0 (alternative to --selectivity)"),
    ("--staleness", "staleness", int, "stale-sb: a selection pass every n-th epoch (default 3)"),
    ("--history-size", "history_size", int, "R, the number of recent losses CDF_R ranks against"),
    ("--prime-epochs", "prime_epochs", int, "plain SGD for the first k epochs"),
    ("--anneal-epochs", "anneal_epochs", int, "plain SGD for the last k epochs"),
    ("--keep-floor", "keep_floor", float, "least keep probability of any example"),
    ("--epochs", "epochs", int, "number of epochs (default: 10, or none beside a --time-budget or --work-budget, "
     "which then ends the run; given with one, whichever comes first ends it)"),
    ("--batch-size", "batch_size", int, "training batch size b, on each worker (default: 128 over --workers, so "
     "any number of workers takes one process's steps at the same --lr)"),
    ("--global-batch-size", "global_batch_size", int,
     "the examples of a step on all workers together: each worker's b is this over --workers"),
    ("--selection-batch-size", "selection_batch_size", int, "examples per selection forward"),
    ("--optimizer", "optimizer", str, "sgd or adam"),
    ("--lr", "lr", float, "base learning rate"),
    ("--lr-schedule", "lr_schedule", str, "cosine, linear, static, step or accelerated"),
    ("--lr-warmup-epochs", "lr_warmup_epochs", float, "ramp the lr up linearly over this many epochs of backprop"),
    ("--lr-schedule-key", "lr_schedule_key", str,
     "auto (work under a --work-budget, time under a --time-budget, else epoch), epoch, backprop "
     "(backpropagated examples), time or work"),
    ("--grad-clip-norm", "grad_clip_norm", float, "clip each step's gradient to this norm"),
    ("--time-budget", "time_budget", float, "stop after this many seconds of training"),
    ("--work-budget", "work_budget", float,
     "stop after this much work, in epochs of training: trained examples plus scored ones at their measured "
     "cost (the same final error under any load)"),
    ("--label-noise", "label_noise", float, "fraction of training labels flipped uniformly"),
    ("--exclude-samples", "exclude_samples", str,
     "leave out of training the sample ids a Parquet or CSV file names (a run's label_suspects.parquet)"),
    ("--subset", "subset", int, "train on a stratified subset of N examples"),
    ("--test-subset", "test_subset", int, "evaluate on a stratified subset of N test examples"),
    ("--image-size", "image_size", int, "resize every image to N x N as it is read, so images of mixed sizes train"),
    ("--seed", "seed", int, "random seed"),
    ("--device", "device", str, "auto, cpu, cuda or cuda:N"),
    ("--precision", "precision", str, "auto (bf16 on a GPU that has it, else fp32), fp32, bf16 or fp16"),
    ("--out", "out", str, "output folder for metrics.parquet, summary.json, config.yaml"),
    ("--workers", "workers", int, "Ray Train workers (0: Ray Train in this process; omit: no Ray)"),
    ("--cpus-per-worker", "cpus_per_worker", float, "CPUs per Ray Train worker (fractions allowed)"),
    ("--gpus-per-worker", "gpus_per_worker", float, "GPUs per Ray Train worker (nccl when > 0)"),
    ("--address", "address", str, "Ray cluster to join (e.g. auto, or HOST:6379); default: start one"),
    ("--storage-path", "storage_path", str, "where Ray Train keeps checkpoints (path, s3:// or gs://)"),
    ("--progress-seconds", "progress_seconds", float, "a progress line inside an epoch every N seconds (0: off)"),
    ("--checkpoint-every", "checkpoint_every", int, "checkpoint every k epochs"),
    ("--max-failures", "max_failures", int, "worker-group restarts from the last checkpoint"),
    ("--placement-timeout", "placement_timeout", float,
     "seconds a worker group may wait for its CPUs/GPUs (at start, after a restart) before the run stops"),
    ("--placement-strategy", "placement_strategy", str,
     "PACK (few nodes), SPREAD (many: a lost node takes fewer workers), STRICT_PACK or STRICT_SPREAD"),
)


# What `raysb to-parquet` and `raysb predict` take with --set: the keys of how their data is read.
TO_PARQUET_KEYS = ("parquet_columns", "image_size")
PREDICT_KEYS = ("parquet_columns",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raysb", description="Selective-Backprop training on Ray")
    parser.add_argument("--version", action="version", version=f"raysb {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train one model")
    train.add_argument("--config", help="YAML file of config keys (see configs/)")
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. --set lr_milestones=[60,120] --set model_options.depth=16",
    )
    defaults = {field.name: field.default for field in dataclasses.fields(TrainConfig)}
    for flag, key, kind, text in TRAIN_FLAGS:
        # The flag's own default stays None, so that a --config file's value is not overridden.
        shown = defaults.get(key)
        train.add_argument(flag, dest=key, type=kind, default=None,
                           help=text if shown in (None, dataclasses.MISSING) else f"{text} (default: {shown})")
    train.add_argument("--lr-milestones", dest="lr_milestones", type=_numbers, default=None,
                       help="comma-separated epochs at which the step schedule decays")
    train.add_argument("--log-to", dest="log_to", default=None,
                       help="comma-separated: tensorboard (OUT/tensorboard), mlflow (MLFLOW_TRACKING_URI)")
    train.add_argument("--download", dest="download", action="store_true", default=None,
                       help="allow torchvision to download a missing dataset")
    train.add_argument("--record-analysis", dest="record_analysis", action="store_true", default=None,
                       help="record what raysb report's figures of the paper need (selection counts, loss CDFs, "
                            "gradient probes, the final model); off by default, as it costs training time")
    train.add_argument("--resume", dest="resume", action="store_true", default=None,
                       help="continue the run in --out from its last checkpoint")
    train.add_argument("--overwrite", dest="overwrite", action="store_true", default=None,
                       help="replace the run in --out (without --resume or this, an --out holding a run is refused)")
    train.add_argument("--verbose", dest="verbose", action="store_true", default=None,
                       help="also show Ray's own console output (worker logs, per-report messages)")
    tune = commands.add_parser("tune", help="run a sweep file with Ray Tune, then its Pareto report")
    tune.add_argument("sweep", metavar="SWEEP.yaml", help="sweep file (see tune_configs/)")
    tune.add_argument("--out", required=True, help="sweep folder; running again with the same --out resumes")
    tune.add_argument("--address", default=None, help="Ray cluster to join (e.g. auto); default: start one")
    tune.add_argument("--targets", type=_multiples, default=None,
                      help="comma-separated multiples m of the best traditional error E (default 1.1,1.2,1.4)")
    export = commands.add_parser("to-parquet", help="write a dataset in the raysb Parquet format (for data_mode=stream)")
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset",
                        help="fashion-mnist, mnist, cifar10, cifar100, svhn, parquet, imagefolder or numpy")
    source.add_argument("--from-folder", metavar="FOLDER",
                        help="an ImageFolder: FOLDER/train/CLASS/IMAGE and FOLDER/test/CLASS/IMAGE "
                             "(same as --dataset imagefolder --data-dir FOLDER)")
    export.add_argument("--data-dir", default=None, help="where the dataset's files are")
    export.add_argument("--out", required=True, help="folder (or s3:// or gs:// URI) for train.parquet and test.parquet")
    export.add_argument("--subset", type=int, default=None, help="a stratified subset of N training examples")
    export.add_argument("--files", type=int, default=1, help="files per split (Ray Data reads them in parallel)")
    export.add_argument("--encoding", default="png", choices=["png", "raw"], help="png: compact; raw: no decoding")
    export.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"how the data is read: {', '.join(TO_PARQUET_KEYS)} (e.g. --set "
                             "parquet_columns.image=pixels --set image_size=32); the files are written under raysb's "
                             "column names and at that size")
    predict = commands.add_parser("predict", help="a trained run's predictions for a folder of images, a Parquet file "
                                                  "or NumPy images, as CSV or Parquet")
    predict.add_argument("run", metavar="RUN", help="the run's --out folder (model.json and its weights)")
    predict.add_argument("--data-dir", required=True, help=f"the images: {SOURCES}")
    predict.add_argument("--out", required=True, help="predictions.csv or predictions.parquet: id, predicted_class and "
                                                      "probability_K for each class K")
    predict.add_argument("--weights", default=BEST_MODEL_FILE, choices=[BEST_MODEL_FILE, "model.pt"],
                         help="the lowest test error's weights (default) or the last epoch's")
    predict.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    predict.add_argument("--batch-size", type=_positive_whole_number, default=256, help="images per forward")
    predict.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help=f"{', '.join(PREDICT_KEYS)}: a Parquet file's own column names, e.g. "
                              "--set parquet_columns.image=pixels")
    pareto = commands.add_parser("pareto", help="Pareto frontier and time-to-target speedups of finished trials")
    pareto.add_argument("dirs", nargs="+", metavar="DIR",
                        help="sweep folder (trials.parquet) or train run folder (metrics.parquet)")
    pareto.add_argument("--out", default=None,
                        help="where to write the report (default, for one DIR: a sweep's folder, a run's DIR/pareto)")
    pareto.add_argument("--targets", type=_multiples, default=None,
                        help="comma-separated multiples m of the best traditional error E (default 1.1,1.2,1.4)")
    report = commands.add_parser("report", help="the paper's figures (PNG + CSV) and report.md from train runs")
    report.add_argument("dirs", nargs="+", metavar="RUN_DIR", help="train run folder (e.g. sweeps/NAME/trials/*)")
    report.add_argument("--out", default=None, help="where to write the report (default: RUN_DIR/report, if only one)")
    return parser


def _numbers(text: str) -> list[float]:
    try:
        return [float(m) for m in text.split(",") if m.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _positive_whole_number(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _multiples(text: str) -> tuple[float, ...]:
    multiples = tuple(_numbers(text))
    if not multiples or any(m <= 0 for m in multiples):
        raise argparse.ArgumentTypeError(f"expected positive multiples such as 1.1,1.2,1.4, got {text!r}")
    return multiples


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    overrides = parse_overrides(args.set)
    # Named as given on the command line, not as the --config file's (checked as the whole merges).
    refuse_unknown_keys(overrides, "command line")
    flags = {key: getattr(args, key) for _, key, _, _ in TRAIN_FLAGS if getattr(args, key) is not None}
    if args.lr_milestones is not None:
        flags["lr_milestones"] = args.lr_milestones
    if args.log_to is not None:
        flags["log_to"] = [name.strip() for name in args.log_to.split(",") if name.strip()]
    for switch in ("download", "record_analysis", "resume", "overwrite", "verbose"):
        if getattr(args, switch):
            flags[switch] = True
    given = merge_overrides(read_config_file(args.config) if args.config else {}, merge_overrides(overrides, flags))
    source = args.config or "command line"
    if given.get("resume"):
        given = resumed_values(given, source)
    return TrainConfig.from_dict(given, source=source)


def reading_settings(assignments: list[str], command: str, allowed: tuple[str, ...], dataset: str,
                     data_dir: str | None) -> DataSettings:
    """How `raysb COMMAND` reads its data: its --set keys, each one of `allowed`, checked as `raysb train`
    checks them."""
    values = parse_overrides(assignments)
    for key in values:
        if key not in allowed:
            guess = difflib.get_close_matches(key, allowed, n=1)
            raise ConfigError(f"raysb {command} --set takes {', '.join(allowed)}, not {key}"
                              + (f" (did you mean {guess[0]}?)" if guess else ""))
    return TrainConfig.from_dict({"dataset": dataset, "data_dir": data_dir, **values}, source="--set").settings().data


def pareto(dirs: list[str], out: str | None, targets: tuple[float, ...] | None) -> None:
    # Imported here so `raysb train` does not load the plotting stack.
    from raysb.analysis.frontier import DEFAULT_TARGETS
    from raysb.analysis.report import write_pareto_report
    from raysb.analysis.results import load_trials

    if out is None and len(dirs) > 1:
        raise ValueError("several DIRs need --out to say where the report goes")
    # A run folder holds its run's files alone (raysb train refuses an --out with others): its report
    # goes beside them, as raysb report's does. A sweep's report is the sweep's own.
    single = Path(dirs[0])
    out_dir = Path(out) if out else single / "pareto" if (single / "metrics.parquet").is_file() else single
    written = write_pareto_report(load_trials(dirs), out_dir, targets or DEFAULT_TARGETS)
    print(written["speedups.md"].read_text())
    print(f"wrote {', '.join(written)} to {out_dir}")


def report(dirs: list[str], out: str | None) -> None:
    # Imported here so `raysb train` does not load the plotting stack.
    from raysb.analysis.run_report import REPORT_FILE, write_run_report

    if out is None and len(dirs) > 1:
        raise ValueError("several RUN_DIRs need --out to say where the report goes")
    out_dir = Path(out) if out is not None else Path(dirs[0]) / "report"
    result = write_run_report(dirs, out_dir)
    for title, reason in result.skipped.items():
        print(f"skipped {title}: {reason}")
    for warning in result.warnings:
        print(warning)
    figures = [name for name in result.written if name.endswith(".png")]
    print(f"wrote {REPORT_FILE} and {len(figures)} figure(s) with their CSV data to {out_dir}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            with signals_interrupt():
                from raysb.api import train

                result = train(config_from_args(args))
            if result.summary["status"] == "diverged":
                print(f"raysb: training stopped: {result.summary['error']}", file=sys.stderr)
                return 1
        elif args.command == "tune":
            from raysb.tune.sweep import load_sweep
            from raysb.tune.tuner import run_sweep

            out = run_sweep(load_sweep(args.sweep), args.out, args.address)
            pareto([str(out)], None, args.targets)
        elif args.command == "to-parquet":
            from raysb.data.export import export_parquet

            if args.from_folder is not None:
                args.dataset, args.data_dir = "imagefolder", args.from_folder
            data = reading_settings(args.set, "to-parquet", TO_PARQUET_KEYS, args.dataset, args.data_dir)
            written = export_parquet(args.dataset, args.out, args.data_dir, args.subset, args.files, args.encoding,
                                     parquet_columns=data.parquet_columns, image_size=data.image_size)
            print(f"wrote {len(written)} Parquet file(s) under {args.out}")
        elif args.command == "predict":
            from raysb.predict import predict

            # The columns are checked as a Parquet dataset's are; a folder of images or arrays has none.
            data = reading_settings(args.set, "predict", PREDICT_KEYS, "parquet", args.data_dir)
            count = predict(args.run, args.data_dir, args.out, args.weights, args.device, args.batch_size,
                            data.parquet_columns)
            print(f"wrote {count:,} predictions to {args.out}")
        elif args.command == "pareto":
            pareto(args.dirs, args.out, args.targets)
        elif args.command == "report":
            report(args.dirs, args.out)
    except (ConfigError, ClusterError) as error:
        print(f"raysb: error: {error}", file=sys.stderr)
        return 2
    except (NonFiniteLossError, OutputWriteError) as error:
        print(f"raysb: training stopped: {error}", file=sys.stderr)
        return 1
    except Interrupted as stop:
        print(stop.line, file=sys.stderr)
        return stop.exit_status
    except ValueError as error:
        print(f"raysb: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
