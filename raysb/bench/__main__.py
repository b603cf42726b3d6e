"""`python -m raysb.bench`: see raysb.bench for what it measures."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from raysb.analysis.speedups import median_speedup_lines, time_to_target_lines
from raysb.bench import __doc__ as BENCH_DOC, host_overhead
from raysb.bench.api_overhead import compare_api_overhead
from raysb.bench.budgets import BUDGET_UNITS, compare_budgets
from raysb.bench.host_overhead import compare_host_overhead
from raysb.bench.pass_costs import SELECTION_VARIANTS, compare_selection_variants, measure_pass_costs
from raysb.bench.side_by_side import (
    compare_config_variants,
    compare_pipeline_variants,
    compare_strategies,
    compare_workers,
)
from raysb.bench.reports import write_report
from raysb.config import ConfigError, TrainConfig, parse_overrides
from raysb.core.strategy_table import STRATEGIES, strategy_card
from raysb.training.builders import resolve_device
from raysb.training.malloc_tuning import keep_freed_memory_for_reuse

# The measured per-example costs, kept beside the runs for --from-runs.
COSTS_FILE = "costs.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raysb.bench", description=BENCH_DOC.split("\n")[0])
    parser.add_argument(
        "--strategies", nargs="+", type=_strategy, default=["traditional", "sb", "stale-sb"],
        help=f"{', '.join(STRATEGIES)}, or your own as package.module:CARD",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+",
                        help="train every strategy once per seed (out/seed-S/...) and add the median speedups")
    parser.add_argument("--from-runs", action="store_true",
                        help="train nothing: rebuild the time-to-target and median tables from the run folders "
                             "and costs.json an earlier benchmark with the same --out, --seeds and --strategies wrote "
                             "(with --budgets: from the runs that have finished, naming the others)")
    parser.add_argument("--out", default="runs/bench")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any train config key, applied to every strategy")
    parser.add_argument("--workers", type=int, nargs="+",
                        help="instead: compare these Ray Train worker counts (strategy from --set)")
    parser.add_argument("--selection-variants", nargs="+", choices=list(SELECTION_VARIANTS),
                        help="instead: measure these selection-forward options against the configured one")
    parser.add_argument("--pipeline-variants", nargs="+", metavar="MODE[:DEPTH[:SYNC_EVERY]]",
                        help="instead: compare selection inline and pipelined, e.g. inline thread:1:1 thread:4:4")
    parser.add_argument("--config-variants", nargs="+", metavar="KEY=VALUE[,KEY=VALUE...]",
                        help="instead: compare runs under these sets of overrides, e.g. "
                             "selection_batch_size=128 selection_batch_size=512,history_size=4096")
    parser.add_argument("--data-modes", nargs="+", default=["memory"], choices=["memory", "stream"],
                        help="with --workers: data modes to compare (stream needs dataset=parquet)")
    parser.add_argument("--api-overhead", action="store_true",
                        help="instead: SB in a user's own loop (SelectiveBackprop) against raysb's trainer, "
                             "per step, alternating --repeats times, in one process or on each of --workers")
    parser.add_argument("--host-overhead", action="store_true",
                        help="instead: host microseconds per selection round and per step of every strategy with a "
                             "model that costs nothing, in one process (--workers 0) or on N gloo ranks (--workers N)")
    parser.add_argument("--examples", type=int, default=host_overhead.EXAMPLES,
                        help="with --host-overhead: the synthetic training examples of each run")
    parser.add_argument("--batch-size", type=int, default=host_overhead.BATCH_SIZE, help="with --host-overhead: b")
    parser.add_argument("--repeats", type=int, default=2, help="with --api-overhead: runs of each")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL:KEY=VALUE[,KEY=VALUE...]",
                        help="with --budgets: one more row, LABEL, trained with these overrides (its strategy "
                             "among them), e.g. sb-cheap:strategy=sb,selection_scale=0.5")
    parser.add_argument("--budgets", type=float, nargs="+", metavar="FRACTION",
                        help="instead: train Traditional for --epochs, then every strategy once per seed with a "
                             "budget of each FRACTION of its work (--budget-unit work: FRACTION x --epochs epochs "
                             "of work) or of its training time (time); schedules keyed to the budget; runs already "
                             "in --out are reused")
    parser.add_argument("--budget-unit", choices=BUDGET_UNITS, default="work",
                        help="with --budgets: work (the same result under any load; default) or time (seconds, "
                             "which follow the machine's load)")
    args = parser.parse_args(argv)
    if args.variant and not args.budgets:
        # It would be ignored: the other modes' rows are --strategies or their own variants.
        parser.error("--variant adds a row to a budget table: give --budgets too (or compare configs with "
                     "--config-variants)")
    keep_freed_memory_for_reuse()

    base = {"epochs": args.epochs, **parse_overrides(args.set)}
    out = Path(args.out)
    if args.host_overhead:
        strategies = args.strategies if "--strategies" in (argv or sys.argv) else list(STRATEGIES)
        return write_report(out, compare_host_overhead(strategies, args.workers or [0], max(3, args.repeats),
                                                       args.examples, args.batch_size))
    if args.api_overhead:
        return write_report(out, compare_api_overhead(base, args.workers or [0], args.repeats, out))
    if args.selection_variants:
        config = TrainConfig.from_dict({**base, "out": str(out / "selection-variants")})
        return write_report(out, compare_selection_variants(config, args.selection_variants))
    if args.config_variants:
        return write_report(out, compare_config_variants(base, args.config_variants, out))
    if args.pipeline_variants:
        return write_report(out, compare_pipeline_variants(base, args.pipeline_variants, out))
    if args.budgets:
        if not all(0 < fraction for fraction in args.budgets):
            parser.error(f"--budgets must be fractions > 0 of the reference run's time, got {args.budgets}")
        seeds = args.seeds or [base.get("seed", 0)]
        variants = {}
        for spec in args.variant:
            label, sep, assignments = spec.partition(":")
            if not sep or not label or "strategy=" not in assignments:
                parser.error(f"--variant expects LABEL:strategy=NAME[,KEY=VALUE...], got {spec!r}")
            variants[label] = parse_overrides(assignments.split(","))
        return write_report(
            out, compare_budgets(base, args.strategies, args.budgets, seeds, args.epochs, out, args.from_runs, variants,
                                 args.budget_unit)
        )
    if args.workers:
        return write_report(out, compare_workers(base, args.workers, args.data_modes, out))
    if args.strategies[0] != "traditional":
        parser.error("--strategies must start with traditional: epoch ratios and speedups are relative to it")
    seeds = args.seeds or [base.get("seed", 0)]
    seed_run_dirs = {
        seed: [(out / f"seed-{seed}" if args.seeds else out) / strategy for strategy in args.strategies]
        for seed in seeds
    }
    if args.from_runs:
        return write_report(out, _tables_from_runs(out, seed_run_dirs), name="report-from-runs.md")
    probe = TrainConfig.from_dict({**base, "out": str(out / "probe")})
    costs = measure_pass_costs(probe)
    out.mkdir(parents=True, exist_ok=True)
    (out / COSTS_FILE).write_text(json.dumps(costs))
    lines = [
        f"Per-example costs ({probe.model}, batch {probe.batch_size}, selection batch "
        f"{probe.selection_spec().selection_batch_size}, device {resolve_device(probe.device)}): "
        f"F = {costs['F'] * 1e6:.0f} us, B = {costs['B'] * 1e6:.0f} us, "
        f"F_sel = {costs['F_sel'] * 1e6:.0f} us (precision {probe.precision}, selection {probe.selection_precision}; B/F = {costs['B'] / costs['F']:.2f}, "
        f"F_sel/F = {costs['F_sel'] / costs['F']:.2f})",
    ]
    for seed, run_dirs in seed_run_dirs.items():
        lines += ["", f"Seed {seed}:", ""] if args.seeds else [""]
        lines += compare_strategies({**base, "seed": seed}, args.strategies, costs, run_dirs[0].parent)
        lines += ["", *time_to_target_lines(run_dirs)]
        write_report(out, lines, echo=False)  # a partial report survives an interrupted benchmark
    if len(seeds) > 1:
        lines += ["", *median_speedup_lines(seed_run_dirs), "", *median_speedup_lines(seed_run_dirs, costs)]
    return write_report(out, lines)


def _strategy(name: str) -> str:
    try:
        strategy_card(name)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return name


def _tables_from_runs(out: Path, seed_run_dirs: dict[int, list[Path]]) -> list[str]:
    """The time-to-target and median tables again, from an earlier benchmark's run folders."""
    if not (out / COSTS_FILE).is_file():
        raise SystemExit(f"raysb.bench: error: --from-runs needs {out / COSTS_FILE} from an earlier benchmark in {out}")
    costs = json.loads((out / COSTS_FILE).read_text())
    lines = []
    for seed, run_dirs in seed_run_dirs.items():
        lines += [f"Seed {seed}:", "", *time_to_target_lines(run_dirs), ""]
    if len(seed_run_dirs) > 1:
        lines += [*median_speedup_lines(seed_run_dirs), "", *median_speedup_lines(seed_run_dirs, costs)]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
