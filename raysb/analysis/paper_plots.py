"""Figures for `raysb report`, each drawn from exactly the table written beside it as CSV.

Every table has `run` and `strategy` columns; a run's line takes its strategy's colour
(as in `raysb pareto`'s figures) and, where several runs share a strategy, a line style
of its own. Drawn on bare `matplotlib.figure.Figure`s, never through pyplot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from raysb.analysis.paper_figures import PHASES, SIMILARITY_MEASURES
from raysb.analysis.plots import ERROR_LABEL, TIME_LABEL, save_figure, strategy_colours

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LINE_STYLES = ("-", "--", ":", "-.")
PHASE_LABELS = {
    "selection": "selection forward",
    "train_forward": "training forward",
    "backward": "backward + step",
    "train_step": "captured step (forward, backward, step)",
    "data": "data",
    "bookkeeping": "bookkeeping",
    "other": "other",
}
SIMILARITY_LABELS = {"cosine": "cosine similarity", "same_sign": "fraction of components with the same sign"}
SUBSET_LABELS = {"kept": ("SB-kept subset", "-"), "random": ("random subset", "--")}


def run_styles(table: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Per run, in strategy order: color, linestyle and legend label for plotting calls.

    The label is the strategy alone when it has one run here, else "strategy: run".
    """
    pairs = table[["run", "strategy"]].drop_duplicates()
    styles: dict[str, dict[str, Any]] = {}
    for strategy, colour in strategy_colours(pairs["strategy"]).items():
        runs = pairs.loc[pairs["strategy"] == strategy, "run"].tolist()
        for index, run in enumerate(runs):
            label = strategy if len(runs) == 1 else f"{strategy}: {run}"
            styles[run] = {"color": colour, "linestyle": LINE_STYLES[index % len(LINE_STYLES)], "label": label}
    return styles


def plot_loss_cdf(table: pd.DataFrame, path: str | Path) -> Path:
    """Figure 3: per run, the CDF of its loss history (the R losses CDF_R ranks against) at a few epochs."""
    styles = run_styles(table)
    figure, panels = _run_panels(len(styles))
    for axes, (run, style) in zip(panels, styles.items()):
        own = table.loc[table["run"] == run]
        epochs = sorted(own["epoch"].unique())
        for position, epoch in enumerate(epochs):
            curve = own.loc[own["epoch"] == epoch]
            axes.step(curve["loss"], curve["cdf"], where="post", label=f"end of epoch {epoch}",
                      color=_shade(position, len(epochs)))
        axes.set(xlabel="cross-entropy loss", ylabel="fraction of recent losses <= loss", title=style["label"])
        _legend(axes)
    figure.suptitle("Loss history CDF_R at the first, middle and last epoch")
    return save_figure(figure, path)


def plot_selection_probability(table: pd.DataFrame, path: str | Path) -> Path:
    """Figure 15: per run, the selection probability of each tracked example at every decision."""
    from matplotlib.lines import Line2D

    styles = run_styles(table)
    figure, panels = _run_panels(len(styles), columns=2, width=6.4)
    for axes, (run, style) in zip(panels, styles.items()):
        own = table.loc[table["run"] == run].sort_values(["sample_id", "optimizer_step"], kind="stable")
        for sample_id, decisions in own.groupby("sample_id", sort=True):
            line, = axes.plot(decisions["epoch"], decisions["probability"], linewidth=1, label=f"example {sample_id}")
            kept = decisions["kept"].to_numpy(dtype=bool)
            axes.scatter(decisions["epoch"][kept], decisions["probability"][kept], s=14, color=line.get_color())
            axes.scatter(decisions["epoch"][~kept], decisions["probability"][~kept], s=14,
                         facecolors="white", edgecolors=line.get_color())
        handles, _ = axes.get_legend_handles_labels()
        handles += [Line2D([], [], linestyle="", marker="o", color="black", label="kept"),
                    Line2D([], [], linestyle="", marker="o", markerfacecolor="white",
                           markeredgecolor="black", label="not kept")]
        axes.legend(handles=handles, fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        axes.set(xlabel="epoch", ylabel="selection probability", ylim=(-0.03, 1.03), title=style["label"])
        _whole_epochs(axes)
        axes.grid(alpha=0.3)
    figure.suptitle("Selection probability of tracked training examples (one line each)")
    return save_figure(figure, path)


def plot_gradient_similarity(table: pd.DataFrame, path: str | Path) -> Path:
    """Figure 5: similarity of the kept and of a random subset's gradient to the full batch's, per epoch.

    Lines are means over the probe batches, bands their min to max.
    """
    from matplotlib.figure import Figure

    styles = run_styles(table)
    figure = Figure(figsize=(12, 4.4), layout="constrained")
    for axes, measure in zip(figure.subplots(1, len(SIMILARITY_MEASURES)), SIMILARITY_MEASURES):
        for run, style in styles.items():
            for subset, (subset_label, linestyle) in SUBSET_LABELS.items():
                rows = table.loc[(table["run"] == run) & (table["measure"] == measure) & (table["subset"] == subset)]
                rows = rows.sort_values("epoch")
                axes.plot(rows["epoch"], rows["mean"], color=style["color"], linestyle=linestyle, marker="o",
                          markersize=3, label=f"{style['label']}, {subset_label}")
                axes.fill_between(rows["epoch"], rows["min"], rows["max"], color=style["color"], alpha=0.12)
        axes.set(xlabel="epoch", ylabel=SIMILARITY_LABELS[measure], title=SIMILARITY_LABELS[measure])
        _whole_epochs(axes)
        axes.grid(alpha=0.3)
        _legend(axes)
    figure.suptitle("Gradient of a subset vs the full batch's (mean over probe batches, band: min to max)")
    return save_figure(figure, path)


def plot_confidence_percentiles(table: pd.DataFrame, path: str | Path) -> Path:
    """Figure 8: the final model's confidence in the true class at each percentile of the test set."""
    axes, figure = _single_axes()
    for run, style in run_styles(table).items():
        rows = table.loc[table["run"] == run]
        axes.plot(rows["percentile"], 100 * rows["confidence"], **style)
    axes.set(xlabel="percentile of test examples, by confidence in the true class",
             ylabel="confidence in the true class (%)", title="Target confidence by percentile (final model)")
    axes.grid(alpha=0.3)
    _legend(axes)
    return save_figure(figure, path)


def plot_accuracy_percentiles(table: pd.DataFrame, path: str | Path) -> Path:
    """Figure 9: top-1 accuracy of the test examples in each percentile bin of target confidence."""
    axes, figure = _single_axes()
    for run, style in run_styles(table).items():
        rows = table.loc[table["run"] == run]
        axes.plot(rows["percentile"], 100 * rows["accuracy"], marker="o", markersize=2, **style)
    axes.set(xlabel="percentile bin of test examples, by confidence in the true class",
             ylabel="top-1 accuracy in the bin (%)", title="Accuracy by percentile of target confidence (final model)")
    axes.grid(alpha=0.3)
    _legend(axes)
    return save_figure(figure, path)


def plot_selected_examples(table: pd.DataFrame, images: np.ndarray, title: str, path: str | Path) -> Path:
    """Figure 2: one row of images per group of `table` (most kept, least kept), `images` in table order."""
    from matplotlib.figure import Figure

    groups = list(dict.fromkeys(table["group"]))
    columns = int(table["group"].value_counts().max())
    figure = Figure(figsize=(1.5 * columns, 2.0 * len(groups) + 0.4), layout="constrained")
    for subfigure, group in zip(np.atleast_1d(figure.subfigures(len(groups), 1)), groups):
        subfigure.suptitle(f"{group} (kept / times offered)")
        cells = np.atleast_1d(subfigure.subplots(1, columns))
        for cell in cells:
            cell.set_axis_off()
        for cell, position in zip(cells, np.flatnonzero(table["group"].to_numpy() == group)):
            row = table.iloc[position]
            image = images[position].transpose(1, 2, 0)
            cell.imshow(image[:, :, 0] if image.shape[2] == 1 else image, cmap="gray", vmin=0, vmax=255)
            flipped = " (flipped)" if row["flipped"] else ""
            cell.set_title(f"#{row['sample_id']} label {row['label']}{flipped}\nkept {row['kept']}/{row['considered']}",
                           fontsize=7)
    figure.suptitle(title)
    return save_figure(figure, path)


def plot_time_breakdown(table: pd.DataFrame, path: str | Path) -> Path:
    """Figures 1 and 10: per run, a bar of seconds per epoch stacked by phase."""
    from matplotlib import colormaps

    axes, figure = _single_axes(width=max(5.0, 1.2 * len(table) + 3))
    styles = run_styles(table)
    ordered = table.set_index("run").loc[list(styles)]
    positions = np.arange(len(ordered))
    bottom = np.zeros(len(ordered))
    palette = colormaps["tab10"]
    for index, phase in enumerate(PHASES):
        seconds = ordered[f"{phase}_s"].to_numpy(dtype=float)
        axes.bar(positions, seconds, bottom=bottom, color=palette(index), label=PHASE_LABELS[phase])
        bottom += seconds
    axes.set_xticks(positions, [styles[run]["label"] for run in ordered.index], rotation=20, ha="right")
    axes.set(xlabel="run", ylabel="training seconds per epoch", title="Where an epoch's training time goes")
    axes.grid(alpha=0.3, axis="y")
    axes.legend(title="phase", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(figure, path)


def plot_label_noise(table: pd.DataFrame, path: str | Path) -> Path:
    """Figure 12: final test error vs label noise per strategy, and how often selection keeps flipped examples."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.4), layout="constrained")
    error_axes, share_axes = figure.subplots(1, 2, sharex=True)
    colours = strategy_colours(table["strategy"])
    shares = table.dropna(subset=["flipped_share_of_kept"])
    for strategy, colour in colours.items():
        own = table.loc[table["strategy"] == strategy]
        _mean_line(error_axes, own, "label_noise", "final_test_error", colour, strategy, x_scale=100, y_scale=100)
        own_shares = shares.loc[shares["strategy"] == strategy]
        if not own_shares.empty:
            _mean_line(share_axes, own_shares, "label_noise", "flipped_share_of_kept", colour,
                       f"{strategy}: share of kept", x_scale=100, y_scale=100)
    error_axes.set(xlabel="label noise (% of training labels flipped)", ylabel="final " + ERROR_LABEL,
                   title="Final test error vs label noise")
    if shares.empty:
        share_axes.text(0.5, 0.5, "no selecting run with label noise\nand selection_counts.parquet",
                        ha="center", va="center", transform=share_axes.transAxes)
    else:
        data_share = shares.groupby("label_noise")["flipped_share_of_data"].mean()
        share_axes.plot(100 * data_share.index, 100 * data_share.to_numpy(), color="black", linestyle="--",
                        marker="x", label="share of examples flipped")
    share_axes.set(xlabel="label noise (% of training labels flipped)", ylabel="examples with a flipped label (%)",
                   title="Flipped examples: share of keeps vs share of data")
    for axes in (error_axes, share_axes):
        axes.grid(alpha=0.3)
        _legend(axes)
    return save_figure(figure, path)


def plot_selectivity(table: pd.DataFrame, strategy: str, path: str | Path) -> Path:
    """Figure 13: a strategy's error-vs-time curve per selectivity, and its final error and time vs selectivity."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 4.4), layout="constrained")
    curve_axes, error_axes, time_axes = figure.subplots(1, 3)
    selectivities = sorted(table["selectivity"].unique())
    labelled = set()
    for run, curve in table.sort_values(["run", "epoch"], kind="stable").groupby("run", sort=False):
        selectivity = curve["selectivity"].iloc[0]
        label = None if selectivity in labelled else f"selectivity {selectivity:.3g}"
        labelled.add(selectivity)
        curve_axes.plot(curve["wall_s"], 100 * curve["test_error"], marker="o", markersize=2, label=label,
                        color=_shade(selectivities.index(selectivity), len(selectivities)))
    curve_axes.set(xlabel=TIME_LABEL, ylabel=ERROR_LABEL, title=f"{strategy} test error vs time per selectivity")
    finals = table.loc[table["final"]]
    colour = strategy_colours([strategy])[strategy]
    _mean_line(error_axes, finals, "selectivity", "test_error", colour, "final error", y_scale=100)
    error_axes.set(xlabel="selectivity (expected kept fraction)", ylabel="final " + ERROR_LABEL,
                   title="Final test error vs selectivity")
    _mean_line(time_axes, finals, "selectivity", "wall_s", colour, "training time")
    time_axes.set(xlabel="selectivity (expected kept fraction)", ylabel=TIME_LABEL,
                  title="Training time vs selectivity")
    for axes in (curve_axes, error_axes, time_axes):
        axes.grid(alpha=0.3)
    _legend(curve_axes)
    return save_figure(figure, path)


def _mean_line(
    axes: Axes, rows: pd.DataFrame, x: str, y: str, colour: str, label: str, x_scale: float = 1, y_scale: float = 1
) -> None:
    """Every row as a faint point (runs differing only in seed), joined by a line through the mean at each x.

    The scales turn fractions into the percent the axis labels promise.
    """
    axes.scatter(x_scale * rows[x], y_scale * rows[y], color=colour, alpha=0.35, s=16, linewidths=0)
    means = rows.groupby(x)[y].mean()
    axes.plot(x_scale * means.index, y_scale * means.to_numpy(), color=colour, marker="o", label=label)


def _run_panels(count: int, columns: int = 3, width: float = 4.8) -> tuple[Figure, Sequence[Axes]]:
    from matplotlib.figure import Figure

    columns = min(columns, count)
    rows = math.ceil(count / columns)
    figure = Figure(figsize=(width * columns, 3.8 * rows), layout="constrained")
    panels = figure.subplots(rows, columns, squeeze=False).ravel()
    for unused in panels[count:]:
        unused.set_visible(False)
    return figure, panels[:count]


def _single_axes(width: float = 7.5) -> tuple[Axes, Figure]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, 4.8), layout="constrained")
    return figure.subplots(), figure


def _shade(position: int, count: int) -> tuple[float, ...]:
    """Ordered series (epochs, selectivities) in viridis, earliest dark, so their order reads off the colour."""
    from matplotlib import colormaps

    return colormaps["viridis"](0.85 * position / max(count - 1, 1))


def _whole_epochs(axes: Axes) -> None:
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))


def _legend(axes: Axes) -> None:
    """A legend only where it tells series apart."""
    if len(axes.get_legend_handles_labels()[1]) > 1:
        axes.legend(fontsize=8)
