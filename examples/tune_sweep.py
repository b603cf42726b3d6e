"""A Ray Tune sweep over Selective-Backprop's beta and staleness n, in your own trainable.

Each trial trains a user-defined MLP on Fashion-MNIST (pooled to 14x14) with SB at one
(beta, n): n = 1 selects every epoch (SB), n > 1 selects every n-th epoch and reuses the
recorded losses in between (Stale-SB). It reports SelectiveBackprop's counters and time
split every epoch; the sweep ends with each trial's error, its training seconds and the
trials on the time-vs-error Pareto frontier.

    python examples/tune_sweep.py                    # beta 1 and 3, n = 1 and 2: 4 trials
    python examples/tune_sweep.py --betas 1 2 3 --staleness 1 3 --epochs 4 --subset 20000

The console shows the sweep's table alone; Ray's worker output and Tune's own tables stay in
Ray's log files unless --verbose.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from ray import tune

from raysb import SelectiveBackprop, connect_ray
from raysb.data import load_dataset, stratified_subset


def pooled(images: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(images.float() / 255, 2).flatten(1)


def per_example_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch["pixels"]), batch["label"], reduction="none")


def trainable(config: dict) -> None:
    torch.set_num_threads(1)
    train = stratified_subset(load_dataset("fashion-mnist", "train", config["data_dir"]), config["subset"], seed=0)
    test = load_dataset("fashion-mnist", "test", config["data_dir"])
    pixels, test_pixels = pooled(train.images), pooled(test.images)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(196, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    n = config["staleness"]
    sb = SelectiveBackprop(per_example_loss, batch_size=64, beta=config["beta"],
                           strategy="sb" if n == 1 else "stale-sb", staleness=n, id_column="id")
    for epoch in range(config["epochs"]):
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(epoch))
        batches = ({"pixels": pixels[rows], "label": train.labels[rows], "id": train.sample_ids[rows]}
                   for rows in order.split(512))
        for batch in sb.batches(model, batches):
            loss = sb.loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            error = float((model(test_pixels).argmax(1) != test.labels).float().mean())
        tune.report({"test_error": error, **sb.metrics()})


def pareto(rows: list[dict]) -> list[dict]:
    """The trials no other trial beats on both training seconds and error."""
    frontier, best = [], float("inf")
    for row in sorted(rows, key=lambda r: (r["wall_s"], r["test_error"])):
        if row["test_error"] < best:
            frontier.append(row)
            best = row["test_error"]
    return frontier


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--betas", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--subset", type=int, default=4000)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", default="runs/sweep")
    parser.add_argument("--verbose", action="store_true", help="also show Ray's worker output and Tune's tables")
    args = parser.parse_args(argv)
    connect_ray(None, log_to_driver=args.verbose)  # RAY_ADDRESS's cluster, else a private local one
    if not args.verbose:
        # Tune's older console output keeps quiet at verbose=0; the newer one prints the experiment's
        # table, folder and TensorBoard command even there, and no RunConfig field picks the older.
        os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": 1}),
        param_space={
            "beta": tune.grid_search(args.betas),
            "staleness": tune.grid_search(args.staleness),
            "epochs": args.epochs,
            "subset": args.subset,
            "data_dir": args.data_dir,
        },
        tune_config=tune.TuneConfig(metric="test_error", mode="min"),
        run_config=tune.RunConfig(storage_path=str(Path(args.out).resolve()), name="sb-sweep", verbose=0),
    )
    results = tuner.fit()
    if results.errors:
        raise RuntimeError(f"{len(results.errors)} trial(s) failed; the first: {results.errors[0]}")
    rows = [{"beta": r.config["beta"], "staleness": r.config["staleness"], **r.metrics} for r in results]
    on_frontier = {id(row) for row in pareto(rows)}
    print(f"{'beta':>5} {'n':>3} {'test error':>10} {'backprop':>9} {'scored':>8} {'train s':>8}  Pareto")
    for row in sorted(rows, key=lambda r: (r["beta"], r["staleness"])):
        print(f"{row['beta']:>5g} {row['staleness']:>3} {row['test_error']:>10.2%} {row['backprop_examples']:>9} "
              f"{row['selection_forward_examples']:>8} {row['wall_s']:>8.1f}  {'*' if id(row) in on_frontier else ''}")
    return rows


if __name__ == "__main__":
    main()
