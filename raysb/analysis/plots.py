"""Figures for `raysb pareto`: the time-vs-error scatter with its frontier, and error-vs-time curves.

Figures are drawn on a bare `matplotlib.figure.Figure` (Agg canvas), never through
pyplot, so plotting works headless and leaves no global backend state behind.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from raysb.analysis.frontier import WALL_CLOCK, WORK_CLOCK, Clock, lower_envelope, order_strategies, pareto_mask
from raysb.core.strategy_table import known_card

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SPARE_COLOURS = ("tab:pink", "tab:olive", "tab:cyan", "black", "gold", "navy")
TIME_LABEL = "wall-clock training time (s)"
CLOCK_LABELS = {WALL_CLOCK: TIME_LABEL, WORK_CLOCK: "work (epochs of training, as --work-budget counts it)"}
# Above this many trials a curves figure's legend names strategies only.
MAX_NAMED_TRIALS = 12
ERROR_LABEL = "test error (%)"


def strategy_colours(strategies: Iterable[str]) -> dict[str, str]:
    """A colour per strategy, in `order_strategies` order: its card's, so that every figure of every report
    agrees, or a spare one (a label, a card without a colour)."""
    spare = itertools.cycle(SPARE_COLOURS)
    colours = {}
    for strategy in order_strategies(strategies):
        card = known_card(strategy)
        colours[strategy] = card.colour if card is not None and card.colour is not None else next(spare)
    return colours


def trial_colours(trials: pd.DataFrame) -> dict[str, tuple[float, float, float]]:
    """A colour per trial: its strategy's, in shades from dark to light where a strategy has several
    trials, so that two runs of one strategy never look like one."""
    from matplotlib.colors import to_rgb

    colours = {}
    for strategy, base in strategy_colours(trials["strategy"]).items():
        own = list(dict.fromkeys(trials.loc[trials["strategy"] == strategy, "trial_id"]))
        for index, trial in enumerate(own):
            # From 30% darker to 45% lighter than the strategy's colour.
            mix = -0.3 + 0.75 * index / (len(own) - 1) if len(own) > 1 else 0.0
            towards = (1.0, 1.0, 1.0) if mix > 0 else (0.0, 0.0, 0.0)
            colours[trial] = tuple(c + abs(mix) * (t - c) for c, t in zip(to_rgb(base), towards))
    return colours


def plot_pareto(points: pd.DataFrame, path: str | Path) -> Path:
    """Every (wall_s, test_error) point faint, the Pareto frontier emphasised and joined by a step line."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    figure = Figure(figsize=(7.5, 4.8))
    axes = figure.subplots()
    colours = strategy_colours(points["strategy"])
    on_frontier = pareto_mask(points["wall_s"], points["test_error"])
    frontier = points.loc[on_frontier].sort_values(["wall_s", "test_error"], kind="stable")
    axes.step(frontier["wall_s"], 100 * frontier["test_error"], where="post", color="black", linewidth=1, zorder=2)
    shades = trial_colours(points)
    for strategy, colour in colours.items():
        own = (points["strategy"] == strategy).to_numpy()
        axes.scatter(points.loc[own, "wall_s"], 100 * points.loc[own, "test_error"],
                     s=18, color=[shades[trial] for trial in points.loc[own, "trial_id"]], alpha=0.25, linewidths=0)
        best = own & on_frontier
        axes.scatter(points.loc[best, "wall_s"], 100 * points.loc[best, "test_error"],
                     s=60, color=colour, edgecolors="black", linewidths=0.8, zorder=3)
    # Legend markers at full alpha: the faint scatter would give faint, hard to read swatches.
    handles = [Line2D([], [], linestyle="", marker="o", color=colour, label=strategy)
               for strategy, colour in colours.items()]
    handles.append(Line2D([], [], color="black", marker="o", markerfacecolor="white",
                          markeredgecolor="black", linewidth=1, label="Pareto frontier"))
    axes.legend(handles=handles, title="strategy")
    axes.set(xlabel=TIME_LABEL, ylabel=ERROR_LABEL,
             title=f"Time vs test error: Pareto frontier ({points['trial_id'].nunique()} trials, "
                   f"{len(points)} evaluated epochs)")
    axes.grid(alpha=0.3)
    return save_figure(figure, path)


def plot_curves(
    trials: pd.DataFrame, path: str | Path, target_errors: Mapping[str, float] | None = None,
    clocks: Sequence[Clock] = (WALL_CLOCK,),
) -> Path:
    """Each trial's error-vs-time curve faint, each strategy's best-so-far envelope bold, a panel per clock
    (wall-clock time, work) side by side.

    `target_errors` maps a label (e.g. "1.1E") to an error fraction drawn as a dashed line.
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.5 * len(clocks), 4.8))
    for axes, clock in zip(figure.subplots(1, len(clocks), squeeze=False)[0], clocks):
        _draw_curves(axes, trials, clock, target_errors or {})
    return save_figure(figure, path)


def _draw_curves(axes: Axes, trials: pd.DataFrame, clock: Clock, target_errors: Mapping[str, float]) -> None:
    ordered = trials.sort_values(["trial_id", "epoch"], kind="stable")
    shades = trial_colours(ordered)
    # Each trial named in the legend while there are few enough to read.
    named = ordered["trial_id"].nunique() <= MAX_NAMED_TRIALS
    for strategy, colour in strategy_colours(trials["strategy"]).items():
        own = ordered.loc[ordered["strategy"] == strategy]
        for trial, curve in own.groupby("trial_id", sort=False):
            axes.plot(curve[clock.column], 100 * curve["test_error"], color=shades[trial], alpha=0.6 if named else 0.3,
                      linewidth=0.8, marker="o", markersize=2, label=trial if named else None)
        times, best = lower_envelope(own[clock.column], own["test_error"])
        count = own["trial_id"].nunique()
        axes.step(times, 100 * best, where="post", color=colour, linewidth=2.2,
                  label=f"{strategy} ({count} trial{'' if count == 1 else 's'})")
    for label, error in target_errors.items():
        axes.axhline(100 * error, color="grey", linestyle="--", linewidth=0.8)
        axes.text(1.005, 100 * error, label, transform=axes.get_yaxis_transform(),
                  va="center", fontsize=8, color="grey")
    axes.legend(title="best error so far")
    axes.set(xlabel=CLOCK_LABELS[clock], ylabel=ERROR_LABEL, title=f"Test error vs {clock.name} per strategy")
    axes.grid(alpha=0.3)


def save_figure(figure: Figure, path: str | Path) -> Path:
    """Write `figure` as a PNG at `path`; shared by every report so all figures look alike."""
    path = Path(path)
    figure.savefig(path, dpi=150, bbox_inches="tight")
    return path
