"""Side-by-side benchmark: per-example pass costs, then strategies trained in one process.

    python -m raysb.bench --epochs 3 --strategies traditional sb stale-sb --out runs/bench

Prints a markdown report (also written to OUT/report.md): F, B and F_sel per
example, then each strategy's per-epoch time as a ratio to Traditional next to
the cost-model bound of ../shared/GUIDE.md section 8, its time split (with SB's
bookkeeping share) and error, then each strategy's time to 1.0x, 1.1x, 1.2x and
1.4x Traditional's final error. With `--seeds 0 1 2` every strategy runs once
per seed and the report ends with each strategy's median speedup over seeds,
in measured wall-clock and in time modelled from the measured per-example costs
and each run's example counts (free of the machine's timing noise).
Ratios are only meaningful within one report: the runs share one machine, one
process and one stretch of time.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from raysb.analysis.frontier import baseline_error, speedup_table, target_label
from raysb.analysis.results import load_trials
from raysb.config import TrainConfig, parse_overrides
from raysb.data import BatchTransform
from raysb.malloc_tuning import keep_freed_memory_for_reuse
from raysb.models import build_model
from raysb.run import build_engine, prepare_data, resolve_device, train


def measure_pass_costs(config: TrainConfig, repeats: int = 20) -> dict[str, float]:
    """Seconds per example of a training forward (F), backward+step (B) and selection forward."""
    device = resolve_device(config.device)
    train_data, _, _ = prepare_data(config)
    channels, height, _ = train_data.images.shape[1:]
    model = build_model(config.model, train_data.num_classes, channels, height, **config.model_options)
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    transform = BatchTransform(train_data.mean, train_data.std)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def batch(size: int):
        index = torch.randint(len(train_data), (size,))
        images = transform(train_data.images[index].to(device), None, train=False)
        return images, train_data.labels[index].to(device)

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    x, y = batch(config.batch_size)
    xs, ys = batch(config.resolved_selection_batch_size)
    forward, backward, selection = [], [], []
    for i in range(repeats + 3):
        model.train()
        holder = {}
        f = timed(lambda: holder.update(loss=F.cross_entropy(model(x), y)))

        def step():
            optimizer.zero_grad(set_to_none=True)
            holder["loss"].backward()
            optimizer.step()

        b = timed(step)
        model.eval()
        with torch.inference_mode():
            s = timed(lambda: F.cross_entropy(model(xs), ys, reduction="none"))
        if i >= 3:  # warm-up iterations excluded
            forward.append(f / len(y))
            backward.append(b / len(y))
            selection.append(s / len(ys))
    return {
        "F": statistics.median(forward),
        "B": statistics.median(backward),
        "F_sel": statistics.median(selection),
    }


def cost_model_ratio(
    strategy: str, costs: dict[str, float], selectivity: float, staleness: int, prime_fraction: float = 0.0
) -> float:
    """Predicted epoch time relative to Traditional (F + B), averaged over a run whose
    first `prime_fraction` of epochs are plain SGD (which cost what Traditional's do)."""
    full = costs["F"] + costs["B"]
    if strategy == "traditional":
        return 1.0
    if strategy in ("sb", "kath18"):  # kath18 scores the whole presample once importance sampling is on
        selecting = (costs["F_sel"] + selectivity * full) / full
    elif strategy == "stale-sb":
        selecting = (costs["F_sel"] / staleness + selectivity * full) / full
    else:
        raise ValueError(strategy)
    return prime_fraction + (1.0 - prime_fraction) * selecting


def run_side_by_side(header: list[str], runs) -> list[str]:
    """Train each (config, cells) of `runs` one after another, a markdown table row each.

    `cells(summary, seconds_per_epoch, ratio_to_first)` gives the row's cells; the
    ratio compares each run's epoch time with the first run's.
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    first = None
    for config, cells in runs:
        summary = train(config).summary
        per_epoch = summary["training_wall_s"] / summary["epochs_completed"]
        first = first or per_epoch
        lines.append("| " + " | ".join(str(c) for c in cells(summary, per_epoch, per_epoch / first)) + " |")
    return lines


def compare_workers(base: dict, worker_counts: list[int], data_modes: list[str], out: Path) -> list[str]:
    """The same run on 1..N Ray Train workers (per-worker batch b) and each data mode, one after another."""
    header = ["data", "workers", "final test error", "training wall s", "s/epoch", "epoch ratio vs first",
              "data s", "optimizer steps", "per-rank steps", "kept", "lockstep exchange ms/step",
              "exchange KB/step", "CDF actor ms/step", "CDF staleness (rounds)"]

    def runs():
        for mode in data_modes:
            for workers in worker_counts:
                config = TrainConfig.from_dict(
                    {**base, "workers": workers, "data_mode": mode, "out": str(out / f"{mode}-workers-{workers}")}
                )
                yield config, lambda s, per_epoch, ratio, mode=mode, workers=workers: [
                    mode, workers, f"{s['final_test_error']:.2%}", f"{s['training_wall_s']:.1f}",
                    f"{per_epoch:.1f}", f"{ratio:.2f}", f"{s['time_breakdown_s']['data']:.1f}",
                    s["optimizer_steps"], s["per_rank_optimizer_steps"], f"{s['kept_fraction']:.1%}",
                    f"{s['lockstep_exchange_ms_per_step']:.2f}", f"{s['lockstep_exchange_kb_per_step']:.1f}",
                    f"{s['histogram_actor_ms_per_step']:.2f}", f"{s['histogram_staleness']['mean_rounds']:.2f}",
                ]

    return run_side_by_side(header, runs())


def compare_pipeline_variants(base: dict, specs: list[str], out: Path) -> list[str]:
    """The same run with selection inline and pipelined (MODE[:DEPTH[:SYNC_EVERY]]), one after another."""
    header = ["selection", "depth", "sync every", "final test error", "training wall s", "s/epoch",
              "epoch ratio vs first", "selection s (incl. waiting)", "train fwd s", "backward s",
              "staleness steps (mean / max)", "kept"]
    defaults = TrainConfig()

    def runs():
        for spec in specs:
            mode, *numbers = spec.split(":")
            depth = int(numbers[0]) if numbers else defaults.pipeline_depth
            sync_every = int(numbers[1]) if len(numbers) > 1 else defaults.pipeline_sync_every
            config = TrainConfig.from_dict(
                {**base, "pipeline_selection": mode, "pipeline_depth": depth, "pipeline_sync_every": sync_every,
                 "out": str(out / spec.replace(":", "-"))}
            )
            pipelined = mode != "inline"

            def cells(s, per_epoch, ratio, mode=mode, depth=depth, sync_every=sync_every, pipelined=pipelined):
                split = s["time_breakdown_s"]
                staleness = (
                    f"{s['pipeline_mean_staleness_steps']:.2f} / {s['pipeline_max_staleness_steps']}"
                    if pipelined else "0 / 0"
                )
                return [
                    mode, depth if pipelined else "–", sync_every if pipelined else "–",
                    f"{s['final_test_error']:.2%}", f"{s['training_wall_s']:.1f}", f"{per_epoch:.2f}",
                    f"{ratio:.2f}", f"{split['selection']:.1f}", f"{split['train_forward']:.1f}",
                    f"{split['backward']:.1f}", staleness, f"{s['kept_fraction']:.1%}",
                ]

            yield config, cells

    return run_side_by_side(header, runs())


def compare_config_variants(base: dict, variants: list[str], out: Path) -> list[str]:
    """The same run under each comma-separated set of KEY=VALUE overrides, one after another."""
    header = ["variant", "final test error", "training wall s", "s/epoch", "epoch ratio vs first",
              "F_sel us/example", "selection rounds", "bookkeeping ms/round", "bookkeeping share", "kept"]

    def runs():
        for spec in variants:
            overrides = parse_overrides([item for item in spec.split(",") if item])
            name = spec or "base"
            config = TrainConfig.from_dict(
                {**base, **overrides, "out": str(out / name.replace("=", "-").replace(",", "_"))}
            )

            def cells(s, per_epoch, ratio, name=name, config=config):
                split = s["time_breakdown_s"]
                rounds = s["examples_considered"] / config.resolved_selection_batch_size
                scored = s["selection_forward_examples"]
                return [
                    name, f"{s['final_test_error']:.2%}", f"{s['training_wall_s']:.1f}", f"{per_epoch:.2f}",
                    f"{ratio:.2f}", f"{split['selection'] / scored * 1e6 if scored else 0:.0f}", f"{rounds:.0f}",
                    f"{split['bookkeeping'] / rounds * 1e3:.2f}",
                    f"{split['bookkeeping'] / s['training_wall_s']:.1%}", f"{s['kept_fraction']:.1%}",
                ]

            yield config, cells

    return run_side_by_side(header, runs())


SELECTION_VARIANTS = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "channels-last": {"channels_last": True},
    "compile": {"compile": True},
}


def compare_selection_variants(config: TrainConfig, variants: list[str], repeats: int = 10) -> list[str]:
    """Each cheap-selection option's forward cost and how much it changes which examples are kept.

    The model first trains one epoch of plain SGD so that losses spread as they do
    mid-run. Agreement compares keep decisions with fp32's under the same uniform
    draws, ranking both against the same fp32 history of R losses.
    """
    from raysb.scoring import SelectionScorer
    from raysb.selection import keep_probabilities, percentile_ranks
    from raysb.shards import MemoryShard

    device = resolve_device(config.device)
    train_data, _, _ = prepare_data(config)
    engine = build_engine(TrainConfig.from_dict({**config.to_dict(), "strategy": "traditional"}),
                          MemoryShard(train_data), device)
    engine.train_epoch(0)
    model = engine.scoring_model
    transform = BatchTransform(train_data.mean, train_data.std)
    size = config.resolved_selection_batch_size
    chunks = [torch.randperm(len(train_data), generator=torch.Generator().manual_seed(i))[:size] for i in range(8)]
    inputs = [transform(train_data.images[c].to(device), None, train=False) for c in chunks]
    labels = [train_data.labels[c].to(device) for c in chunks]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    generator = torch.Generator().manual_seed(0)
    draws = torch.rand(size * len(chunks), generator=generator)
    ties = torch.rand(size * len(chunks), generator=generator)

    lines = [
        f"Selection forward variants ({config.model}, selection batch {size}, device {device}, "
        f"after one epoch of plain SGD on {len(train_data)} examples):",
        "",
        "| variant | F_sel us/example | vs fp32 | keep decisions equal to fp32 | kept-set Jaccard vs fp32 |",
        "|---|---|---|---|---|",
    ]
    reference_losses, reference_keep, reference_time = None, None, None
    for name in variants:
        options = SELECTION_VARIANTS[name]
        scored = copy.deepcopy(model)
        if options.get("channels_last"):
            scored = scored.to(memory_format=torch.channels_last)
        try:
            scorer = SelectionScorer(scored, device, **options)
        except ValueError as error:
            lines.append(f"| {name} | skipped: {error} | | | |")
            continue
        for x, y in zip(inputs[:2], labels[:2]):  # warm-up, and compilation for "compile"
            scorer(x, y)
        timings = []
        for _ in range(repeats):
            for x, y in zip(inputs, labels):
                sync()
                start = time.perf_counter()
                scorer(x, y)
                sync()
                timings.append((time.perf_counter() - start) / size)
        losses = torch.cat([scorer(x, y) for x, y in zip(inputs, labels)]).cpu()
        per_example = statistics.median(timings)
        if reference_losses is None:
            reference_losses, reference_time = losses, per_example
        history = reference_losses[-config.history_size :]
        keep = draws < keep_probabilities(percentile_ranks(history, losses, ties), config.beta)
        if reference_keep is None:
            reference_keep = keep
        same = (keep == reference_keep).float().mean().item()
        jaccard = (keep & reference_keep).sum().item() / max(1, (keep | reference_keep).sum().item())
        lines.append(
            f"| {name} | {per_example * 1e6:.0f} | {per_example / reference_time:.2f} "
            f"| {same:.2%} | {jaccard:.3f} |"
        )
    return lines


def compare_strategies(base: dict, strategies: list[str], costs: dict[str, float], out: Path) -> list[str]:
    """Each strategy trained one after another: epoch time vs Traditional's and the cost-model bound."""
    header = ["strategy", "final test error", "training wall s", "s/epoch", "epoch ratio vs traditional",
              "cost-model bound", "selection s", "train fwd s", "backward s", "data s", "bookkeeping s",
              "bookkeeping share", "other s", "kept", "backprop examples"]

    def runs():
        for strategy in strategies:
            config = TrainConfig.from_dict({**base, "strategy": strategy, "out": str(out / strategy)})

            def cells(summary, per_epoch, ratio, config=config):
                epochs = summary["epochs_completed"]
                primed = min(config.prime_epochs, epochs) / epochs
                bound = cost_model_ratio(config.strategy, costs, config.selectivity, config.staleness, primed)
                split = summary["time_breakdown_s"]
                return [
                    config.strategy, f"{summary['final_test_error']:.2%}", f"{summary['training_wall_s']:.1f}",
                    f"{per_epoch:.1f}", f"{ratio:.2f}", f"{bound:.2f}", f"{split['selection']:.1f}",
                    f"{split['train_forward']:.1f}", f"{split['backward']:.1f}", f"{split['data']:.1f}",
                    f"{split['bookkeeping']:.2f}", f"{split['bookkeeping'] / summary['training_wall_s']:.1%}",
                    f"{split['other']:.1f}", f"{summary['kept_fraction']:.1%}", summary["backprop_examples"],
                ]

            yield config, cells

    return run_side_by_side(header, runs())


TARGETS = (1.0, 1.1, 1.2, 1.4)
# The measured per-example costs, kept beside the runs for --from-runs.
COSTS_FILE = "costs.json"


def time_to_target_lines(run_dirs: list[Path], targets=TARGETS) -> list[str]:
    """Seconds to m x Traditional's final error per strategy, and the speedup over Traditional."""
    trials = load_trials(run_dirs)
    table = _speedups(trials, targets)
    error = baseline_error(trials)[0]
    labels = [target_label(m) for m in targets]
    lines = [
        f"Time to m x E, E = Traditional's final error {error:.2%} (speedup over Traditional in brackets):",
        "",
        "| strategy | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for row in table.to_dict("records"):
        cells = []
        for label in labels:
            seconds, speedup = row[f"time_to_{label}_s"], row[f"speedup_{label}"]
            cells.append("–" if seconds != seconds else f"{seconds:.1f} s ({speedup:.2f}x)")
        lines.append(f"| {row['strategy']} | " + " | ".join(cells) + " |")
    return lines


def median_speedup_lines(seed_run_dirs: dict[int, list[Path]], costs: dict[str, float] | None = None,
                         targets=TARGETS) -> list[str]:
    """Per strategy and target: the median over seeds of each seed's speedup, with its range.

    Each seed is compared with its own Traditional run; a seed where the strategy
    never reached a target counts as a speedup of 0 (so one miss in three still
    gives a median, two do not). With `costs`, time is modelled (see `modelled_seconds`)
    instead of measured, which takes this shared machine's timing noise out.
    """
    labels = [target_label(m) for m in targets]
    per_seed = {
        seed: _speedups(load_trials(dirs), targets, costs).set_index("strategy") for seed, dirs in seed_run_dirs.items()
    }
    strategies = list(next(iter(per_seed.values())).index)
    clock = "modelled time (F, B, F_sel x examples)" if costs else "measured wall-clock"
    lines = [
        f"Median over seeds {', '.join(map(str, seed_run_dirs))} of each seed's speedup in {clock} over its own "
        "Traditional run (min-max in brackets; 0 = target not reached in that seed):",
        "",
        "| strategy | final error (median) | " + " | ".join(labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for strategy in strategies:
        finals = [table.loc[strategy, "final_error"] for table in per_seed.values()]
        cells = []
        for label in labels:
            values = [table.loc[strategy, f"speedup_{label}"] for table in per_seed.values()]
            values = [0.0 if v != v else float(v) for v in values]
            cells.append(f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})")
        lines.append(f"| {strategy} | {statistics.median(finals):.2%} | " + " | ".join(cells) + " |")
    return lines


def modelled_seconds(rows, costs: dict[str, float]):
    """Training time the cost model gives for a run's cumulative example counts:
    F_sel per selection-forward example, F per training-forward example, B per backprop."""
    return (
        costs["F_sel"] * rows["selection_forward_examples"]
        + costs["F"] * rows["train_forward_examples"]
        + costs["B"] * rows["backprop_examples"]
    )


def _speedups(trials, targets, costs: dict[str, float] | None = None):
    if costs is not None:
        trials = trials.assign(wall_s=modelled_seconds(trials, costs))
    return speedup_table(trials, targets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raysb.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", nargs="+", default=["traditional", "sb", "stale-sb"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+",
                        help="train every strategy once per seed (out/seed-S/...) and add the median speedups")
    parser.add_argument("--from-runs", action="store_true",
                        help="train nothing: rebuild the time-to-target and median tables from the run folders "
                             "and costs.json an earlier benchmark with the same --out, --seeds and --strategies wrote")
    parser.add_argument("--out", default="runs/bench")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any train config key, applied to every strategy")
    parser.add_argument("--workers", type=int, nargs="+",
                        help="instead: compare these Ray Train worker counts (strategy from --set)")
    parser.add_argument("--selection-variants", nargs="+", choices=list(SELECTION_VARIANTS),
                        help="instead: measure these selection-forward options against fp32 (fp32 first)")
    parser.add_argument("--pipeline-variants", nargs="+", metavar="MODE[:DEPTH[:SYNC_EVERY]]",
                        help="instead: compare selection inline and pipelined, e.g. inline thread:1:1 thread:4:4")
    parser.add_argument("--config-variants", nargs="+", metavar="KEY=VALUE[,KEY=VALUE...]",
                        help="instead: compare runs under these sets of overrides, e.g. "
                             "selection_batch_size=128 selection_batch_size=512,history_size=4096")
    parser.add_argument("--data-modes", nargs="+", default=["memory"], choices=["memory", "stream"],
                        help="with --workers: data modes to compare (stream needs dataset=parquet)")
    args = parser.parse_args(argv)
    keep_freed_memory_for_reuse()

    base = {"epochs": args.epochs, **parse_overrides(args.set)}
    out = Path(args.out)
    if args.selection_variants:
        config = TrainConfig.from_dict({**base, "out": str(out / "selection-variants")})
        variants = ["fp32", *[v for v in args.selection_variants if v != "fp32"]]
        return _write_report(out, compare_selection_variants(config, variants))
    if args.config_variants:
        return _write_report(out, compare_config_variants(base, args.config_variants, out))
    if args.pipeline_variants:
        return _write_report(out, compare_pipeline_variants(base, args.pipeline_variants, out))
    if args.workers:
        return _write_report(out, compare_workers(base, args.workers, args.data_modes, out))
    if args.strategies[0] != "traditional":
        parser.error("--strategies must start with traditional: epoch ratios and speedups are relative to it")
    seeds = args.seeds or [base.get("seed", 0)]
    seed_run_dirs = {
        seed: [(out / f"seed-{seed}" if args.seeds else out) / strategy for strategy in args.strategies]
        for seed in seeds
    }
    if args.from_runs:
        return _write_report(out, _tables_from_runs(out, seed_run_dirs), name="report-from-runs.md")
    probe = TrainConfig.from_dict({**base, "out": str(out / "probe")})
    costs = measure_pass_costs(probe)
    out.mkdir(parents=True, exist_ok=True)
    (out / COSTS_FILE).write_text(json.dumps(costs))
    lines = [
        f"Per-example costs ({probe.model}, batch {probe.batch_size}, selection batch "
        f"{probe.resolved_selection_batch_size}, device {resolve_device(probe.device)}): "
        f"F = {costs['F'] * 1e6:.0f} us, B = {costs['B'] * 1e6:.0f} us, "
        f"F_sel = {costs['F_sel'] * 1e6:.0f} us (B/F = {costs['B'] / costs['F']:.2f}, "
        f"F_sel/F = {costs['F_sel'] / costs['F']:.2f})",
    ]
    for seed, run_dirs in seed_run_dirs.items():
        lines += ["", f"Seed {seed}:", ""] if args.seeds else [""]
        lines += compare_strategies({**base, "seed": seed}, args.strategies, costs, run_dirs[0].parent)
        lines += ["", *time_to_target_lines(run_dirs)]
        _write_report(out, lines, echo=False)  # a partial report survives an interrupted benchmark
    if len(seeds) > 1:
        lines += ["", *median_speedup_lines(seed_run_dirs), "", *median_speedup_lines(seed_run_dirs, costs)]
    return _write_report(out, lines)


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


def _write_report(out: Path, lines: list[str], echo: bool = True, name: str = "report.md") -> int:
    report = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(report + "\n")
    if echo:
        print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
