"""Stability benchmarks (BENCHMARKS.md, "Stability"): final test error over seeds.

    .venv/bin/python scripts/stability_bench.py --table noise --subset 10000 --epochs 5 --out runs/stability

Each table is a list of named configs; every config trains once per seed, one run
at a time, in this process (no Ray). Prints and writes <out>/<table>.md with the
median and range of the final test error, and whether any run ended diverged.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from raysb.config import TrainConfig
from raysb.run import train

SB = dict(strategy="sb", selectivity=1 / 3)
STALE = dict(strategy="stale-sb", selectivity=1 / 3, staleness=3)
TABLES: dict[str, dict[str, dict]] = {
    "noise": {
        f"{name} noise {noise:.0%}": dict(strategy_values, label_noise=noise)
        for noise in (0.0, 0.1, 0.2)
        for name, strategy_values in (("traditional", dict(strategy="traditional")), ("sb", SB), ("stale-sb", STALE))
    },
    # Rows that would repeat a "noise" row (warmup 1, no safeguard, selection batch 128,
    # inline selection) are read from that table.
    "warmup": {
        f"{name} noise 20% no warmup": dict(strategy_values, label_noise=0.2, lr_warmup_epochs=0.0)
        for name, strategy_values in (("traditional", dict(strategy="traditional")), ("sb", SB))
    },
    "safeguards": {
        "sb noise 10% prime 1": dict(SB, label_noise=0.1, prime_epochs=1),
        "sb noise 10% anneal 1": dict(SB, label_noise=0.1, anneal_epochs=1),
        "sb noise 10% floor 0.1": dict(SB, label_noise=0.1, keep_floor=0.1),
    },
    "selection-batch": {f"sb selection batch {size}": dict(SB, selection_batch_size=size) for size in (512, 1024)},
    "pipeline": {
        f"sb pipelined depth {depth}": dict(SB, pipeline_selection="thread", pipeline_depth=depth) for depth in (2, 4)
    },
}
# The staleness correction switched from its default (auto: on where scores feed later
# steps): off for the rows that select on scores older than the weights, on for inline ones.
TABLES["no-correction"] = {
    f"{name} no correction": dict(values, staleness_correction="never")
    for name, values in (
        ("sb noise 0%", TABLES["noise"]["sb noise 0%"]),
        *TABLES["selection-batch"].items(),
        *TABLES["pipeline"].items(),
    )
}
TABLES["inline-correction"] = {
    f"{name} corrected": dict(values, staleness_correction="always")
    for name, values in TABLES["noise"].items()
    if not name.startswith("traditional")
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=sorted(TABLES), required=True)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--subset", type=int, default=None, help="stratified training subset (default: all)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads per run")
    parser.add_argument("--out", default="runs/stability")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    out = Path(args.out) / args.table
    lines = [
        f"{args.dataset}, {args.subset or 'all'} training examples, {args.epochs} epochs, seeds {args.seeds}",
        "",
        "| config | median test error | range | per seed | diverged |",
        "|---|---|---|---|---|",
    ]
    for name, values in TABLES[args.table].items():
        errors, diverged = [], 0
        for seed in args.seeds:
            config = TrainConfig.from_dict(
                dict(
                    values,
                    dataset=args.dataset,
                    subset=args.subset,
                    epochs=args.epochs,
                    seed=seed,
                    record_analysis=False,
                    out=str(out / name.replace(" ", "_").replace("%", "pct") / f"seed{seed}"),
                )
            )
            summary = train(config, log=lambda line: None).summary
            errors.append(summary["final_test_error"])
            diverged += summary["status"] == "diverged"
            print(f"{name} seed {seed}: {errors[-1]:.2%} ({summary['status']})", flush=True)
        lines.append(
            f"| {name} | {statistics.median(errors):.1%} | {min(errors):.1%}-{max(errors):.1%} "
            f"| {', '.join(f'{e:.1%}' for e in errors)} | {diverged} |"
        )
    table = "\n".join(lines) + "\n"
    (out / f"{args.table}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
