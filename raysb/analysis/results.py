"""Finished trials from disk: sweep folders (trials.parquet) and `raysb train` run folders."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from raysb.analysis import AnalysisError
from raysb.analysis.frontier import POINT_COLUMNS
from raysb.config import TrainConfig

SWEEP_FILE = "trials.parquet"
# Where a sweep keeps each trial's run folder, named by its trial_id.
SWEEP_TRIALS_FOLDER = "trials"
RUN_METRICS_FILE = "metrics.parquet"
SUMMARY_FILE = "summary.json"
# What a run's work is counted from beside its metrics (raysb.analysis.work): its training set's size,
# and the scoring cost it recorded (measured under a work budget, else the one it was given).
SUMMARY_COLUMNS = ("train_examples", "scoring_cost")
# A row counts as an evaluated epoch only once it has all three.
EVALUATED_COLUMNS = ("epoch", "wall_s", "test_error")
CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig))


@dataclasses.dataclass(frozen=True)
class _Source:
    folder: Path
    rows: pd.DataFrame
    # Prefix for this source's trial ids when another source uses the same ids.
    qualifier: str


def load_trials(paths: Sequence[str | Path]) -> pd.DataFrame:
    """Rows of every evaluated epoch of every trial under `paths`, sorted by trial_id, epoch.

    Each path is a sweep folder (trials.parquet with a trial_id column) or a
    `raysb train` output folder (metrics.parquet plus summary.json or config.yaml;
    its trial_id is the folder name).
    """
    sources = _read_sources(paths)
    frames = [source.rows for source in sources if not source.rows.empty]
    if not frames:
        raise AnalysisError(
            f"no finished trials in {', '.join(str(source.folder) for source in sources)}: "
            "no trial has an evaluated epoch"
        )
    trials = pd.concat(frames, ignore_index=True)
    return trials.sort_values(["trial_id", "epoch"], kind="stable").reset_index(drop=True)


def load_run_rows(paths: Sequence[str | Path]) -> dict[Path, pd.DataFrame]:
    """Each `raysb train` run folder in `paths` with its rows as `load_trials` gives them, in order.

    Stricter than `load_trials`, because a per-run report reads each folder's own
    files: a sweep folder (its trials are folders of their own) and a run without
    an evaluated epoch are errors, not silently passed over.
    """
    sources = _read_sources(paths)
    for source in sources:
        if (source.folder / SWEEP_FILE).is_file():
            raise AnalysisError(
                f"{source.folder} is a sweep folder, not a train run folder; give its runs instead "
                f"({source.folder / SWEEP_TRIALS_FOLDER / '*'})"
            )
        if source.rows.empty:
            raise AnalysisError(_unevaluated_run(source.folder))
    return {source.folder: source.rows for source in sources}


def config_columns(trials: pd.DataFrame) -> list[str]:
    """The train-config columns present in `trials` (strategy, selectivity, lr, seed, ...)."""
    return [key for key in CONFIG_KEYS if key in trials.columns]


def _read_sources(paths: Sequence[str | Path]) -> list[_Source]:
    # The same folder given twice (runs/x, runs/x/) is read once.
    folders = list({Path(p).resolve(): Path(p) for p in paths}.values())
    if not folders:
        raise AnalysisError("no result folders given")
    return _with_unique_trial_ids([_read_source(folder) for folder in folders])


def _read_source(folder: Path) -> _Source:
    if not folder.exists():
        raise AnalysisError(f"{folder} does not exist")
    if not folder.is_dir():
        raise AnalysisError(f"{folder} is not a folder")
    if (folder / SWEEP_FILE).is_file():
        rows, qualifier = _read_sweep(folder / SWEEP_FILE), folder.resolve().name
    elif (folder / RUN_METRICS_FILE).is_file():
        rows, qualifier = _read_run(folder), folder.resolve().parent.name
    elif (folder / SUMMARY_FILE).is_file() or (folder / "config.yaml").is_file():
        raise AnalysisError(_unevaluated_run(folder))
    else:
        raise AnalysisError(
            f"{folder} is neither a sweep folder ({SWEEP_FILE}) nor a train run folder ({RUN_METRICS_FILE})"
        )
    missing = [c for c in POINT_COLUMNS if c not in rows.columns]
    if missing:
        raise AnalysisError(f"{folder}: trial rows lack column(s) {', '.join(missing)}")
    return _Source(folder, rows.dropna(subset=list(EVALUATED_COLUMNS)), qualifier)


def _unevaluated_run(folder: Path) -> str:
    """What a train run folder without an evaluated epoch is (a run that failed in its first epoch was
    once "neither a sweep folder nor a train run folder"), with how it ended where summary.json says."""
    summary = run_summary(folder)
    if not summary:
        return (f"{folder} is a train run with no evaluated epoch and no summary.json: it was stopped before "
                "its first evaluation, or is still before it")
    error = summary.get("error")
    return (f"{folder} is a train run that stopped before its first evaluated epoch: its summary.json says status "
            f"{summary.get('status', 'unknown')}" + (f", error: {error}" if error else ""))


def _read_sweep(path: Path) -> pd.DataFrame:
    rows = pd.read_parquet(path)
    if "trial_id" in rows.columns:
        rows["trial_id"] = rows["trial_id"].astype(str)
        trials = path.parent / SWEEP_TRIALS_FOLDER
        rows = _with_summaries(rows, {trial: run_summary(trials / trial) for trial in rows["trial_id"].unique()})
    return rows


def _read_run(folder: Path) -> pd.DataFrame:
    metrics = pd.read_parquet(folder / RUN_METRICS_FILE)
    config, status = run_config(folder)
    header: dict[str, Any] = {"trial_id": folder.resolve().name}
    if status is not None:
        header["trial_status"] = status
    header.update(
        (key, value)
        for key, value in config.items()
        if key not in metrics.columns and (value is None or isinstance(value, (str, int, float, bool)))
    )
    rows = metrics.assign(**header)[[*header, *metrics.columns]]
    return _with_summaries(rows, {header["trial_id"]: run_summary(folder)})


def _with_summaries(rows: pd.DataFrame, summaries: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """`rows` with each trial's SUMMARY_COLUMNS from its summary, where it has them (a summary's scoring
    cost over the config's: it is the one the run counted its work with)."""
    for column in SUMMARY_COLUMNS:
        recorded = rows["trial_id"].map({trial: summary.get(column) for trial, summary in summaries.items()})
        recorded = recorded.astype(float)
        rows[column] = recorded.combine_first(rows[column].astype(float)) if column in rows else recorded
    return rows


def run_summary(folder: Path) -> dict[str, Any]:
    """The run's summary.json; {} while a run has none yet (it is written when training ends)."""
    summary_path = folder / SUMMARY_FILE
    if not summary_path.is_file():
        return {}
    try:
        summary = json.loads(summary_path.read_text())
    except json.JSONDecodeError as error:
        raise AnalysisError(f"{summary_path} is not valid JSON: {error}") from error
    return summary if isinstance(summary, dict) else {}


def run_config(folder: Path) -> tuple[dict[str, Any], str | None]:
    """The run's flat train config and status, from summary.json or else config.yaml."""
    summary = run_summary(folder)
    if isinstance(summary.get("config"), dict):
        return summary["config"], summary.get("status")
    config_path = folder / "config.yaml"
    if config_path.is_file():
        try:
            config = yaml.safe_load(config_path.read_text())
        except yaml.YAMLError as error:
            raise AnalysisError(f"{config_path} is not valid YAML: {error}") from error
        if isinstance(config, dict):
            return config, None
    raise AnalysisError(f"{folder} has no summary.json or config.yaml saying how it was trained")


def _with_unique_trial_ids(sources: list[_Source]) -> list[_Source]:
    uses = Counter(trial_id for source in sources for trial_id in source.rows["trial_id"].unique())
    shared = {trial_id for trial_id, count in uses.items() if count > 1}
    renamed = [_qualified(source) if shared.intersection(source.rows["trial_id"]) else source for source in sources]
    owners: dict[str, Path] = {}
    for source in renamed:
        for trial_id in source.rows["trial_id"].unique():
            if trial_id in owners:
                raise AnalysisError(
                    f"trial id {trial_id!r} occurs in both {owners[trial_id]} and {source.folder}; "
                    "give folders with distinct names"
                )
            owners[trial_id] = source.folder
    return renamed


def _qualified(source: _Source) -> _Source:
    qualified_ids = f"{source.qualifier}/" + source.rows["trial_id"]
    return dataclasses.replace(source, rows=source.rows.assign(trial_id=qualified_ids))
