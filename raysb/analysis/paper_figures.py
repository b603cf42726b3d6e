"""The math behind `raysb report`'s figures of the paper: loss CDFs, selection
probabilities, gradient similarity, confidence and accuracy by percentile, the most and
least often kept examples, time per epoch by phase, and shares of flipped labels.

Pure functions over arrays and DataFrames in the trace files' formats; no files, no plots.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import numpy.typing as npt
import pandas as pd

from raysb.training.timing import NOT_TRAINING
from raysb.training.timing import PHASES as TIMER_PHASES

# Figure 10's bars: every training phase the timer charges, evaluation being excluded from training time.
PHASES = (*(phase for phase in TIMER_PHASES if phase not in NOT_TRAINING), "other")
SIMILARITY_MEASURES = ("cosine", "same_sign")
SIMILARITY_SUBSETS = ("kept", "random")


def snapshot_epochs(epochs: Iterable[int]) -> list[int]:
    """First, middle and last of the epochs present (fewer when there are fewer)."""
    present = sorted(set(int(e) for e in epochs))
    if len(present) <= 3:
        return present
    return [present[0], present[(len(present) - 1) // 2], present[-1]]


def empirical_cdf(losses: pd.DataFrame, epochs: Iterable[int]) -> pd.DataFrame:
    """Per epoch in `epochs`: its losses ascending with cdf = fraction of that epoch's losses <= each.

    Ties get their share step by step (1/n each), which draws the same staircase.
    """
    frames = []
    for epoch in epochs:
        values = np.sort(losses.loc[losses["epoch"] == epoch, "loss"].to_numpy(dtype=float))
        cdf = np.arange(1, values.size + 1) / values.size
        frames.append(pd.DataFrame({"epoch": epoch, "loss": values, "cdf": cdf}))
    return pd.concat(frames, ignore_index=True)


def probability_fluctuation(tracked: pd.DataFrame) -> float:
    """Mean over tracked examples of the standard deviation of their selection probability over time."""
    return float(tracked.groupby("sample_id")["probability"].std(ddof=0).mean())


def similarity_by_epoch(rows: pd.DataFrame) -> pd.DataFrame:
    """Per epoch, measure (cosine, same_sign) and subset (kept, random): mean, min and max over probe batches.

    A probe batch where a measure is undefined (NaN, e.g. nothing kept) does not count.
    """
    value_columns = [f"{measure}_{subset}" for measure in SIMILARITY_MEASURES for subset in SIMILARITY_SUBSETS]
    long = rows.melt(id_vars=["epoch"], value_vars=value_columns, var_name="column").dropna(subset=["value"])
    long[["measure", "subset"]] = long["column"].str.rsplit("_", n=1, expand=True)
    stats = long.groupby(["epoch", "measure", "subset"])["value"].agg(["mean", "min", "max", "count"])
    return stats.rename(columns={"count": "probe_batches"}).reset_index()


def target_confidence(probabilities: npt.ArrayLike, labels: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Each example's probability on its true class, and whether the top-1 class is the true one."""
    probabilities = np.asarray(probabilities, dtype=float)
    labels = np.asarray(labels, dtype=np.int64)
    confidence = probabilities[np.arange(labels.size), labels]
    return confidence, probabilities.argmax(axis=1) == labels


def confidence_percentiles(confidence: npt.ArrayLike) -> pd.DataFrame:
    """Figure 8's inverse CDF: the target confidence at each percentile 0, 1, ..., 100 (linear interpolation)."""
    percentiles = np.arange(101)
    return pd.DataFrame(
        {"percentile": percentiles, "confidence": np.percentile(np.asarray(confidence, dtype=float), percentiles)}
    )


def accuracy_by_percentile(confidence: npt.ArrayLike, correct: npt.ArrayLike, bins: int = 100) -> pd.DataFrame:
    """Figure 9: the examples ranked by target confidence, cut into `bins` equal percentile bins, and the
    fraction of each bin the model classifies correctly (top-1).

    Bin p (p = 0, 100/bins, ...) holds the examples whose rank is in [p, p + 100/bins) percent of all,
    so "accuracy at the 20th percentile" is that of the examples with about the 20th-percentile
    confidence. Equal confidences keep their input order. With fewer examples than bins some bins
    are empty: 0 examples, NaN accuracy.
    """
    confidence = np.asarray(confidence, dtype=float)
    correct = np.asarray(correct, dtype=bool)
    if confidence.size == 0 or confidence.shape != correct.shape:
        raise ValueError(f"need equally many confidences and outcomes, got {confidence.shape} and {correct.shape}")
    order = np.argsort(confidence, kind="stable")
    bin_of_rank = np.arange(order.size) * bins // order.size
    examples = np.bincount(bin_of_rank, minlength=bins)
    hits = np.bincount(bin_of_rank, weights=correct[order], minlength=bins)
    with np.errstate(invalid="ignore"):
        accuracy = hits / examples
    return pd.DataFrame({"percentile": np.arange(bins) * 100 / bins, "examples": examples, "accuracy": accuracy})


def selection_extremes(counts: pd.DataFrame, count: int) -> pd.DataFrame:
    """Figure 2: the `count` training examples kept most and least often, per time offered.

    Only examples offered at least once count. Most kept: highest kept/considered
    ratio, ties to the one kept more often; least kept: lowest ratio, ties to the one
    kept less often, then to the one offered more often (the stronger evidence).
    Remaining ties go to the lower sample id. At most half the offered examples go in
    each group, so no example is both. Rows: group ("most kept" then "least kept"),
    rank (1 = most extreme), sample_id, considered, kept, kept_ratio.
    """
    offered = counts.loc[counts["considered"] > 0, ["sample_id", "considered", "kept"]]
    offered = offered.assign(kept_ratio=offered["kept"] / offered["considered"])
    count = min(count, len(offered) // 2)
    most = offered.sort_values(["kept_ratio", "kept", "sample_id"], ascending=[False, False, True], kind="stable")
    least = offered.sort_values(
        ["kept_ratio", "kept", "considered", "sample_id"], ascending=[True, True, False, True], kind="stable"
    )
    groups = [
        ranked.head(count).assign(group=group, rank=np.arange(1, count + 1))
        for group, ranked in (("most kept", most), ("least kept", least))
    ]
    columns = ["group", "rank", "sample_id", "considered", "kept", "kept_ratio"]
    return pd.concat(groups, ignore_index=True)[columns]


def seconds_per_epoch(breakdown: Mapping[str, float], epochs: int) -> dict[str, float]:
    """Figure 10's bar for one run: seconds per epoch in each of PHASES (0 for a phase it did not time)."""
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    return {phase: float(breakdown.get(phase, 0.0)) / epochs for phase in PHASES}


def flipped_shares(counts: pd.DataFrame, flipped_ids: Iterable[int]) -> tuple[float, float]:
    """(share of all keeps that went to examples with a flipped label, share of examples flipped).

    A strategy that ignored labels would keep flipped examples at the rate they occur;
    the first above the second means selection favours the mislabelled ones.
    """
    flipped = counts["sample_id"].isin(list(flipped_ids)).to_numpy()
    kept = counts["kept"].to_numpy(dtype=float)
    kept_share = kept[flipped].sum() / kept.sum() if kept.sum() else float("nan")
    return float(kept_share), float(flipped.mean())
