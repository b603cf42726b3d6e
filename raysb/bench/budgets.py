"""Final error at fixed budgets, every schedule keyed to its budget (issue 31, item 5; issue 45).

A frontier built from runs stopped mid-schedule measures the schedule, not the method
(Kaddour et al., "No Train No Gain"): here every run's lr reaches its end value exactly
when its budget runs out (lr_schedule_key auto -> work or time). The budgets are fractions of
one Traditional run of `reference_epochs` epochs, trained first in the same process: in work
(raysb.core.work_units: the same seed and budget end alike under any load; every run's seconds are
reported beside it) or in its measured training time (which follows the machine's load: a run
whose speed moved is flagged).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import torch

from raysb.analysis.frontier import RANDOM_SUBSET, order_strategies, pareto_share
from raysb.analysis.plots import plot_pareto
from raysb.analysis.report import percent
from raysb.api import train
from raysb.config import TrainConfig
from raysb.core.errors import ConfigError
from raysb.training.builders import device_resolved_keys
from raysb.training.loop import BUDGET_STATUSES

REFERENCE = "reference"
WARM_UP = "warm-up"
BUDGET_UNITS = ("work", "time")
# Examples a second of one strategy's runs differing by more than this ratio: the machine's speed moved.
SPEED_MOVED = 1.2


def compare_budgets(
    base: dict, strategies: list[str], fractions: list[float], seeds: list[int], reference_epochs: int, out: Path,
    from_runs: bool = False, variants: dict[str, dict] | None = None, unit: str = "work",
) -> list[str]:
    """Train Traditional for `reference_epochs` epochs, then every strategy at each fraction of its
    work (`unit` work: fraction x reference_epochs epochs of work) or of its training time (time).

    `variants`: more rows, each a label and the config overrides that make it (its strategy among
    them), e.g. {"sb-cheap": {"strategy": "sb", "selection_scale": 0.5}}.
    With `from_runs`, train nothing and rebuild the report from an earlier benchmark's run folders.
    """
    if unit not in BUDGET_UNITS:
        raise ValueError(f"unknown budget unit {unit!r}; choose one of {', '.join(BUDGET_UNITS)}")
    rows = {strategy: {"strategy": strategy} for strategy in strategies} | (variants or {})
    if not from_runs and unit == "time":
        _warm_up(base, out / WARM_UP)
    # The reference keeps the base config's seed, not the first of `seeds`: benchmarks of other seeds
    # run side by side into one `out` (one a core) share it instead of each training it over the others'.
    reference = _run(base | {"strategy": "traditional", "epochs": reference_epochs}, out / REFERENCE, from_runs)
    full = reference_epochs if unit == "work" else reference["training_wall_s"]
    # Enough epochs that the budget, never the epoch count, ends every run (a time-keyed schedule
    # does not depend on them): a uniform third of the data costs a third of Traditional's epoch,
    # and on a busy machine one stalled reference made every budget several times what the runs
    # after it needed (a 1-epoch reference of 4.4 s, then 11 epochs of Traditional in 4.4 s).
    epochs = math.ceil(reference_epochs / min(fractions) * 100)
    records, missing = [], []
    for seed in seeds:
        for fraction in fractions:
            budget = fraction * full
            for strategy, overrides in rows.items():
                folder = out / f"seed-{seed}" / f"budget-{fraction:g}" / strategy
                if from_runs and finished_summary(folder, None) is None:
                    missing.append(str(folder.relative_to(out)))
                    continue
                summary = _run(
                    base | overrides | {"seed": seed, "epochs": epochs, f"{unit}_budget": budget}, folder, from_runs,
                )
                records.append({
                    "seed": seed, "fraction": fraction, "budget": budget, "strategy": strategy,
                    "trial_id": str(folder.relative_to(out)), "status": summary["status"],
                    # A time-budgeted run's time is its budget: the budget stops it at the end of a
                    # round, a fraction of a second later for some strategies than for others.
                    "test_error": summary["final_test_error"], "test_loss": final_test_loss(folder),
                    "wall_s": budget if unit == "time" else summary["training_wall_s"],
                    "training_s": summary["training_wall_s"],
                    "epochs": summary["epochs_completed"], "backprop_examples": summary["backprop_examples"],
                })
    if not records:
        raise SystemExit(f"raysb.bench: error: --from-runs found no finished run of this benchmark in {out}")
    runs = pd.DataFrame.from_records(records)
    runs.to_csv(out / "budget_runs.csv", index=False)
    plot_pareto(runs.assign(epoch=runs["epochs"]), out / "pareto.png")
    measure = (f"{reference_epochs} epochs of work each" if unit == "work"
               else f"{full:.1f} s of training (budgets in seconds of training)")
    lines = [
        f"Reference: Traditional, {reference_epochs} epochs, seed {reference['config']['seed']}: {measure}; "
        f"{reference['training_wall_s']:.1f} s of training, final test error {percent(reference['final_test_error'])}.",
        *([] if unit == "work" else ["", *speed_lines(runs, reference)]),
        *([] if not missing else [
            "", f"**Not finished (not run yet, running or failed): {len(missing)} of {len(missing) + len(records)} runs** "
            f"({', '.join(missing)}); "
            "the tables below hold the others."
        ]),
        "",
        *budget_table_lines(runs, unit),
        "",
        *seed_table_lines(runs),
        "",
        *best_strategy_lines(runs),
        "",
        *uniform_comparison_lines(runs),
        "",
        *frontier_share_lines(runs),
    ]
    return lines


def budget_table_lines(runs: pd.DataFrame, unit: str = "work") -> list[str]:
    """Per budget and strategy: final error median [min-max] over seeds, final test loss, epochs,
    backprop examples and seconds of training."""
    seeds = sorted(runs["seed"].unique())
    lines = [
        f"Final test error at each budget, median over seeds {', '.join(map(str, seeds))} [min-max]; "
        "final test loss, epochs run, examples backpropagated and seconds of training, median:",
        "",
        "| budget | strategy | final test error | test loss | epochs | backprop examples | training s | runs ended by the budget |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (fraction, strategy), group in _by_budget_and_strategy(runs):
        errors = group["test_error"]
        budget = group["budget"].iloc[0]
        shown = f"{budget:.3g} epochs of work" if unit == "work" else f"{budget:.3g} s"
        lines.append(
            f"| {fraction:g} x ({shown}) | {strategy} | {percent(errors.median())} "
            f"[{percent(errors.min())}-{percent(errors.max())}] | {group['test_loss'].median():.3f} | "
            f"{group['epochs'].median():.0f} | "
            f"{group['backprop_examples'].median():.0f} | {group['training_s'].median():.1f} | "
            f"{group['status'].isin(BUDGET_STATUSES).sum()}/{len(group)} |"
        )
    return lines


def seed_table_lines(runs: pd.DataFrame) -> list[str]:
    """Every run's final error, seed by seed, with the median over the seeds that ran."""
    seeds = sorted(runs["seed"].unique())
    errors = runs.pivot_table(index=["fraction", "strategy"], columns="seed", values="test_error")
    lines = [
        "Final test error, seed by seed:",
        "",
        "| budget | strategy | " + " | ".join(f"seed {seed}" for seed in seeds) + " | median |",
        "|---|---|" + "---|" * (len(seeds) + 1),
    ]
    for (fraction, strategy), _ in _by_budget_and_strategy(runs):
        row = errors.loc[(fraction, strategy)]
        cells = ["-" if pd.isna(row.get(seed)) else percent(row[seed]) for seed in seeds]
        lines.append(f"| {fraction:g} x | {strategy} | " + " | ".join(cells) + f" | {percent(row.median())} |")
    return lines


def speed_lines(runs: pd.DataFrame, reference: dict) -> list[str]:
    """Time budgets follow the machine: each strategy's examples a second over its runs (Traditional's
    with the reference's), flagged where they differ by more than SPEED_MOVED, as on a loaded machine."""
    speeds = runs.assign(speed=runs["backprop_examples"] / runs["training_s"])
    reference_speed = reference["backprop_examples"] / reference["training_wall_s"]
    moved = []
    for strategy in order_strategies(speeds["strategy"]):
        own = speeds.loc[speeds["strategy"] == strategy, "speed"].tolist()
        if strategy == "traditional":
            own.append(reference_speed)
        if max(own) > SPEED_MOVED * min(own):
            moved.append(f"{strategy} {min(own):.0f}-{max(own):.0f} examples/s")
    if not moved:
        return [f"Each strategy's speed held within {SPEED_MOVED:g}x over its runs (the reference's included)."]
    return [f"**Warning: the machine's speed moved under these time budgets ({'; '.join(moved)}): the budgets "
            "bought different work, so the table measures the load as much as the strategies. Use work budgets "
            "(--budget-unit work).**"]


def best_strategy_lines(runs: pd.DataFrame) -> list[str]:
    """Per budget, the strategy with the lowest median error, and seed by seed whether it beats
    Traditional and uniform (a selective strategy's two bars)."""
    baselines = [name for name in ("traditional", RANDOM_SUBSET) if name in set(runs["strategy"])]
    lines = [
        "The best strategy at each budget (lowest median error), against "
        + " and ".join(baselines) + " seed by seed:",
        "",
        "| budget | best | median error | " + " | ".join(f"lower than {name} in" for name in baselines) + " |",
        "|---|---|---|" + "---|" * len(baselines),
    ]
    for fraction in sorted(runs["fraction"].unique()):
        medians = runs[runs["fraction"] == fraction].groupby("strategy")["test_error"].median()
        best = medians.idxmin()
        cells = ["-" if name == best else _seeds_lower(runs, fraction, best, name) for name in baselines]
        lines.append(f"| {fraction:g} x | {best} | {percent(medians[best])} | " + " | ".join(cells) + " |")
    return lines


def _seeds_lower(runs: pd.DataFrame, fraction: float, mine: str, theirs: str) -> str:
    """In how many of the seeds both ran at `fraction` `mine` ended lower than `theirs`."""
    errors = runs[runs["fraction"] == fraction].pivot_table(index="seed", columns="strategy", values="test_error")
    if theirs not in errors:
        return f"no {theirs} run"
    both = errors[[mine, theirs]].dropna()
    return f"{int((both[mine] < both[theirs]).sum())}/{len(both)} seeds"


def uniform_comparison_lines(runs: pd.DataFrame) -> list[str]:
    """For each selective strategy at each budget: median error against uniform's, and in how many seeds each wins."""
    if RANDOM_SUBSET not in set(runs["strategy"]):
        return [f"No {RANDOM_SUBSET} runs: nothing to compare the selective strategies with."]
    lines = [
        f"Against {RANDOM_SUBSET} (the same kept fraction, no scoring forward), seed by seed at each budget:",
        "",
        f"| budget | strategy | median error minus {RANDOM_SUBSET}'s (points) | seeds where it has the lower error |",
        "|---|---|---|---|",
    ]
    losses = []
    for (fraction, strategy), group in _by_budget_and_strategy(runs):
        if strategy in ("traditional", RANDOM_SUBSET):
            continue
        theirs = runs[(runs["fraction"] == fraction) & (runs["strategy"] == RANDOM_SUBSET)]["test_error"]
        if theirs.empty:
            lines.append(f"| {fraction:g} x | {strategy} | no {RANDOM_SUBSET} run | - |")
            continue
        difference = 100 * (group["test_error"].median() - theirs.median())
        lines.append(f"| {fraction:g} x | {strategy} | {difference:+.2f} | "
                     f"{_seeds_lower(runs, fraction, strategy, RANDOM_SUBSET).removesuffix(' seeds')} |")
        if not difference < 0:
            losses.append(f"{strategy} at {fraction:g} x")
    lines.append("")
    lines.append(
        f"**Not better than {RANDOM_SUBSET} (median): {', '.join(losses)}.**" if losses
        else f"Every selective strategy has a lower median error than {RANDOM_SUBSET} at every budget."
    )
    return lines


def frontier_share_lines(runs: pd.DataFrame) -> list[str]:
    """How many of each strategy's budget-ended runs lie on the budget-vs-error Pareto frontier of all of them."""
    share = pareto_share(runs)
    lines = [
        "Pareto frontier of every run's (budget, final error) point (pareto.png): at each budget the runs "
        "with the lowest error there, if lower than any at a smaller budget:",
        "",
        "| strategy | runs | on the frontier | share of the frontier |",
        "|---|---|---|---|",
    ]
    for row in share.to_dict("records"):
        lines.append(f"| {row['strategy']} | {row['points']} | {row['pareto_points']} | {row['pareto_share']:.0%} |")
    return lines


def _by_budget_and_strategy(runs: pd.DataFrame):
    """(fraction, strategy), rows: budgets ascending, strategies in the paper's order."""
    for fraction in sorted(runs["fraction"].unique()):
        at_budget = runs[runs["fraction"] == fraction]
        for strategy in order_strategies(at_budget["strategy"]):
            yield (fraction, strategy), at_budget[at_budget["strategy"] == strategy]


def _warm_up(base: dict, folder: Path) -> None:
    """One short Traditional epoch, thrown away, so that the reference's time holds no one-off setup.

    On an H200 the first run in a process paid CUDA's and cuDNN's setup in its first epoch: the
    reference took 13.5 s for 10 epochs of ResNet-18 while Traditional's later runs trained 11 epochs
    in the same time (BENCHMARKS.md, "On a GPU").
    """
    examples = min(8 * TrainConfig.from_dict(base).batch_size, base.get("subset") or math.inf)
    settings = base | {"strategy": "traditional", "epochs": 1, "subset": examples,
                       "test_subset": examples, "out": str(folder), "overwrite": True}
    train(TrainConfig.from_dict(settings), log=lambda _: None)


def final_test_loss(folder: Path) -> float:
    """The run's last test loss: beside its error, the sign of a model confidently wrong where it
    over-fitted (BENCHMARKS.md, issue 45)."""
    return pq.read_table(folder / "metrics.parquet", columns=["test_loss"]).column("test_loss")[-1].as_py()


# Keys added since some runs were made whose default is not what those runs did: a run whose config
# lacks one did this. (free-sb doubted no labels before label_doubt existed.)
BEFORE_KEYS_EXISTED = {"label_doubt": "off"}


def finished_summary(folder: Path, settings: dict | None) -> dict | None:
    """The summary of the run in `folder` if it was made with `settings` (None: with any) and did
    not fail, else None: what lets an interrupted benchmark go on where it stopped, training a
    failed run again. The whole resolved config must match, defaults included: a run made before
    a default changed is not this run. A key the run's config lacks was added since, with a
    default that keeps what runs did before it (the run matches that default), or with one that
    does not (BEFORE_KEYS_EXISTED: the run matches what runs did then)."""
    summary_file = folder / "summary.json"
    if not summary_file.is_file():
        return None
    summary = json.loads(summary_file.read_text())
    if summary.get("status") == "failed":
        return None
    if settings is None:
        return summary
    return summary if not settings_differences(summary, settings) else None


def settings_differences(summary: dict, settings: dict) -> dict[str, tuple]:
    """The resolved config keys whose values the run `summary` was made with differ from `settings`',
    as {key: (made, wanted)} (finished_summary says which keys count); {"config": ...} where today's
    keys refuse the run's record, made by another raysb."""
    wanted = TrainConfig.from_dict(settings).to_dict()
    made = summary["config"]
    # Where the run was written is not how it trained: a run folder copied into another benchmark's
    # --out (docs/benchmarks/ into runs/) is that benchmark's run, not one to train again over it.
    ignored = {"overwrite", "out"}
    if summary.get("status") in BUDGET_STATUSES:
        # Its budget ended it, not its epoch cap, which differs between benchmarks' budget lists.
        ignored.add("epochs")
    defaults = TrainConfig().to_dict() | BEFORE_KEYS_EXISTED
    device = torch.device(summary.get("device", "cpu"))
    try:
        made = _as_run_on({key: made.get(key, defaults[key]) for key in wanted}, device)
    except ConfigError as error:  # a record today's keys refuse: made by another raysb
        return {"config": (str(error), None)}
    wanted = _as_run_on(wanted, device)
    return {key: (made[key], value) for key, value in wanted.items() if key not in ignored and made[key] != value}


def _as_run_on(record: dict, device: torch.device) -> dict:
    """`record` with the keys that leave their choice to the device (None, auto) as `device` resolves
    them: a run made when such a default was an explicit value (compile_training: false before issue
    57) is the run today's default makes on a CPU, not on a GPU."""
    return record | device_resolved_keys(TrainConfig.from_dict(record).settings(), device)


def _run(settings: dict, folder: Path, from_runs: bool) -> dict:
    """One run's summary: read back if `folder` holds this run already (`from_runs`: whatever
    finished run it holds, and it must hold one), else trained now."""
    summary = finished_summary(folder, None if from_runs else settings)
    if summary is not None:
        return summary
    if from_runs:
        raise SystemExit(
            f"raysb.bench: error: --from-runs needs {folder / 'summary.json'} of a finished run from an earlier "
            "benchmark (missing, or the run failed)"
        )
    set_aside(folder, settings)
    config = TrainConfig.from_dict(settings | {"out": str(folder)})
    return train(dataclasses.replace(config, overwrite=True)).summary


def set_aside(folder: Path, settings: dict) -> Path | None:
    """Move a finished run that `folder` holds, made with other settings than `settings` (under an
    older default, or another flag), to a sibling folder `<name>.replaced-N`, and say so: a benchmark
    that trains a run again never deletes the result it replaces. A failed or unfinished run is
    trained over. The new folder, or None."""
    made = finished_summary(folder, None)
    if made is None:
        return None
    number = 1
    while (aside := folder.with_name(f"{folder.name}.replaced-{number}")).exists():
        number += 1
    folder.rename(aside)
    differences = ", ".join(f"{key} {was!r}, now {now!r}" for key, (was, now) in
                            settings_differences(made, settings).items())
    print(f"raysb.bench: {folder} held a finished run made with other settings ({differences}): moved to "
          f"{aside.name}, training this one", flush=True)
    return aside
