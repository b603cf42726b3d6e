"""What a streamed epoch reads and decodes (issue 69, item 4), measured on this machine:

    python -m raysb.bench.stream_reads --strategies traditional free-sb --out runs/stream-reads

Writes `--train-rows` of Fashion-MNIST's training set (and 2,000 test rows) as PNG in the raysb Parquet
format, `--row-group` rows a row group, then trains each strategy on it streamed (`data_mode=stream`,
`--workers 0`: Ray Train in this process, as a user's single-worker streamed run trains) for `--epochs`
epochs, every other setting at its default or as `--set` gives it. Each epoch's rows decoded and Parquet
bytes read come from its metrics row's counters (`stream_rows_decoded`, `stream_bytes_read`, counted
from the run's start), its seconds from the training clock (`wall_s`) and the data phase (`time_data_s`,
which includes waiting for Ray Data's reads and decodes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from raysb.api import train
from raysb.bench.reports import write_report
from raysb.config import ConfigError, TrainConfig, parse_overrides
from raysb.data import load_dataset, stratified_subset, write_parquet

TEST_ROWS = 2_000


def write_split_files(folder: Path, train_rows: int, row_group: int) -> Path:
    """Fashion-MNIST's `train_rows` and TEST_ROWS test rows as PNG Parquet in `folder` (kept if written)."""
    for split, rows in (("train", train_rows), ("test", TEST_ROWS)):
        path = folder / f"{split}.parquet"
        if not path.exists():
            write_parquet(stratified_subset(load_dataset("fashion-mnist", split), rows, seed=0), str(path),
                          row_group_size=row_group)
    return folder


def epoch_reads(rows: list[dict]) -> list[dict]:
    """Each epoch's rows decoded, bytes read, kept fraction and seconds, from a run's metrics rows (whose
    counters and clocks count from the run's start)."""
    columns = ("stream_rows_decoded", "stream_bytes_read", "wall_s", "time_data_s")
    before = dict.fromkeys(columns, 0)
    epochs = []
    for row in rows:
        epochs.append({"epoch": row["epoch"], "kept_fraction": row["kept_fraction"],
                       **{name: row[name] - before[name] for name in columns}})
        before = row
    return epochs


def measure(strategy: str, data_dir: Path, overrides: dict, out: Path) -> list[dict] | str:
    """Each epoch's reads of `strategy`'s streamed run, or why it does not stream (its config's refusal)."""
    try:
        config = TrainConfig.from_dict({"dataset": "parquet", "data_dir": str(data_dir), "data_mode": "stream",
                                        "workers": 0, "progress_seconds": 0, **overrides, "strategy": strategy,
                                        "out": str(out / strategy), "overwrite": True})
    except ConfigError as refusal:
        return str(refusal)
    return epoch_reads(train(config, log=lambda line: None).metrics)


def report(runs: dict[str, list[dict] | str], command: str, train_rows: int, row_group: int) -> list[str]:
    lines = [
        f"`{command}`",
        "",
        f"{train_rows:,} training rows as PNG, {row_group} rows a row group.",
        "",
        "| strategy | epoch | kept fraction | rows decoded | share of the rows | MB read | share of the bytes "
        "| epoch s | data s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy, epochs in runs.items():
        if isinstance(epochs, str):
            lines.append(f"| {strategy} | not streamed: {epochs} | | | | | | | |")
            continue
        whole = max(epoch["stream_bytes_read"] for epoch in epochs)
        for epoch in epochs:
            lines.append(
                f"| {strategy} | {epoch['epoch']} | {epoch['kept_fraction']:.3f} | {epoch['stream_rows_decoded']:,} "
                f"| {epoch['stream_rows_decoded'] / train_rows:.3f} | {epoch['stream_bytes_read'] / 1e6:.2f} "
                f"| {epoch['stream_bytes_read'] / whole:.3f} | {epoch['wall_s']:.2f} | {epoch['time_data_s']:.2f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raysb.bench.stream_reads", description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", nargs="+", default=["traditional", "free-sb"])
    parser.add_argument("--train-rows", type=int, default=10_000)
    parser.add_argument("--row-group", type=int, default=16, help="rows a Parquet row group")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a train config key")
    parser.add_argument("--out", default="runs/stream-reads")
    args = parser.parse_args(argv)
    out = Path(args.out)
    data_dir = write_split_files(out / f"data-{args.train_rows}-{args.row_group}", args.train_rows, args.row_group)
    overrides = {"epochs": args.epochs, **parse_overrides(args.set)}
    runs = {strategy: measure(strategy, data_dir, overrides, out) for strategy in args.strategies}
    command = "python -m raysb.bench.stream_reads " + " ".join(sys.argv[1:] if argv is None else argv)
    return write_report(out, report(runs, command.strip(), args.train_rows, args.row_group))


if __name__ == "__main__":
    raise SystemExit(main())
