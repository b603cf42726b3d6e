"""The figures of a run's labels for `raysb report`: its running margins' histogram, and the examples it
doubts most with the label each was given and the label the model gave it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from raysb.analysis.plots import save_figure


def plot_margin_histogram(table: pd.DataFrame, title: str, path: str | Path) -> Path:
    """Bars of `table`'s counts over its bins (left, right edges), the run's own flipped labels' share
    drawn over them where it flipped any, and the cut at 0 below which an example is doubted."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.5, 4.2), layout="constrained")
    axes = figure.subplots()
    widths = table["right"] - table["left"]
    axes.bar(table["left"], table["count"], width=widths, align="edge", color="tab:gray", label="trained examples")
    if table["flipped"].sum():
        axes.bar(table["left"], table["flipped"], width=widths, align="edge", color="tab:red", alpha=0.8,
                 label="labels the run's label noise flipped")
    axes.axvline(0.0, color="black", linestyle="--", linewidth=1, label="doubted below 0")
    axes.set(xlabel="running margin (the given label's logit less the largest other)", ylabel="examples",
             title=title)
    axes.legend(fontsize=8)
    return save_figure(figure, path)


def plot_doubted_examples(table: pd.DataFrame, images: np.ndarray, title: str, path: str | Path) -> Path:
    """One image per row of `table` (the most doubted first), `images` (N, C, H, W) uint8 in its order,
    titled with its given and model labels (class names where `table` has them) and its margin."""
    from matplotlib.figure import Figure

    columns = len(table)
    figure = Figure(figsize=(1.6 * columns, 2.3), layout="constrained")
    for cell, (position, row) in zip(np.atleast_1d(figure.subplots(1, columns)), enumerate(table.itertuples())):
        image = images[position].transpose(1, 2, 0)
        cell.imshow(image[:, :, 0] if image.shape[2] == 1 else image, cmap="gray", vmin=0, vmax=255)
        cell.set_axis_off()
        cell.set_title(f"#{row.sample_id}\ngiven {row.given_label}\nmodel {row.model_label}\nmargin {row.margin:.2f}",
                       fontsize=7)
    figure.suptitle(title)
    return save_figure(figure, path)
