"""Selective-Backprop in your own Ray Train loop: an MLP regressor on a tabular data set.

The data is scikit-learn's diabetes table (442 patients, 10 features, a disease-progression
target), written to Parquet and read back through Ray Data, as a table of your own would be.
The model, the per-example Huber loss and the columns are all the user's; raysb only decides
which examples get a backward pass and keeps the 2 workers' steps in lockstep.

    python examples/tabular_ray_train.py --workers 2 --out runs/tabular

(Ray Data reads the Parquet file in tasks of its own, which need a CPU the workers leave
free: the default 0.5 CPU per worker does on a 2-core machine, and too many CPUs per worker
is refused at once by raysb's `check_worker_resources` instead of hanging at 0 rows.)

Rank 0's lines reach this console through raysb's relay, as `raysb train --workers` sends its
own; Ray's worker output (Ray Data's progress bars, Ray Train's reports) stays in Ray's log
files unless --verbose.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray
import ray.train
import ray.train.torch
import torch
import torch.nn.functional as F
from ray.train.torch import TorchConfig, TorchTrainer

from raysb import ClusterError, SelectiveBackprop, check_worker_resources, connect_ray, relayed_console, relayed_log

FEATURES = ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"]


def write_tables(folder: Path) -> tuple[Path, Path, float, float]:
    """The diabetes table as train/test Parquet files (target standardized), plus the target's scale."""
    from sklearn.datasets import load_diabetes

    frame = load_diabetes(as_frame=True).frame
    frame["patient"] = range(len(frame))
    test = frame.sample(frac=0.2, random_state=0)
    train = frame.drop(test.index)
    mean, std = float(train.target.mean()), float(train.target.std())
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, part in (("train", train), ("test", test)):
        part = part.assign(target=(part.target - mean) / std).astype({c: "float32" for c in FEATURES + ["target"]})
        path = folder / f"{name}.parquet"
        pq.write_table(pa.Table.from_pandas(part, preserve_index=False), path)
        paths.append(path)
    return paths[0], paths[1], mean, std


def regressor() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(len(FEATURES), 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def huber_per_patient(model: torch.nn.Module, batch) -> torch.Tensor:
    features = torch.stack([batch[name] for name in FEATURES], dim=1)
    return F.huber_loss(model(features).squeeze(1), batch["target"], reduction="none", delta=1.0)


def train_loop(config: dict) -> None:
    rank = ray.train.get_context().get_world_rank()
    log = relayed_log(config["console"])
    model = ray.train.torch.prepare_model(regressor())
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    sb = SelectiveBackprop(
        huber_per_patient, batch_size=config["batch_size"], beta=config["beta"],
        strategy=config["strategy"], id_column="patient",
        # n is Stale-SB's alone: SelectiveBackprop refuses it for the others, as `raysb train` does.
        staleness=config["staleness"] if config["strategy"] == "stale-sb" else None,
    )
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / "model.pt", weights_only=False)
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            sb.load_state_dict(torch.load(Path(folder) / f"selection-{rank}.pt", weights_only=False))
            start = state["epoch"]

    test = pq.read_table(config["test"]).to_pandas()
    test_batch = {name: torch.tensor(test[name].to_numpy()) for name in FEATURES + ["target"]}
    shard = ray.train.get_dataset_shard("train")
    for epoch in range(start, config["epochs"]):
        batches = shard.iter_torch_batches(batch_size=64, local_shuffle_buffer_size=128, local_shuffle_seed=epoch)
        for batch in sb.batches(model, batches):
            loss = sb.loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            model.eval()
            errors = model(torch.stack([test_batch[n] for n in FEATURES], 1)).squeeze(1) - test_batch["target"]
        metrics = {"epoch": epoch + 1, "test_rmse": float(errors.pow(2).mean().sqrt()) * config["target_std"],
                   **sb.metrics()}
        with tempfile.TemporaryDirectory() as folder:
            # Every rank saves its own selection state; Ray Train merges the files into one checkpoint.
            torch.save(sb.state_dict(), Path(folder) / f"selection-{rank}.pt")
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch + 1}, Path(folder) / "model.pt")
                if (epoch + 1) % config["print_every"] == 0 or epoch + 1 == config["epochs"]:
                    log(f"epoch {epoch + 1:>3}  test RMSE {metrics['test_rmse']:6.2f}  "
                        f"kept {metrics['kept_fraction']:.0%}  steps {metrics['optimizer_steps']}  "
                        f"backprop {metrics['backprop_examples']}  selection {metrics['time_selection_s']:.2f}s")
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--beta", type=float, default=1.0, help="selectivity 1 / (beta + 1); 1 keeps half")
    parser.add_argument("--strategy", default="sb", choices=["sb", "stale-sb", "traditional"])
    parser.add_argument("--staleness", type=int, default=2, help="stale-sb's n: a selection pass every n-th epoch")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--print-every", type=int, default=5)
    parser.add_argument("--out", default="runs/tabular")
    parser.add_argument("--verbose", action="store_true", help="also show Ray's own worker output")
    args = parser.parse_args(argv)

    out = Path(args.out).resolve()
    train_path, test_path, _, target_std = write_tables(out / "data")
    # Joins RAY_ADDRESS's cluster (as under `ray job submit`), else starts a private local one;
    # unlike a bare ray.init(), never waits on a cluster that a stale /tmp/ray file names.
    connect_ray(None, log_to_driver=args.verbose)
    check_worker_resources(args.workers, args.cpus_per_worker, reads_ray_data=True)
    with relayed_console(print) as console:
        result = fit(args, console, out, train_path, test_path, target_std)
    print(f"final test RMSE {result.metrics['test_rmse']:.2f} (target std {target_std:.1f}); "
          f"{result.metrics['backprop_examples']} of {result.metrics['examples_considered']} examples "
          "backpropagated on rank 0")
    return result.metrics


def fit(args: argparse.Namespace, console, out: Path, train_path: Path, test_path: Path,
        target_std: float) -> ray.train.Result:
    """The Ray Train run; rank 0 sends its lines to `console`, which prints them here."""
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "epochs": args.epochs, "batch_size": args.batch_size, "beta": args.beta, "lr": args.lr,
            "strategy": args.strategy, "staleness": args.staleness, "test": str(test_path),
            "target_std": target_std, "print_every": args.print_every, "console": console,
        },
        # Read once into Ray's object store, a table this small: every epoch then streams its blocks
        # from memory instead of reading the file again, which cost about 6 s an epoch on 2 cores
        # (51.8 s of a 55 s run; 6.3 s materialized). Leave a table larger than the object store
        # streaming from storage.
        datasets={"train": ray.data.read_parquet(str(train_path)).materialize()},
        scaling_config=ray.train.ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": args.cpus_per_worker}),
        torch_config=TorchConfig(backend="gloo"),
        # Ray Train's info lines (every report's metrics dictionary) would bury the epoch lines.
        run_config=ray.train.RunConfig(
            storage_path=str(out / "ray"), name="tabular", logging_config=ray.train.LoggingConfig(log_level="WARNING")
        ),
    )
    return trainer.fit()


if __name__ == "__main__":
    try:
        main()
    except ClusterError as error:
        sys.exit(f"error: {error}")
