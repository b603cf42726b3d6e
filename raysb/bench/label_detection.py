"""How well raysb's label-doubt detector finds flipped labels, against cleanlab's confident learning,
each with the training work it took:

    python -m raysb.bench.label_detection --runs runs/noise/free-sb-probe [more run folders] \\
        [--folds 5] [--fold-epochs 5] --out runs/label-detection

Each run folder (`raysb train ... --out DIR`, or a run of `python -m raysb.bench --budgets ...`) was
trained with label noise, so its summary.json names the sample ids whose labels the noise flipped:
the truth. Its label_suspects.parquet holds the examples the run doubts (raysb.training.label_suspects),
scored against that truth by precision, recall and F1; its estimated share of wrong labels
(summary.json's suspected_label_share) stands beside the true share. Its work is what the run trained,
in epochs of its training set (a free-sb run does no forward beyond its training ones).

Once per data config (dataset, subset, label noise, seed, ...) of the runs given, cleanlab
(`cleanlab.filter.find_label_issues`, default filter_by) is given out-of-sample probabilities from a
stratified K-fold: for each fold, raysb's own trainer (strategy traditional, the run's model, lr,
schedule, batch size and weight decay) trains a fresh model on the other K-1 folds for --fold-epochs
epochs, which then predicts softmax probabilities on the held-out fold. Its estimated share of wrong
labels is `cleanlab.count.num_label_issues` (off-diagonal of the confident joint) over the examples.
Its work: the examples the K fold models trained on, (K-1) * fold_epochs epochs, plus one forward over
the data, a forward counted as FORWARD_COST (1/3) of a trained example (forward + backward), as the
report says. Each fold's probabilities are kept under OUT/cleanlab-<key>/, so a rerun does not train
again.

Writes OUT/label_detection.md (the table and the command line), OUT/label_detection.csv, and prints
the markdown.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from raysb.bench.reports import write_report
from raysb.config import SECTIONS, TrainConfig
from raysb.core.config_keys import record_keys
from raysb.core.work_units import work_epochs
from raysb.data.dataset import ImageDataset
from raysb.training.label_suspects import SUSPECTS_FILE

SUMMARY_FILE = "summary.json"
REPORT_NAME = "label_detection.md"
CSV_NAME = "label_detection.csv"
# A forward pass's cost in trained examples (a forward and a backward, the backward about twice the forward).
FORWARD_COST = 1 / 3
# The fold split's stream of the run's seed: the data order is seed itself, the label noise seed + 6
# (raysb.data.prepare); a stream of its own, so folds are not the noise's or the first epoch's order.
FOLD_SEED_OFFSET = 7
# The keys that make a run's data: runs differing only in other keys share one cleanlab measurement.
DATA_KEYS = ("dataset", "data_dir", "image_size", "subset", "label_noise", "exclude_samples", "seed")
COLUMNS = ("method", "run", "noise", "precision", "recall", "f1", "flagged", "estimated_share", "true_share",
           "work_epochs")


# -- pure parts ---------------------------------------------------------------------------------------
def detection_scores(flagged: Iterable[int] | torch.Tensor, truth: Iterable[int] | torch.Tensor) -> dict[str, float]:
    """Precision, recall and F1 of the `flagged` ids against the `truth` ids (each a set of ids, any
    iterable or tensor of them); NaN where undefined (precision with nothing flagged, recall with no
    truth, F1 with neither)."""
    flagged, truth = _id_set(flagged), _id_set(truth)
    hits = len(flagged & truth)
    return {
        "precision": hits / len(flagged) if flagged else math.nan,
        "recall": hits / len(truth) if truth else math.nan,
        "f1": 2 * hits / (len(flagged) + len(truth)) if flagged or truth else math.nan,
        "flagged": len(flagged),
    }


def _id_set(ids: Iterable[int] | torch.Tensor) -> set[int]:
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        ids = ids.tolist()
    return {int(each) for each in ids}


def stratified_folds(labels: torch.Tensor, folds: int, seed: int) -> torch.Tensor:
    """Each example's fold (0..folds-1), drawn from `seed`: every class's examples dealt round the folds
    in a random order, each class starting where the last left off, so that each fold holds within one
    of every class's 1/folds share and the folds' sizes are within one of each other."""
    if folds < 2:
        raise ValueError(f"folds must be at least 2, got {folds}")
    generator = torch.Generator().manual_seed(seed)
    labels = labels.cpu()
    assignment = torch.empty(len(labels), dtype=torch.int64)
    dealt = 0
    for label in torch.unique(labels).tolist():
        members = torch.nonzero(labels == label).squeeze(1)
        members = members[torch.randperm(len(members), generator=generator)]
        assignment[members] = (dealt + torch.arange(len(members))) % folds
        dealt += len(members)
    return assignment


def cleanlab_work_epochs(trained_examples: int, examples: int) -> float:
    """The K-fold's work in epochs of `examples`: what its fold models trained, plus one forward over
    the data at FORWARD_COST."""
    return work_epochs(trained_examples, examples, FORWARD_COST, 1, examples)


def run_work_epochs(summary: dict) -> float:
    """A run's work in epochs of its training set: the examples it trained (a side model's too), and any
    forward beyond its training ones (selection scoring, a side model's) at FORWARD_COST; a free-sb run
    has none of those."""
    trained = summary["backprop_examples"] + summary.get("side_trained_examples", 0)
    forwards = summary.get("selection_forward_examples", 0) + summary.get("side_forward_examples", 0)
    # The run's counts are summed over its ranks already: one rank's worth of world size.
    return work_epochs(trained, forwards, FORWARD_COST, 1, summary["train_examples"])


def data_key(config: dict) -> tuple:
    """What makes a run's data: runs with one key share one cleanlab measurement."""
    return tuple((key, json.dumps(config.get(key), sort_keys=True)) for key in DATA_KEYS)


def fold_config(config: dict, fold_epochs: int, device: str | None = None) -> dict:
    """The config a fold model trains with: the run's data, model, optimization and seed, as
    Traditional for `fold_epochs` epochs with the schedule over those epochs (no budget), in this
    process, writing nothing; every key resolved as TrainConfig holds it."""
    keep = {key.name for name in ("data", "model", "optimization") for key in record_keys(SECTIONS[name])}
    keep |= {"seed", "device", "eval_batch_size"}
    values = {key: value for key, value in config.items() if key in keep}
    values.update(strategy="traditional", epochs=fold_epochs, time_budget=None, work_budget=None,
                  lr_schedule_key="auto", data_mode="memory", progress_seconds=0, record_analysis=False)
    if device is not None:
        values["device"] = device
    # Resolved, every key present: a run written before a key existed keys the same cache as one after.
    resolved = TrainConfig.from_dict(values, source="fold config").to_dict()
    return {key: resolved[key] for key in sorted(keep | set(values))}


def cache_key(values: dict, folds: int) -> str:
    """A folder name for the K-fold of `values` (fold_config's): readable, and a hash of every key but
    the device (the same recipe wherever it trains)."""
    recipe = {key: value for key, value in values.items() if key != "device"}
    digest = hashlib.sha256(json.dumps([recipe, folds], sort_keys=True, default=str).encode()).hexdigest()[:10]
    subset = values.get("subset") or "all"
    return (f"{values['dataset']}-{subset}-noise{values.get('label_noise', 0):g}-seed{values.get('seed', 0)}"
            f"-k{folds}-e{values['epochs']}-{digest}")


# -- a run's detector ---------------------------------------------------------------------------------
@dataclass
class Run:
    folder: Path
    summary: dict
    suspect_ids: list[int]

    @property
    def config(self) -> dict:
        return self.summary["config"]


def read_run(folder: Path) -> Run:
    """A run folder's summary and suspects; SystemExit naming what is missing."""
    folder = Path(folder)
    for name in (SUMMARY_FILE, SUSPECTS_FILE):
        if not (folder / name).is_file():
            hint = (" (a free-sb or InfoBatch run writes it as it ends)"
                    if name == SUSPECTS_FILE else " (not a finished raysb run folder?)")
            raise SystemExit(f"raysb.bench.label_detection: {folder} has no {name}{hint}")
    summary = json.loads((folder / SUMMARY_FILE).read_text())
    missing = [key for key in ("config", "label_noise_flipped_ids", "backprop_examples", "train_examples")
               if key not in summary]
    if missing:
        raise SystemExit(f"raysb.bench.label_detection: {folder / SUMMARY_FILE} lacks {', '.join(missing)}")
    suspects = pq.read_table(folder / SUSPECTS_FILE, columns=["sample_id"]).column("sample_id").to_pylist()
    return Run(folder, summary, suspects)


def run_row(run: Run) -> dict[str, Any]:
    """A run's detector scored against its flipped labels."""
    config, summary = run.config, run.summary
    truth = summary["label_noise_flipped_ids"]
    doubt = config.get("label_doubt") or config.get("strategy_options", {}).get("label_doubt")
    method = f"raysb {config['strategy']}" + (f", label_doubt {doubt}" if doubt else "")
    share = summary.get("suspected_label_share")
    return {
        "method": method,
        "run": str(run.folder),
        "noise": config.get("label_noise", 0.0),
        **detection_scores(run.suspect_ids, truth),
        "estimated_share": math.nan if share is None else float(share),
        "true_share": len(truth) / summary["train_examples"],
        "work_epochs": run_work_epochs(summary),
    }


# -- cleanlab on K-fold out-of-sample probabilities -------------------------------------------------------
def fold_probabilities(values: dict, train_data: ImageDataset, held_out: ImageDataset) -> tuple[np.ndarray, int]:
    """Softmax probabilities on `held_out` of a model raysb's trainer trains on `train_data` as `values`
    (fold_config's) says, and the examples it trained."""
    from raysb.data.prepare import to_device
    from raysb.data.shards import MemoryShard
    from raysb.training.builders import build_engine, resolve_device

    config = TrainConfig.from_dict(values, source="fold config")
    settings = config.settings()
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)  # the model's initial weights, as a run draws them (raysb.api)
    engine = build_engine(settings, MemoryShard(to_device(train_data, device)), device)
    for epoch in range(config.epochs):
        engine.train_epoch(epoch)
    with torch.inference_mode():
        probabilities = [logits.softmax(1).cpu()
                         for logits, _ in engine.evaluation.logits(held_out, config.eval_batch_size)]
    return torch.cat(probabilities).double().numpy(), int(engine.counters.backprop_examples)


def out_of_sample_probabilities(values: dict, data: ImageDataset, folds: int, cache: Path,
                                log=print) -> tuple[np.ndarray, int]:
    """Every example's probabilities from the fold model that did not train on it, and the examples the
    fold models trained; each fold kept in `cache` (fold-<i>.npz) and reused when there."""
    cache.mkdir(parents=True, exist_ok=True)
    assignment = stratified_folds(data.labels, folds, values.get("seed", 0) + FOLD_SEED_OFFSET)
    probabilities = np.zeros((len(data), data.num_classes))
    trained = 0
    for fold in range(folds):
        held = torch.nonzero(assignment == fold).squeeze(1)
        path = cache / f"fold-{fold}.npz"
        if path.is_file():
            kept = np.load(path)
            if not np.array_equal(kept["index"], held.numpy()):
                raise SystemExit(f"raysb.bench.label_detection: {path} holds another split; delete {cache}")
            fold_probs, fold_trained = kept["probabilities"], int(kept["trained"])
        else:
            log(f"label_detection: fold {fold + 1}/{folds}: training on {len(data) - len(held):,} examples "
                f"for {values['epochs']} epochs")
            fold_probs, fold_trained = fold_probabilities(values, data.select(assignment != fold), data.select(held))
            partial = cache / f"fold-{fold}.tmp.npz"
            np.savez(partial, index=held.numpy(), probabilities=fold_probs, trained=fold_trained)
            partial.replace(path)
        probabilities[held.numpy()] = fold_probs
        trained += fold_trained
    np.save(cache / "pred_probs.npy", probabilities)
    return probabilities, trained


def cleanlab_row(run: Run, folds: int, fold_epochs: int, out: Path, device: str | None, log=print) -> dict[str, Any]:
    """cleanlab's confident learning on the data of `run`'s config, scored against its flipped labels."""
    try:
        from cleanlab.count import num_label_issues
        from cleanlab.filter import find_label_issues
    except ImportError:
        raise SystemExit("raysb.bench.label_detection needs cleanlab: pip install 'cleanlab>=2.9,<3' "
                         "(raysb's dev extra has it)") from None

    from raysb.data.prepare import prepare_data

    values = fold_config(run.config, fold_epochs, device)
    config = TrainConfig.from_dict(values, source="fold config")
    data, _, flipped = prepare_data(config.settings().data, config.batch_size)
    if sorted(flipped.tolist()) != sorted(run.summary["label_noise_flipped_ids"]):
        raise SystemExit(f"raysb.bench.label_detection: the data prepared from {run.folder}'s config flips other "
                         "labels than the run did (another raysb version, or changed data?)")
    cache = out / f"cleanlab-{cache_key(values, folds)}"
    probabilities, trained = out_of_sample_probabilities(values, data, folds, cache, log)
    labels = data.labels.cpu().numpy()
    issues = find_label_issues(labels, probabilities, n_jobs=1)
    estimated = num_label_issues(labels, probabilities)
    epochs = f"{fold_epochs} epoch" + ("s" if fold_epochs != 1 else "")
    return {
        "method": f"cleanlab find_label_issues ({folds}-fold, {epochs} each)",
        "run": str(cache),
        "noise": run.config.get("label_noise", 0.0),
        **detection_scores(data.sample_ids[torch.from_numpy(issues)], flipped),
        "estimated_share": estimated / len(data),
        "true_share": len(flipped) / len(data),
        "work_epochs": cleanlab_work_epochs(trained, len(data)),
    }


# -- the report ---------------------------------------------------------------------------------------
def _number(value: float, percent: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.1%}" if percent else f"{value:.3f}"


def report_lines(rows: list[dict], command: str) -> list[str]:
    lines = [
        "| method | run | noise | precision | recall | F1 | flagged | estimated share | true share | work (epochs) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['run']} | {_number(row['noise'], True)} | {_number(row['precision'])} "
            f"| {_number(row['recall'])} | {_number(row['f1'])} | {row['flagged']:,} "
            f"| {_number(row['estimated_share'], True)} | {_number(row['true_share'], True)} "
            f"| {row['work_epochs']:.2f} |"
        )
    return lines + [
        "",
        "Precision, recall and F1 of the flagged examples against those whose labels the run's label noise "
        "flipped. Work in epochs of the training set: what was trained (forward and backward); a forward "
        f"alone counts {FORWARD_COST:.2f} of a trained example (cleanlab: K fold models on K-1 folds each, "
        "plus one forward over the data for the out-of-sample probabilities, counted so). raysb's estimated "
        "share is summary.json's suspected_label_share; cleanlab's is cleanlab.count.num_label_issues over "
        "the examples.",
        "",
        f"`{command}`",
    ]


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({key: row[key] for key in COLUMNS} for row in rows)


def measure(folders: list[Path], folds: int, fold_epochs: int, out: Path, device: str | None = None,
            log=print) -> list[dict]:
    """Each run's row, and after each data config's runs, cleanlab's row on that data."""
    runs = [read_run(folder) for folder in folders]
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault(data_key(run.config), []).append(run)
    rows = []
    for group in groups.values():
        rows += [run_row(run) for run in group]
        rows.append(cleanlab_row(group[0], folds, fold_epochs, out, device, log))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raysb.bench.label_detection", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, type=Path, metavar="DIR",
                        help="run folders trained with label noise (summary.json and label_suspects.parquet)")
    parser.add_argument("--folds", type=int, default=5, help="K of cleanlab's stratified K-fold (default 5)")
    parser.add_argument("--fold-epochs", type=int, default=5,
                        help="epochs each fold model trains, Traditional's recipe (default 5)")
    parser.add_argument("--device", default=None, help="where the fold models train (default: the run's device)")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    if args.folds < 2 or args.fold_epochs < 1:
        parser.error("--folds must be at least 2 and --fold-epochs at least 1")
    rows = measure(args.runs, args.folds, args.fold_epochs, args.out, args.device,
                   log=lambda line: print(line, file=sys.stderr))
    command = "python -m raysb.bench.label_detection " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / CSV_NAME, rows)
    return write_report(args.out, report_lines(rows, command.strip()), name=REPORT_NAME)


if __name__ == "__main__":
    raise SystemExit(main())
