"""What a run tells its user about their labels: the estimated share of wrong ones, and the examples it
doubts, ranked, in the run folder (`label_suspects.parquet`), which `raysb train --exclude-samples`
reads to leave them out of the next run's training data (raysb.data.prepare).

The signal is the loss table's (raysb.training.selection.loss_table, built with margins): each trained
example's running margin from the training forward, so a strategy that keeps one (free-sb, InfoBatch)
reports its labels at no extra forward; one that keeps none reports nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raysb.core.label_doubt import MIN_TRAININGS, estimated_wrong_share
from raysb.training.selection.loss_table import LossTable

SUSPECTS_FILE = "label_suspects.parquet"
SUSPECT_COLUMNS = ("rank", "sample_id", "given_label", "model_label", "margin", "trainings", "last_loss")
# The histogram of running margins summary.json keeps: this many bins over this range (the outer bins
# take what lies beyond it).
MARGIN_BINS, MARGIN_RANGE = 40, 20.0


def margin_table(strategy) -> LossTable | None:
    """The strategy's loss table where it keeps margins of the whole training set (every record
    written), else None (a sharded table holds its rank's examples alone)."""
    table = strategy.loss_table()
    if table is None or not table.tracks_margins or table.sharded:
        return None
    table.flush()
    return table


def label_share(table: LossTable) -> float | None:
    """The run's estimate of its share of wrong labels from `table` (margin_table's;
    raysb.core.label_doubt.estimated_wrong_share): None before any example was trained twice."""
    return estimated_wrong_share(table.margins, table.trainings)


def suspects(table: LossTable) -> pa.Table:
    """The doubted examples, the most doubted (lowest running margin) first: rank (1 is the most
    doubted), sample id, the label it was given, the label the model gave it at its last training, its
    running margin, how often it was trained and its last training loss."""
    doubted = table.suspects()
    margins = table.margins[doubted]
    order = torch.argsort(margins, stable=True)
    column = lambda values: values[doubted][order].tolist()  # noqa: E731
    return pa.table({
        "rank": pa.array(range(1, int(doubted.sum()) + 1), pa.int64()),
        "sample_id": pa.array(column(table.index.ids), pa.int64()),
        "given_label": pa.array(column(table.labels), pa.int64()),
        "model_label": pa.array(column(table.predicted), pa.int64()),
        "margin": pa.array(margins[order].tolist(), pa.float32()),
        "trainings": pa.array(column(table.trainings), pa.int32()),
        "last_loss": pa.array(column(table.losses), pa.float32()),
    })


def margin_histogram(table: LossTable, flipped_ids: torch.Tensor) -> dict:
    """The running margins of the examples trained at least MIN_TRAININGS times, counted in MARGIN_BINS
    bins over [-MARGIN_RANGE, MARGIN_RANGE] (the outer bins take what lies beyond): of all of them, and
    of those whose labels the run's own label noise flipped (the truth, where the run made it)."""
    judged = table.trainings >= MIN_TRAININGS
    edges = torch.linspace(-MARGIN_RANGE, MARGIN_RANGE, MARGIN_BINS + 1)

    def counts(mask: torch.Tensor) -> list[int]:
        margins = table.margins[mask].clamp(-MARGIN_RANGE, MARGIN_RANGE)
        return torch.histc(margins, MARGIN_BINS, -MARGIN_RANGE, MARGIN_RANGE).long().tolist()

    flipped = torch.isin(table.index.ids, flipped_ids)
    return {"edges": edges.tolist(), "counts": counts(judged), "flipped_counts": counts(judged & flipped)}


def write_suspects(strategy, out: Path, flipped_ids: torch.Tensor) -> dict:
    """Write the run's suspects into `out` (atomically) and return what summary.json says of them (the
    estimated share, how many, the file, the margins' histogram with `flipped_ids`' part); nothing where
    the strategy keeps no margins."""
    table = margin_table(strategy)
    if table is None:
        return {}
    ranked = suspects(table)
    partial = out / (SUSPECTS_FILE + ".tmp")
    pq.write_table(ranked, partial)
    os.replace(partial, out / SUSPECTS_FILE)
    return {"suspected_label_share": label_share(table),
            "suspected_labels": ranked.num_rows, "label_suspects_file": SUSPECTS_FILE,
            "label_margin_histogram": margin_histogram(table, flipped_ids)}

