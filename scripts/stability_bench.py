"""Stability benchmarks (BENCHMARKS.md, "Stability"): final test error over seeds.

    .venv/bin/python scripts/stability_bench.py --table noise --subset 10000 --epochs 5 --out runs/stability

Each table is a list of named configs (`--rows` keeps those whose names contain one of its
words); every config trains once per seed (no Ray), unless <out> holds that run already, made
with the same config, so an interrupted benchmark goes on where it stopped;
in this process or, with --jobs N, in N worker processes sharing one queue of runs
across all the tables named. Only test errors are compared, never times, so runs
side by side do not skew the result. Prints and writes <out>/<table>.md with the
median and range of the final test error, and whether any run ended diverged.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from raysb.api import train
from raysb.bench.budgets import finished_summary
from raysb.config import TrainConfig

SB = dict(strategy="sb", selectivity=1 / 3)
STALE = dict(strategy="stale-sb", selectivity=1 / 3, staleness=3)
TABLES: dict[str, dict[str, dict]] = {
    "noise": {
        f"{name} noise {noise:.0%}": dict(strategy_values, label_noise=noise)
        for noise in (0.0, 0.01, 0.1, 0.2)
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
    # SB started after one plain epoch at 20% noise, and what might hold it (BENCHMARKS.md,
    # "Priming under 20% noise"); the row without priming is "sb noise 20%".
    "priming": {
        f"sb noise 20% prime 1{name}": dict(SB, label_noise=0.2, prime_epochs=1, **values)
        for name, values in (
            ("", {}),
            (" anneal 1", dict(anneal_epochs=1)),
            (" correction always", dict(staleness_correction="always")),
            (" floor 0.3", dict(keep_floor=0.3)),
            (" clip 1", dict(grad_clip_norm=1.0)),
            (" lr 0.02", dict(lr=0.02)),
        )
    },
    # Whether clipping, which holds primed SB under noise, helps selection without priming too.
    "clipping": {
        f"{name} noise {noise:.0%} clip 1": dict(strategy_values, label_noise=noise, grad_clip_norm=1.0)
        for noise in (0.0, 0.2)
        for name, strategy_values in (("traditional", dict(strategy="traditional")), ("sb", SB))
    },
    "selection-batch": {f"sb selection batch {size}": dict(SB, selection_batch_size=size) for size in (512, 1024)},
    "pipeline": {
        f"sb pipelined depth {depth}": dict(SB, pipeline_selection="thread", pipeline_depth=depth) for depth in (1, 2, 4)
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


def train_once(values: dict, threads: int | None) -> tuple[float, str]:
    """Final test error and status of one run (a worker process's whole job)."""
    done = finished_summary(Path(values["out"]), values)
    if done is not None:
        return done["final_test_error"], done["status"]
    if threads:
        torch.set_num_threads(threads)
    summary = train(TrainConfig.from_dict({**values, "overwrite": True}), log=lambda line: None).summary
    return summary["final_test_error"], summary["status"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=sorted(TABLES), nargs="+", required=True)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--subset", type=int, default=None, help="stratified training subset (default: all)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr-schedule", default=None, help="every run's lr schedule (default: raysb's, cosine)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads per run")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side, each in its own process")
    parser.add_argument("--out", default="runs/stability")
    parser.add_argument("--rows", nargs="+", default=None, help="only the configs whose names contain one of these")
    args = parser.parse_args(argv)
    chosen = {
        table: {name: values for name, values in TABLES[table].items()
                if args.rows is None or any(word in name for word in args.rows)}
        for table in args.table
    }

    runs = {
        (table, name, seed): dict(
            values,
            dataset=args.dataset,
            subset=args.subset,
            epochs=args.epochs,
            **({} if args.lr_schedule is None else {"lr_schedule": args.lr_schedule}),
            seed=seed,
            record_analysis=False,
            out=str(Path(args.out) / table / name.replace(" ", "_").replace("%", "pct") / f"seed{seed}"),
        )
        for table in args.table
        for name, values in chosen[table].items()
        for seed in args.seeds
    }
    # spawn, not fork: each run starts from a clean torch (threads, allocator, RNG).
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        pending = {key: pool.submit(train_once, values, args.threads) for key, values in runs.items()}
        results = {}
        for (table, name, seed), future in pending.items():
            results[table, name, seed] = future.result()
            error, status = results[table, name, seed]
            print(f"{table}: {name} seed {seed}: {error:.2%} ({status})", flush=True)

    for table in args.table:
        lines = [
            f"{args.dataset}, {args.subset or 'all'} training examples, {args.epochs} epochs, "
            f"lr schedule {args.lr_schedule or 'default'}, seeds {args.seeds}",
            "",
            "| config | median test error | range | per seed | diverged |",
            "|---|---|---|---|---|",
        ]
        for name in chosen[table]:
            errors = [results[table, name, seed][0] for seed in args.seeds]
            diverged = sum(results[table, name, seed][1] == "diverged" for seed in args.seeds)
            lines.append(
                f"| {name} | {statistics.median(errors):.1%} | {min(errors):.1%}-{max(errors):.1%} "
                f"| {', '.join(f'{e:.1%}' for e in errors)} | {diverged} |"
            )
        text = "\n".join(lines) + "\n"
        (Path(args.out) / table).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / table / f"{table}.md").write_text(text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
