"""The files `raysb report` writes: the paper's figures from `raysb train` runs, each PNG
with the table it was drawn from as CSV, and report.md with a section per figure.

A figure the runs cannot support (no sb run, one label_noise value, no trace files)
is skipped with its reason, in report.md and in `RunReport.skipped`; a run one figure
cannot use is left out of it, and the section says why.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import pandas as pd
import torch

from raysb.analysis import AnalysisError
from raysb.analysis.frontier import DEFAULT_TARGETS, WORK_CLOCK, baseline_error, order_strategies, target_label
from raysb.analysis.paper_figures import (
    PHASES,
    accuracy_by_percentile,
    confidence_percentiles,
    empirical_cdf,
    flipped_shares,
    probability_fluctuation,
    seconds_per_epoch,
    selection_extremes,
    similarity_by_epoch,
    snapshot_epochs,
    target_confidence,
)
from raysb.analysis.paper_plots import (
    plot_accuracy_percentiles,
    plot_confidence_percentiles,
    plot_gradient_similarity,
    plot_label_noise,
    plot_loss_cdf,
    plot_selected_examples,
    plot_selection_probability,
    plot_selectivity,
    plot_time_breakdown,
)
from raysb.analysis.label_plots import plot_doubted_examples, plot_margin_histogram
from raysb.analysis.plots import plot_curves
from raysb.analysis.report import BASELINE, percent, speedup_cell
from raysb.analysis.runs import (
    GRADIENT_SIMILARITY_FILE,
    LOSS_CDF_FILE,
    MODEL_FILE,
    SELECTION_COUNTS_FILE,
    TRACKED_EXAMPLES_FILE,
    RebuiltRuns,
    Run,
    Unavailable,
    load_runs,
)
from raysb.analysis.work import clocks, data_warning, speed_warning, speedups, trial_work, with_work, work_notes
from raysb.core.strategy_table import STRATEGIES, known_card, strategies_keeping_margins
from raysb.training.builders import resolve_device
from raysb.training.label_suspects import SUSPECTS_FILE

REPORT_FILE = "report.md"


def _either(names: list[str]) -> str:
    """`names` as a sentence offers them: "a", "a or b", "a, b or c"."""
    return " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"


# The built-in strategies whose runs record the CDF history, the gradient probes and the tracked decisions.
CDF_RUN = f"an {_either([name for name, card in STRATEGIES.items() if card.cdf_report])} run"
# The built-in strategies whose runs keep margins, and so write label_suspects.parquet (their cards say so).
MARGINS_RUN = f"a run that keeps margins ({_either(strategies_keeping_margins())})"
EXAMPLES_PER_GROUP = 8
# The percentile the paper quotes for Figures 8 and 9.
QUOTED_PERCENTILE = 20

T = TypeVar("T")


@dataclass(frozen=True)
class Chart:
    stem: str
    table: pd.DataFrame
    # Draws `table` to the given PNG path.
    draw: Callable[[Path], Path]


@dataclass(frozen=True)
class Section:
    shows: str
    charts: list[Chart]
    numbers: list[str]
    # "run: reason" for each run this figure could not use.
    left_out: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RunReport:
    written: dict[str, Path]
    # Figure title -> why the runs could not support it.
    skipped: dict[str, str]
    # Lines the reader must not miss (the runs' speeds differ: their times measure the machine).
    warnings: list[str]


def write_run_report(
    run_dirs: Sequence[str | Path], out_dir: str | Path, device: torch.device | None = None
) -> RunReport:
    """Write every figure the runs in `run_dirs` support, their CSVs and report.md, into `out_dir`.

    `device` evaluates the runs' final models (default: a GPU if there is one).
    AnalysisError for a folder that is not a run with metrics, before anything is written.
    """
    runs = load_runs(run_dirs)
    rebuilt = RebuiltRuns(device or resolve_device("auto"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    trials = _trials(runs)
    work = trial_work(trials)
    warnings = [warning for warning in (data_warning(trials), speed_warning(work)) if warning]
    blocks = [runs_markdown(runs, work, warnings)]
    for title, build in SECTIONS:
        try:
            section = build(runs, rebuilt)
        except Unavailable as why:
            skipped[title] = str(why)
            blocks.append(f"## {title}\n\nSkipped: {why}.\n")
            continue
        for chart in section.charts:
            written[f"{chart.stem}.csv"] = out / f"{chart.stem}.csv"
            chart.table.to_csv(written[f"{chart.stem}.csv"], index=False)
            written[f"{chart.stem}.png"] = chart.draw(out / f"{chart.stem}.png")
        blocks.append(section_markdown(title, section))
    written[REPORT_FILE] = out / REPORT_FILE
    written[REPORT_FILE].write_text("\n".join(blocks))
    return RunReport(written, skipped, warnings)


def runs_markdown(runs: Sequence[Run], work: pd.DataFrame, warnings: Sequence[str]) -> str:
    """The runs the report covers, so the run names in its sections can be looked up, with what each did
    in its training time (`work`: raysb.analysis.work.trial_work of the runs)."""
    lines = [
        "# Selective-Backprop report",
        "",
        "| run | strategy | selectivity | label noise | evaluated epochs | final test error | training time "
        "| work (epochs) | examples a second |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    worked = with_work(_trials(runs), work).groupby("trial_id", sort=False)[WORK_CLOCK.column].last()
    for run in runs:
        last = run.metrics.iloc[-1]
        lines.append(
            f"| `{run.name}` | {run.strategy} | {run.selectivity:.3g} | {percent(run.label_noise, 1)} "
            f"| {int(last['epoch'])} | {percent(float(last['test_error']))} | {last['wall_s']:.3g} s "
            f"| {_number(worked[run.name], '.3g')} | {_number(work.loc[run.name, 'examples_per_s'], ',.0f')} |"
        )
    lines += [
        "",
        "Work: the examples a run trained plus those it scored weighted by its scoring_cost, as `--work-budget` "
        "counts them, in epochs of its training set; examples a second: that count per second of training.",
    ]
    for warning in warnings:
        lines += ["", warning]
    return "\n".join(lines) + "\n"


def section_markdown(title: str, section: Section) -> str:
    lines = [f"## {title}", "", section.shows, ""]
    lines += [f"- {number}" for number in section.numbers]
    for chart in section.charts:
        lines += ["", f"![{chart.stem}]({chart.stem}.png)", "", f"Data: [{chart.stem}.csv]({chart.stem}.csv)."]
    if section.left_out:
        lines += ["", "Left out: " + "; ".join(section.left_out) + "."]
    return "\n".join(lines) + "\n"


# -- sections, one per figure ------------------------------------------------------


def selected_examples_section(runs: Sequence[Run], rebuilt: RebuiltRuns) -> Section:
    selecting = [run for run in runs if _selects(run.strategy)]
    if not selecting:
        keeping_all = [name for name, card in STRATEGIES.items() if not card.selects]
        raise Unavailable(f"needs a selecting run ({' and '.join(keeping_all)} keeps every example)")

    def chart(run: Run) -> Chart:
        extremes = selection_extremes(run.trace(SELECTION_COUNTS_FILE), EXAMPLES_PER_GROUP)
        if extremes.empty:
            raise Unavailable(f"fewer than two examples offered in {SELECTION_COUNTS_FILE}")
        images, labels = rebuilt.training_examples(run, extremes["sample_id"].to_numpy())
        flipped = extremes["sample_id"].isin(run.summary.get("label_noise_flipped_ids", []))
        table = _tagged(extremes.assign(label=labels, flipped=flipped.to_numpy()), run)
        title = f"Most and least often kept training examples ({run.strategy}, {run.name})"
        draw = partial(plot_selected_examples, table, images, title)
        return Chart(f"selected_examples_{_slug(run.name)}", table, draw)

    charts, left_out = _per_run(selecting, chart)
    _require(charts, left_out, f"needs a selecting run with {SELECTION_COUNTS_FILE} and its dataset on this machine")
    return Section(
        "Training examples each selecting run kept most and least often per time it was offered "
        "(kept / considered from selection_counts.parquet, images and training labels rebuilt from the config).",
        charts,
        [_extremes_numbers(chart.table) for chart in charts],
        left_out + _keeps_every_example_note(runs),
    )


def loss_cdf_section(runs: Sequence[Run], rebuilt: RebuiltRuns) -> Section:
    def table(run: Run) -> pd.DataFrame:
        history = run.trace(LOSS_CDF_FILE)
        return _tagged(empirical_cdf(history, snapshot_epochs(history["epoch"])), run)

    tables, left_out = _per_run(_cdf_runs(runs), table)
    data = _concat(tables, left_out, f"needs {CDF_RUN} with {LOSS_CDF_FILE}")
    medians = data.groupby(["run", "epoch"], sort=False)["loss"].median()
    spans = []
    for run, run_medians in medians.groupby(level="run", sort=False):
        epochs = run_medians.index.get_level_values("epoch")
        spans.append(f"`{run}` {run_medians.iloc[0]:.3g} (epoch {epochs[0]}) to {run_medians.iloc[-1]:.3g} "
                     f"(epoch {epochs[-1]})")
    return Section(
        "Empirical CDF of the R recent losses that CDF_R ranks each new loss against, at the end of the "
        "first, middle and last recorded epoch: a loss's selection probability is its height here to the beta "
        "(at full selection strength; a selection-strength schedule mixes it with a uniform draw).",
        [Chart("loss_cdf", data, partial(plot_loss_cdf, data))],
        ["median loss in the history: " + "; ".join(spans)],
        left_out,
    )


def gradient_similarity_section(runs: Sequence[Run], rebuilt: RebuiltRuns) -> Section:
    tables, left_out = _per_run(
        _cdf_runs(runs), lambda run: _tagged(similarity_by_epoch(run.trace(GRADIENT_SIMILARITY_FILE)), run)
    )
    data = _concat(tables, left_out, f"needs {CDF_RUN} with {GRADIENT_SIMILARITY_FILE}")
    numbers = []
    for measure, name in (("cosine", "cosine similarity"), ("same_sign", "same-sign fraction")):
        means = _after_first_epoch(data.loc[data["measure"] == measure]).groupby(["run", "subset"])["mean"].mean()
        numbers.append(f"{name} to the full-batch gradient, mean over epochs after the first: " + "; ".join(
            f"`{run}` kept {means.get((run, 'kept'), math.nan):.3f} "
            f"vs random {means.get((run, 'random'), math.nan):.3f}"
            for run in data["run"].unique()
        ))
    cosine = data.loc[data["measure"] == "cosine"].pivot_table(index=["run", "epoch"], columns="subset", values="mean")
    wins = (cosine["kept"] > cosine["random"]).groupby(level="run", sort=False).agg(["sum", "size"])
    numbers.append("epochs where the kept subset's cosine beats random: " + "; ".join(
        f"`{run}` {row['sum']} of {row['size']}" for run, row in wins.iterrows()
    ))
    return Section(
        "How well the gradient of SB's kept examples of a batch, and of a random subset of the same size, "
        "point like the gradient of the whole batch, on fixed probe batches after each evaluated epoch.",
        [Chart("gradient_similarity", data, partial(plot_gradient_similarity, data))],
        numbers,
        left_out,
    )


def confidence_section(runs: Sequence[Run], rebuilt: RebuiltRuns) -> Section:
    def table(run: Run) -> pd.DataFrame:
        confidence, _ = target_confidence(*rebuilt.test_predictions(run))
        return _tagged(confidence_percentiles(confidence), run)

    tables, left_out = _per_run(runs, table)
    data = _concat(tables, left_out, f"needs a run with {MODEL_FILE} and its dataset on this machine")
    numbers = [
        f"confidence in the true class at the {p}th percentile: " + _per_run_values(
            data.loc[data["percentile"] == p], "confidence", lambda value: percent(value, 1)
        )
        for p in (QUOTED_PERCENTILE, 50)
    ]
    return Section(
        "The final model's softmax confidence in the true class of each test example, sorted: the "
        "confidence at each percentile of the test set (an inverse CDF).",
        [Chart("confidence_percentiles", data, partial(plot_confidence_percentiles, data))],
        numbers,
        left_out,
    )


def accuracy_section(runs: Sequence[Run], rebuilt: RebuiltRuns) -> Section:
    def table(run: Run) -> pd.DataFrame:
        return _tagged(accuracy_by_percentile(*target_confidence(*rebuilt.test_predictions(run))), run)

    tables, left_out = _per_run(runs, table)
    data = _concat(tables, left_out, f"needs a run with {MODEL_FILE} and its dataset on this machine")
    hits = (data["examples"] * data["accuracy"].fillna(0)).groupby(data["run"], sort=False).sum()
    overall = hits / data.groupby("run", sort=False)["examples"].sum()
    return Section(
        "Test examples ranked by the final model's confidence in their true class and cut into 100 "
        "percentile bins; the share of each bin the model classifies correctly (top-1).",
        [Chart("accuracy_percentiles", data, partial(plot_accuracy_percentiles, data))],
        [
            f"accuracy in the {QUOTED_PERCENTILE}th-percentile bin: " + _per_run_values(
                data.loc[data["percentile"] == QUOTED_PERCENTILE], "accuracy", lambda value: percent(value, 1)
            ),
            "test accuracy over all bins: " + "; ".join(f"`{run}` {percent(value)}" for run, value in overall.items()),
        ],
        left_out,
    )


def time_to_target_section(runs: Sequence[Run], rebuilt: RebuiltRuns) -> Section:
    strategies = order_strategies(run.strategy for run in runs)
    if strategies == [BASELINE]:
        raise Unavailable(f"needs a run of another strategy than {BASELINE} to compare")
    work = trial_work(_trials(runs))
    trials = with_work(_trials(runs), work)
    try:
        best_error, best_run = baseline_error(trials, BASELINE)
    except AnalysisError:
        raise Unavailable(f"needs a {BASELINE} run to measure against (found only {', '.join(strategies)})") from None
    table = speedups(trials, DEFAULT_TARGETS, BASELINE)
    counted = clocks(work)
    labels = [target_label(m) for m in DEFAULT_TARGETS]
    numbers = [f"E = {percent(best_error)}, the lowest final test error of a {BASELINE} run (`{best_run}`)"]
    numbers += [
        f"{row['strategy']} reaches " + "; ".join(
            f"{label} {speedup_cell([row[clock.speedup.format(label)] for clock in counted])}" for label in labels
        ) + f" sooner than {BASELINE}"
        for row in table.to_dict("records") if row["strategy"] != BASELINE
    ]
    target_errors = {label: m * best_error for label, m in zip(labels, DEFAULT_TARGETS)}
    return Section(
        f"How many times sooner than {BASELINE} each strategy's fastest run first reaches test error m × E, in "
        "training wall-clock time and, in brackets, in work (the examples it trained plus those it scored "
        "weighted by its scoring_cost, as `--work-budget` counts them, which the machine's load does not move); "
        "– where it never does. The table has each target's times, speedups and fastest run in both; the figure "
        "draws the curves they are read from.",
        [Chart("time_to_target", table, partial(plot_curves, trials, target_errors=target_errors, clocks=counted))],
        numbers + work_notes(work),
    )


def time_breakdown_section(runs: Sequence[Run], rebuilt: RebuiltRuns) -> Section:
    def row(run: Run) -> dict:
        breakdown, epochs = run.summary.get("time_breakdown_s"), run.summary.get("epochs_completed")
        if not isinstance(breakdown, dict) or not epochs:
            raise Unavailable("no time_breakdown_s and epochs_completed in summary.json")
        per_epoch = seconds_per_epoch(breakdown, int(epochs))
        return {"run": run.name, "strategy": run.strategy, "epochs": int(epochs),
                **{f"{phase}_s": seconds for phase, seconds in per_epoch.items()},
                "total_s": sum(per_epoch.values())}

    rows, left_out = _per_run(runs, row)
    _require(rows, left_out, "needs a run whose summary.json has time_breakdown_s")
    data = pd.DataFrame(rows)
    by_strategy = data.groupby("strategy", sort=False)[["total_s", "backward_s", "selection_s"]].mean()
    numbers = ["training seconds per epoch (mean over a strategy's runs): " + "; ".join(
        f"{strategy} {row['total_s']:.3g} s (backward {row['backward_s']:.3g} s, selection forward "
        f"{row['selection_s']:.3g} s)" for strategy, row in by_strategy.iterrows()
    )]
    if "traditional" in by_strategy.index and len(by_strategy) > 1:
        baseline = by_strategy.loc["traditional"]
        others = by_strategy.drop(index="traditional")
        numbers.append("per epoch relative to traditional: " + "; ".join(
            f"{strategy} backward {row['backward_s'] / baseline['backward_s']:.2f}x, "
            f"total {row['total_s'] / baseline['total_s']:.2f}x" for strategy, row in others.iterrows()
        ))
    return Section(
        "Training wall-clock per epoch split by phase (summary.json's time_breakdown_s over the epochs "
        f"completed; evaluation excluded): {', '.join(PHASES)}.",
        [Chart("time_breakdown", data, partial(plot_time_breakdown, data))],
        numbers,
        left_out,
    )


def label_noise_section(runs: Sequence[Run], rebuilt: RebuiltRuns) -> Section:
    compared, left_out = _one_selectivity_per_strategy(runs)
    levels = sorted({run.label_noise for run in compared})
    if len(levels) < 2:
        raise _lacking(f"needs runs with at least two label_noise values (found {_listed(levels)})", left_out)
    rows = []
    for run in compared:
        kept_share = data_share = math.nan
        if _selects(run.strategy) and run.label_noise > 0:
            try:
                kept_share, data_share = _flipped_shares(run)
            except Unavailable as why:
                left_out.append(f"`{run.name}` (flipped shares only): {why}")
        rows.append({"run": run.name, "strategy": run.strategy, "label_noise": run.label_noise,
                     "final_test_error": float(run.metrics["test_error"].iloc[-1]),
                     "flipped_share_of_kept": kept_share, "flipped_share_of_data": data_share})
    data = pd.DataFrame(rows)
    errors = data.groupby(["strategy", "label_noise"], sort=False)["final_test_error"].mean()
    numbers = [f"final test error (mean over runs), label noise {percent(levels[0], 0)} to "
               f"{percent(levels[-1], 0)}: " + "; ".join(
                   f"{strategy} {_at(errors, strategy, levels[0])} to {_at(errors, strategy, levels[-1])}"
                   for strategy in data["strategy"].unique())]
    shares = data.dropna(subset=["flipped_share_of_kept"])
    if not shares.empty:
        top = shares.loc[shares["label_noise"] == shares["label_noise"].max()]
        means = top.groupby("strategy", sort=False)[["flipped_share_of_kept", "flipped_share_of_data"]].mean()
        numbers.append(f"at label noise {percent(top['label_noise'].iloc[0], 0)}, flipped examples' share of "
                       "keeps vs of the data: " + "; ".join(
                           f"{strategy} {percent(row['flipped_share_of_kept'], 1)} vs "
                           f"{percent(row['flipped_share_of_data'], 1)}" for strategy, row in means.iterrows()))
    return Section(
        "Final test error against the fraction of training labels flipped, per strategy (a selecting "
        "strategy at one selectivity); and for the selecting strategies, the share of all keeps that went "
        "to flipped examples against the share of examples flipped (selection_counts.parquet and "
        "summary.json's label_noise_flipped_ids).",
        [Chart("label_noise", data, partial(plot_label_noise, data))],
        numbers,
        left_out,
    )


def selectivity_section(runs: Sequence[Run], rebuilt: RebuiltRuns) -> Section:
    """A chart for each strategy that reads a selectivity and has runs at two or more of them."""
    charts, numbers, left_out, found = [], [], [], {}
    for strategy in order_strategies(run.strategy for run in runs):
        card = known_card(strategy)
        if card is None or "selectivity" not in card.settings:
            continue
        own = [run for run in runs if run.strategy == strategy]
        # Only selectivity may vary: runs of a label-noise sweep compare at the cleanest labels.
        cleanest = min(run.label_noise for run in own)
        left_out += [f"`{run.name}`: label noise {run.label_noise:g}, the others {cleanest:g}"
                     for run in own if run.label_noise != cleanest]
        own = [run for run in own if run.label_noise == cleanest]
        found[strategy] = sorted({run.selectivity for run in own})
        if len(found[strategy]) < 2:
            continue
        chart, lines = _selectivity_chart(strategy, own)
        charts.append(chart)
        numbers += lines
    if not charts:
        values = "; ".join(f"{strategy} {_listed(values)}" for strategy, values in found.items()) or "none"
        raise _lacking(f"needs runs of one strategy at two or more selectivity values (found {values})", left_out)
    return Section(
        "The runs of each strategy (at the lowest label noise among them) at each selectivity, the expected kept "
        "fraction: test error against training wall-clock, and final error and training time against it.",
        charts,
        numbers,
        left_out,
    )


def _selectivity_chart(strategy: str, runs: Sequence[Run]) -> tuple[Chart, list[str]]:
    curves = []
    for run in runs:
        curve = run.metrics[["epoch", "wall_s", "test_error"]].assign(selectivity=run.selectivity, final=False)
        curve.loc[curve.index[-1], "final"] = True
        curves.append(_tagged(curve, run))
    data = pd.concat(curves, ignore_index=True)
    finals = data.loc[data["final"]].groupby("selectivity")[["test_error", "wall_s"]].mean()
    best = finals["test_error"].idxmin()
    stem = f"selectivity_{_slug(strategy)}"
    return Chart(stem, data, partial(plot_selectivity, data, strategy)), [
        f"{strategy}: final test error and training time (mean over runs): " + "; ".join(
            f"selectivity {s:.3g}: {percent(row['test_error'])} in {row['wall_s']:.3g} s"
            for s, row in finals.iterrows()
        ),
        f"{strategy}: lowest final error at selectivity {best:.3g}",
    ]


def selection_probability_section(runs: Sequence[Run], rebuilt: RebuiltRuns) -> Section:
    def table(run: Run) -> pd.DataFrame:
        return _tagged(run.trace(TRACKED_EXAMPLES_FILE).sort_values(["sample_id", "optimizer_step"], kind="stable"), run)

    tables, left_out = _per_run(_cdf_runs(runs), table)
    data = _concat(tables, left_out, f"needs {CDF_RUN} with {TRACKED_EXAMPLES_FILE}")
    fluctuation = {run: probability_fluctuation(rows) for run, rows in data.groupby("run", sort=False)}
    kept = data.groupby("run", sort=False)["kept"].mean()
    return Section(
        "The selection probability (CDF_R(loss)^beta, mixed with a uniform draw under a selection-strength "
        "schedule) of a fixed set of tracked training examples at every "
        "decision (filled markers: kept); how much an example's importance moves during training.",
        [Chart("selection_probability", data, partial(plot_selection_probability, data))],
        [
            "standard deviation of an example's probability over training (mean over tracked examples): "
            + "; ".join(f"`{run}` {value:.3f}" for run, value in fluctuation.items()),
            "share of tracked decisions kept: "
            + "; ".join(f"`{run}` {percent(value, 1)}" for run, value in kept.items()),
        ],
        left_out,
    )


def label_suspects_section(runs: Sequence[Run], rebuilt: RebuiltRuns) -> Section:
    def charts(run: Run) -> tuple[list[Chart], str]:
        histogram = run.summary.get("label_margin_histogram")
        if histogram is None or not (run.folder / SUSPECTS_FILE).is_file():
            raise Unavailable(f"no {SUSPECTS_FILE} ({run.strategy} keeps no margins, or the run has not ended)")
        edges = histogram["edges"]
        bins = _tagged(pd.DataFrame({"left": edges[:-1], "right": edges[1:], "count": histogram["counts"],
                                     "flipped": histogram["flipped_counts"]}), run)
        stem = _slug(run.name)
        charts = [Chart(f"label_margins_{stem}", bins, partial(
            plot_margin_histogram, bins, f"Running margins of the trained examples ({run.strategy}, {run.name})"))]
        doubted = pd.read_parquet(run.folder / SUSPECTS_FILE)
        flipped = set(run.summary.get("label_noise_flipped_ids", []))
        number = (f"`{run.name}`: {len(doubted):,} doubted, wrong labels estimated at "
                  f"{percent(run.summary['suspected_label_share'])}")
        if flipped:
            found = int(doubted["sample_id"].isin(flipped).sum())
            number += (f"; of the {len(flipped):,} labels its label noise flipped, {found:,} doubted "
                       f"(precision {percent(found / len(doubted) if len(doubted) else math.nan)}, "
                       f"recall {percent(found / len(flipped))})")
        if len(doubted):
            most = _tagged(doubted.head(EXAMPLES_PER_GROUP), run)
            images, _ = rebuilt.training_examples(run, most["sample_id"].to_numpy())
            charts.append(Chart(f"label_suspects_{stem}", most, partial(
                plot_doubted_examples, most, images, f"The most doubted labels ({run.name})")))
        return charts, number

    results, left_out = _per_run(runs, charts)
    _require(results, left_out, f"needs {MARGINS_RUN} with {SUSPECTS_FILE}")
    return Section(
        "Which labels each run doubts: an example the model persistently disagrees with (its running margin, "
        "the given label's logit less the largest other over its recent trainings, below 0) is suspected of a "
        f"wrong label; {SUSPECTS_FILE} ranks them, and `raysb train --exclude-samples` leaves them out of a "
        "next run.",
        [chart for charts, _ in results for chart in charts],
        [number for _, number in results],
        left_out,
    )


SECTIONS: tuple[tuple[str, Callable[[Sequence[Run], RebuiltRuns], Section]], ...] = (
    ("Most and least selected examples (Figure 2)", selected_examples_section),
    ("Loss CDF (Figure 3)", loss_cdf_section),
    ("Gradient similarity (Figure 5)", gradient_similarity_section),
    ("Confidence percentiles (Figure 8)", confidence_section),
    ("Accuracy percentiles (Figure 9)", accuracy_section),
    ("Time to target (Table 1)", time_to_target_section),
    ("Time breakdown (Figures 1 and 10)", time_breakdown_section),
    ("Label-noise sensitivity (Figure 12)", label_noise_section),
    ("Selectivity sensitivity (Figure 13)", selectivity_section),
    ("Selection probability over time (Figure 15)", selection_probability_section),
    ("Labels the run doubts", label_suspects_section),
)


# -- helpers -------------------------------------------------------------------------


def _trials(runs: Sequence[Run]) -> pd.DataFrame:
    """Every run's evaluated epochs in one table, as `raysb pareto` reads them."""
    return pd.concat([run.metrics for run in runs], ignore_index=True)


def _number(value: float, spec: str) -> str:
    return "–" if math.isnan(value) else format(value, spec)


def _per_run(runs: Sequence[Run], compute: Callable[[Run], T]) -> tuple[list[T], list[str]]:
    """`compute` for each run; a run it raises Unavailable for becomes a "run: reason" note instead."""
    results, left_out = [], []
    for run in runs:
        try:
            results.append(compute(run))
        except Unavailable as why:
            left_out.append(f"`{run.name}`: {why}")
    return results, left_out


def _require(results: list, left_out: list[str], need: str) -> None:
    if not results:
        raise _lacking(need, left_out)


def _lacking(need: str, left_out: list[str]) -> Unavailable:
    """Why a figure is skipped: what it needs, and why each run that might have served did not."""
    return Unavailable(need + (f"; left out {'; '.join(left_out)}" if left_out else ""))


def _concat(tables: list[pd.DataFrame], left_out: list[str], need: str) -> pd.DataFrame:
    _require(tables, left_out, need)
    return pd.concat(tables, ignore_index=True)


def _cdf_runs(runs: Sequence[Run]) -> list[Run]:
    found = [run for run in runs if _draws_cdf(run.strategy)]
    if not found:
        strategies = sorted({run.strategy for run in runs})
        raise Unavailable(f"needs {CDF_RUN} (found only {', '.join(strategies)})")
    return found


def _draws_cdf(strategy: str) -> bool:
    card = known_card(strategy)
    return card is not None and card.cdf_report


def _tagged(table: pd.DataFrame, run: Run) -> pd.DataFrame:
    """`table` with the run's name and strategy as its first columns, as every CSV of the report has them."""
    return table.assign(run=run.name, strategy=run.strategy)[["run", "strategy", *table.columns]]


def _one_selectivity_per_strategy(runs: Sequence[Run]) -> tuple[list[Run], list[str]]:
    """For the label-noise figure, where only the noise may vary along a strategy's line: each
    selecting strategy's runs at the selectivity that has the most label_noise values (ties: the
    lowest), and "run: reason" for the rest. All the runs count of a strategy that reads no
    selectivity (Traditional, InfoBatch).
    """
    compared, left_out = [], []
    for strategy in order_strategies(run.strategy for run in runs):
        own = [run for run in runs if run.strategy == strategy]
        card = known_card(strategy)
        if card is not None and "selectivity" not in card.settings:
            compared += own
            continue
        levels: dict[float, set[float]] = {}
        for run in own:
            levels.setdefault(run.selectivity, set()).add(run.label_noise)
        chosen = max(sorted(levels), key=lambda selectivity: len(levels[selectivity]))
        compared += [run for run in own if run.selectivity == chosen]
        left_out += [f"`{run.name}`: selectivity {run.selectivity:.3g}, the other {strategy} runs {chosen:.3g}"
                     for run in own if run.selectivity != chosen]
    return compared, left_out


def _extremes_numbers(table: pd.DataFrame) -> str:
    groups = table.groupby("group", sort=False)
    ratios, flipped = groups["kept_ratio"].mean(), groups["flipped"].sum()
    line = (f"`{table['run'].iloc[0]}`: mean kept/offered of the {len(table) // 2} most kept "
            f"{percent(ratios['most kept'], 0)}, of the least kept {percent(ratios['least kept'], 0)}")
    if (table["kept_ratio"] > 1).any():
        # Only a strategy that draws with replacement keeps an example more often than it was offered.
        line += (f" ({table['strategy'].iloc[0]} samples with replacement, so an example can be trained more "
                 "than once per offer)")
    if table["flipped"].any():
        line += f"; flipped labels among the most kept: {flipped['most kept']}, the least kept: {flipped['least kept']}"
    return line


def _flipped_shares(run: Run) -> tuple[float, float]:
    flipped_ids = run.summary.get("label_noise_flipped_ids")
    if flipped_ids is None:
        raise Unavailable("no label_noise_flipped_ids in summary.json")
    return flipped_shares(run.trace(SELECTION_COUNTS_FILE), flipped_ids)


def _after_first_epoch(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows past each run's first epoch, where SB's history is warm (all rows if a run has one epoch)."""
    first = rows.groupby("run")["epoch"].transform("min")
    last = rows.groupby("run")["epoch"].transform("max")
    return rows.loc[(rows["epoch"] > first) | (first == last)]


def _per_run_values(rows: pd.DataFrame, column: str, fmt: Callable[[float], str]) -> str:
    return "; ".join(f"`{run}` {fmt(value)}" for run, value in zip(rows["run"], rows[column]))


def _at(errors: pd.Series, strategy: str, level: float) -> str:
    return percent(errors[strategy, level]) if (strategy, level) in errors.index else "–"


def _keeps_every_example_note(runs: Sequence[Run]) -> list[str]:
    return [f"`{run.name}`: {run.strategy} keeps every example" for run in runs if not _selects(run.strategy)]


def _listed(values: Sequence[float]) -> str:
    return ", ".join(f"{value:g}" for value in values) or "none"


def _slug(name: str) -> str:
    """A run name as a file-name part: sweep trial names qualified as parent/name lose the slash."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def _selects(strategy: str) -> bool:
    """Whether `strategy`'s runs keep a subset (its card's `selects`); a run without a card is taken to."""
    card = known_card(strategy)
    return card is None or card.selects
