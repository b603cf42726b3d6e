"""Fault soak: kill workers at random points, and check every resumed run against the
uninterrupted one.

    python -m raysb.bench.soak --runs 20 --out runs/soak

Each run draws a strategy (sb, stale-sb, kath18), a data mode (memory,
stream) and one or more faults (`raysb.distributed.chaos`): a worker killed before a
random round of a random epoch or while a checkpoint is written, each
optionally waiting until the previous
checkpoint is committed. The run restarts as often as it has faults
(`max_failures`) and must end identical to the uninterrupted run of the same
strategy and data mode: every counter and per-rank counter, the final test
error, every metrics row (times aside) and every trace file. One line per
run, a total at the end; the exit status is 1 if any run differed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from raysb.api import train
from raysb.chaos_spec import parse_chaos
from raysb.config import TrainConfig
from raysb.data import load_dataset, stratified_subset, write_parquet
from raysb.distributed.chaos import committed_epoch

STRATEGIES = ("sb", "stale-sb", "kath18")
DATA_MODES = ("memory", "stream")
# Each run: a Fashion-MNIST subset small enough for many runs in an hour.
TRAIN_EXAMPLES, TEST_EXAMPLES = 2000, 500
SUMMARY_KEYS = (
    "status", "final_test_error", "best_test_error", "epochs_completed", "examples_considered", "examples_kept",
    "backprop_examples", "train_forward_examples", "selection_forward_examples", "optimizer_steps",
    "per_rank_optimizer_steps", "per_rank_kept", "per_rank_backprop_examples", "per_rank_selection_forward_examples",
    "unused_kept_examples", "lockstep_rounds", "per_rank_cdf_checksum",
)
TRACE_FILES = ("selection_counts", "tracked_examples", "loss_cdf", "gradient_similarity")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raysb.bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="draws the runs (the runs' own seed is fixed)")
    parser.add_argument("--out", default="runs/soak")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-faults", type=int, default=2, help="faults per run: 1 to this many")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--data-modes", default=",".join(DATA_MODES))
    args = parser.parse_args(argv)

    import ray

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=256 * 1024**2, log_to_driver=False)
    data_dir = _streamed_data(out / "data")
    draw = random.Random(args.seed)
    strategies, modes = args.strategies.split(","), args.data_modes.split(",")
    references: dict[tuple[str, str], dict] = {}
    identical = 0
    started = time.time()
    for index in range(args.runs):
        strategy, mode = draw.choice(strategies), draw.choice(modes)
        base = _base_config(strategy, mode, args.epochs, data_dir)
        if (strategy, mode) not in references:
            references[(strategy, mode)] = _outcome(train(_with(base, out / f"reference-{strategy}-{mode}"), _quiet))
        faults = _draw_faults(draw, base, draw.randint(1, args.max_faults))
        folder = out / f"run-{index:03d}"
        clock = time.time()
        try:
            result = _outcome(train(_with(base, folder, chaos=",".join(faults), max_failures=len(faults)), _quiet))
            differences = _differences(references[(strategy, mode)], result)
        except Exception as error:  # a run that fails outright is reported, not fatal to the soak
            result, differences = {}, [f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"]
        identical += not differences
        resumed = result.get("summary", {}).get("resumed_from_epoch", "-")
        print(
            f"run {index + 1:>3}/{args.runs}  {strategy:<8} {mode:<6} {','.join(faults):<60} "
            f"resumed from epoch {resumed}  {time.time() - clock:5.1f}s  "
            + ("identical" if not differences else "DIFFERS: " + "; ".join(differences)),
            flush=True,
        )
    print(f"soak: {identical} of {args.runs} runs identical to the uninterrupted run "
          f"({args.runs - identical} differ) in {time.time() - started:.0f}s", flush=True)
    return 0 if identical == args.runs else 1


def _base_config(strategy: str, mode: str, epochs: int, data_dir: Path) -> TrainConfig:
    values = dict(
        strategy=strategy, epochs=epochs, batch_size=32, lr=0.05, model_options={"width": 8},
        workers=2, cpus_per_worker=0.5 if mode == "stream" else 1, checkpoint_every=1,
    )
    if strategy == "stale-sb":
        values["staleness"] = 2
    if mode == "stream":
        values.update(dataset="parquet", data_dir=str(data_dir), data_mode="stream")
    else:
        values.update(dataset="fashion-mnist", subset=TRAIN_EXAMPLES, test_subset=TEST_EXAMPLES)
    return TrainConfig.from_dict(values)


def _with(config: TrainConfig, out: Path, **overrides) -> TrainConfig:
    return TrainConfig.from_dict({**config.to_dict(), "out": str(out), **overrides})


def _draw_faults(draw: random.Random, config: TrainConfig, count: int) -> list[str]:
    """`count` faults at distinct random points (a point fires once; two at one point would be one)."""
    per_rank = TRAIN_EXAMPLES // config.workers
    rounds = -(-per_rank // config.selection_spec().chunk_size)
    faults: list[str] = []
    while len(faults) < count:
        epoch = draw.randint(1, config.epochs)
        rank = draw.randrange(config.workers)
        if draw.random() < 1 / 3:
            fault = f"kill-worker@{epoch}:checkpoint:rank{rank}"
        else:
            fault = f"kill-worker@{epoch}:{draw.randrange(rounds)}:rank{rank}"
        if epoch > 1 and draw.random() < 0.5:
            fault += ":committed"
        if _point(fault) not in {_point(taken) for taken in faults}:
            faults.append(fault)
    return faults


def _point(fault: str) -> tuple:
    """Where a fault fires: its epoch and round, or its epoch's checkpoint."""
    (event,) = parse_chaos(fault)
    return event.epoch, event.round, event.at_checkpoint


def _outcome(result) -> dict:
    folder = Path(result.out_dir)
    summary = json.loads((folder / "summary.json").read_text())
    rows = pq.read_table(folder / "metrics.parquet").to_pylist()
    return {
        "summary": summary,
        "rows": [{k: v for k, v in row.items() if not (k.startswith("time_") or k == "wall_s")} for row in rows],
        "traces": {name: pq.read_table(folder / f"{name}.parquet") for name in TRACE_FILES
                   if (folder / f"{name}.parquet").exists()},
        "committed_epoch": committed_epoch(folder),
    }


def _differences(reference: dict, run: dict) -> list[str]:
    found = [
        f"{key} {run['summary'].get(key)} vs {reference['summary'].get(key)}"
        for key in SUMMARY_KEYS
        if run["summary"].get(key) != reference["summary"].get(key)
    ]
    if run["rows"] != reference["rows"]:
        epochs = [a["epoch"] for a, b in zip(run["rows"], reference["rows"]) if a != b]
        found.append(f"metrics rows differ (epochs {epochs or 'count'})")
    for name, table in reference["traces"].items():
        if name not in run["traces"] or not run["traces"][name].equals(table):
            found.append(f"trace {name} differs")
    return found


def _streamed_data(folder: Path) -> Path:
    """The same Fashion-MNIST examples as the memory runs, as PNG Parquet in two files per split."""
    if (folder / "test.parquet").exists():
        return folder
    for split, size in (("train", TRAIN_EXAMPLES), ("test", TEST_EXAMPLES)):
        data = stratified_subset(load_dataset("fashion-mnist", split), size, seed=0)
        for part, rows in enumerate(torch.arange(size).chunk(2)):
            write_parquet(data.select(rows), str(folder / f"{split}.parquet" / f"part-{part}.parquet"))
    return folder


def _quiet(line: str) -> None:
    pass


if __name__ == "__main__":
    sys.exit(main())
